"""dynamix_hvd: docs/integration/pytorch_imagenet_resnet50.diff against the plain-Horovod version.

In the structure of Horovod's examples/pytorch/pytorch_imagenet_resnet50.py: linear LR warm-up
(arXiv 1706.02677) then a step schedule, gradient accumulation (--batches-per-allreduce), metrics
averaged over ranks, checkpoints on rank 0 and resumption. Differences from that file: a small
residual network and generated class-patterned images instead of ResNet-50 on ImageNet, decay
epochs as an option, plain log lines instead of tqdm, TensorBoard only with --log-dir."""
import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import horovod.torch as hvd
import dynamix_hvd as dx

# Training settings
parser = argparse.ArgumentParser(description='PyTorch ImageNet-style Example',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--train-samples', type=int, default=2048,
                    help='number of generated training images')
parser.add_argument('--val-samples', type=int, default=512,
                    help='number of generated validation images')
parser.add_argument('--image-size', type=int, default=32, help='height and width of the images')
parser.add_argument('--num-classes', type=int, default=10, help='number of classes')
parser.add_argument('--log-dir', default=None,
                    help='tensorboard log directory (needs the tensorboard package)')
parser.add_argument('--checkpoint-format', default='./checkpoint-{epoch}.pth.tar',
                    help='checkpoint file format')
parser.add_argument('--fp16-allreduce', action='store_true', default=False,
                    help='use fp16 compression during allreduce')
parser.add_argument('--batches-per-allreduce', type=int, default=1,
                    help='number of batches processed locally before '
                         'executing allreduce across workers; it multiplies '
                         'total batch size.')

# Default settings from https://arxiv.org/abs/1706.02677.
parser.add_argument('--batch-size', type=int, default=32,
                    help='input batch size for training')
parser.add_argument('--val-batch-size', type=int, default=32,
                    help='input batch size for validation')
parser.add_argument('--epochs', type=int, default=90,
                    help='number of epochs to train')
parser.add_argument('--base-lr', type=float, default=0.0125,
                    help='learning rate for a single GPU')
parser.add_argument('--warmup-epochs', type=float, default=5,
                    help='number of warmup epochs')
parser.add_argument('--decay-epochs', default='30,60,80',
                    help='epochs at which the learning rate is divided by 10')
parser.add_argument('--momentum', type=float, default=0.9,
                    help='SGD momentum')
parser.add_argument('--wd', type=float, default=0.00005,
                    help='weight decay')

parser.add_argument('--no-cuda', action='store_true', default=False,
                    help='disables CUDA training')
parser.add_argument('--seed', type=int, default=42,
                    help='random seed')


class Block(nn.Module):
    def __init__(self, channels):
        super(Block, self).__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))


def small_resnet(num_classes):
    return nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16),
                         nn.ReLU(), Block(16), Block(16), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, num_classes))


def generated_images(samples, seed):
    """Images of a class share a fixed random pattern (the same on every rank) plus noise."""
    g = torch.Generator().manual_seed(0)
    patterns = torch.randn(args.num_classes, 3, args.image_size, args.image_size, generator=g)
    g.manual_seed(seed)
    target = torch.randint(args.num_classes, (samples,), generator=g)
    data = patterns[target] + 1.5 * torch.randn(samples, 3, args.image_size, args.image_size, generator=g)
    return torch.utils.data.TensorDataset(data, target)


def train(epoch):
    model.train()
    train_loader.set_epoch(epoch)
    train_loss = Metric('train_loss')
    train_accuracy = Metric('train_accuracy')

    for batch_idx, (data, target) in enumerate(train_loader):
        adjust_learning_rate(epoch, batch_idx)

        if args.cuda:
            data, target = data.cuda(), target.cuda()
        # dynamix_hvd: a loader step is one sub-batch; every batches_per_allreduce of them make
        # one update, the exact mean over all their samples on all ranks
        output = model(data)
        train_accuracy.update(accuracy(output, target))
        loss = F.cross_entropy(output, target)
        train_loss.update(loss)
        loss.backward()
        if not optimizer.should_step():
            continue
        # Gradient is applied across all ranks
        optimizer.step()
        optimizer.zero_grad()
        if verbose:
            print('Train Epoch #{} [{}/{}] lr {!r} loss {:.4f} accuracy {:.2f}%'.format(
                epoch + 1, batch_idx, len(train_loader), optimizer.param_groups[0]['lr'],
                train_loss.avg.item(), 100. * train_accuracy.avg.item()))

    if log_writer:
        log_writer.add_scalar('train/loss', train_loss.avg, epoch)
        log_writer.add_scalar('train/accuracy', train_accuracy.avg, epoch)


def validate(epoch):
    model.eval()
    val_loss = Metric('val_loss')
    val_accuracy = Metric('val_accuracy')

    with torch.no_grad():
        for data, target in val_loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            output = model(data)

            val_loss.update(F.cross_entropy(output, target))
            val_accuracy.update(accuracy(output, target))
    if verbose:
        print('Validate Epoch #{} loss {:.4f} accuracy {:.2f}%'.format(
            epoch + 1, val_loss.avg.item(), 100. * val_accuracy.avg.item()))

    if log_writer:
        log_writer.add_scalar('val/loss', val_loss.avg, epoch)
        log_writer.add_scalar('val/accuracy', val_accuracy.avg, epoch)


# Horovod: using `lr = base_lr * hvd.size()` from the very beginning leads to worse final
# accuracy. Scale the learning rate `lr = base_lr` ---> `lr = base_lr * hvd.size()` during
# the first warm-up epochs. See https://arxiv.org/abs/1706.02677 for details.
# After the warmup reduce learning rate by 10 at each of the decay epochs.
def adjust_learning_rate(epoch, batch_idx):
    if epoch < args.warmup_epochs:
        epoch += float(batch_idx + 1) / len(train_loader)
        lr_adj = 1. / hvd.size() * (epoch * (hvd.size() - 1) / args.warmup_epochs + 1)
    else:
        lr_adj = 0.1 ** sum(epoch >= int(e) for e in args.decay_epochs.split(','))
    for param_group in optimizer.param_groups:
        param_group['lr'] = args.base_lr * hvd.size() * args.batches_per_allreduce * lr_adj


def accuracy(output, target):
    # get the index of the max log-probability
    pred = output.max(1, keepdim=True)[1]
    return pred.eq(target.view_as(pred)).cpu().float().mean()


def save_checkpoint(epoch):
    if hvd.rank() == 0:
        filepath = args.checkpoint_format.format(epoch=epoch + 1)
        state = {
            'model': model.state_dict(),
            'optimizer': optimizer.state_dict(),
        }
        torch.save(state, filepath)


# Horovod: average metrics from distributed training.
class Metric(object):
    def __init__(self, name):
        self.name = name
        self.sum = torch.tensor(0.)
        self.n = torch.tensor(0.)

    def update(self, val):
        self.sum += hvd.allreduce(val.detach().cpu(), name=self.name)
        self.n += 1

    @property
    def avg(self):
        return self.sum / self.n


if __name__ == '__main__':
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    allreduce_batch_size = args.batch_size * args.batches_per_allreduce

    hvd.init()
    torch.manual_seed(args.seed)

    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)

    # If set > 0, will resume training from a given checkpoint.
    resume_from_epoch = 0
    for try_epoch in range(args.epochs, 0, -1):
        if os.path.exists(args.checkpoint_format.format(epoch=try_epoch)):
            resume_from_epoch = try_epoch
            break

    # Horovod: broadcast resume_from_epoch from rank 0 (which will have
    # checkpoints) to other ranks.
    resume_from_epoch = hvd.broadcast(torch.tensor(resume_from_epoch), root_rank=0,
                                      name='resume_from_epoch').item()

    # Horovod: print logs on the first worker.
    verbose = 1 if hvd.rank() == 0 else 0

    # Horovod: write TensorBoard logs on first worker.
    log_writer = None
    if args.log_dir and hvd.rank() == 0:
        from torch.utils.tensorboard import SummaryWriter
        log_writer = SummaryWriter(args.log_dir)

    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    kwargs = {'num_workers': 4, 'pin_memory': True} if args.cuda else {}
    train_dataset = generated_images(args.train_samples, seed=1)
    # dynamix_hvd: per-rank batch sizes of sub-batches (micro-batches).
    train_loader = dx.AdaptiveLoader(train_dataset, [args.batch_size] * hvd.size(), hvd.rank(),
                                     seed=args.seed, **kwargs)

    val_dataset = generated_images(args.val_samples, seed=2)
    val_sampler = torch.utils.data.distributed.DistributedSampler(
        val_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    val_loader = torch.utils.data.DataLoader(val_dataset, batch_size=args.val_batch_size,
                                             sampler=val_sampler, **kwargs)

    # Set up a small residual model.
    model = small_resnet(args.num_classes)

    # For sum/average with gradient Accumulation: scale learning rate by batches_per_allreduce
    lr_scaler = args.batches_per_allreduce * hvd.size()

    if args.cuda:
        # Move model to GPU.
        model.cuda()

    # Horovod: scale learning rate by the number of GPUs.
    optimizer = optim.SGD(model.parameters(),
                          lr=(args.base_lr *
                              lr_scaler),
                          momentum=args.momentum, weight_decay=args.wd)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = dx.WeightedDistributedOptimizer(
        optimizer, model.named_parameters(), train_loader,
        compression=compression,
        backward_passes_per_step=args.batches_per_allreduce)
    controller = dx.DynamixController(train_loader, optimizer,
                                      dx.ControllerConfig(total_epochs=args.epochs), model=model)

    # Restore from a previous checkpoint, if initial_epoch is specified.
    # Horovod: restore on the first worker which will broadcast weights to other workers.
    if resume_from_epoch > 0 and hvd.rank() == 0:
        filepath = args.checkpoint_format.format(epoch=resume_from_epoch)
        checkpoint = torch.load(filepath)
        model.load_state_dict(checkpoint['model'])
        optimizer.load_state_dict(checkpoint['optimizer'])

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    for epoch in range(resume_from_epoch, args.epochs):
        train(epoch)
        validate(epoch)
        save_checkpoint(epoch)
    controller.close()
