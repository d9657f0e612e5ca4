"""dynamix_hvd: docs/integration/pytorch_synthetic_benchmark.diff against the plain-Horovod version.

In the structure of Horovod's examples/pytorch/pytorch_synthetic_benchmark.py.
Differences from that file: small built-in models instead of torchvision's, a configurable image
size and class count, the fake data set up before the optimizer, and the loss in the log."""
import argparse
import timeit

import numpy as np
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import horovod.torch as hvd
import dynamix_hvd as dx

# Benchmark settings
parser = argparse.ArgumentParser(description='PyTorch Synthetic Benchmark',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--fp16-allreduce', action='store_true', default=False,
                    help='use fp16 compression during allreduce')

parser.add_argument('--model', type=str, default='convnet', choices=['convnet', 'mlp'],
                    help='model to benchmark')
parser.add_argument('--batch-size', type=int, default=32,
                    help='input batch size')
parser.add_argument('--image-size', type=int, default=32,
                    help='height and width of the fake images')
parser.add_argument('--num-classes', type=int, default=10,
                    help='number of classes of the fake targets')

parser.add_argument('--num-warmup-batches', type=int, default=10,
                    help='number of warm-up batches that don\'t count towards benchmark')
parser.add_argument('--num-batches-per-iter', type=int, default=10,
                    help='number of batches per benchmark iteration')
parser.add_argument('--num-iters', type=int, default=10,
                    help='number of benchmark iterations')

parser.add_argument('--no-cuda', action='store_true', default=False,
                    help='disables CUDA training')


def make_model(name, image_size, num_classes):
    if name == 'mlp':
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * image_size ** 2, 256), nn.ReLU(),
                             nn.Linear(256, num_classes))
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                         nn.Flatten(), nn.Linear(32 * 16, num_classes))


args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

hvd.init()
torch.manual_seed(1234 + hvd.rank())
torch.set_num_threads(1)

if args.cuda:
    # Horovod: pin GPU to local rank.
    torch.cuda.set_device(hvd.local_rank())

# Set up standard model.
model = make_model(args.model, args.image_size, args.num_classes)

if args.cuda:
    # Move model to GPU.
    model.cuda()

optimizer = optim.SGD(model.parameters(), lr=0.01 * hvd.size())

# Horovod: (optional) compression algorithm.
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

# Set up fixed fake data
data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.LongTensor(args.batch_size).random_() % args.num_classes
if args.cuda:
    data, target = data.cuda(), target.cuda()

# dynamix_hvd: the fake batch as a data set, every rank reading its batch each step
train_loader = dx.AdaptiveLoader(
    torch.utils.data.TensorDataset(data.repeat(hvd.size() * args.num_batches_per_iter, 1, 1, 1),
                                   target.repeat(hvd.size() * args.num_batches_per_iter)),
    [args.batch_size] * hvd.size(), hvd.rank(), shuffle=False)
optimizer = dx.WeightedDistributedOptimizer(optimizer, model.named_parameters(), train_loader,
                                            compression=compression)
controller = dx.DynamixController(train_loader, optimizer, model=model)


def endless_batches():
    epoch = 0
    while True:
        train_loader.set_epoch(epoch)
        yield from train_loader
        epoch += 1


batches = endless_batches()

# Horovod: broadcast parameters & optimizer state.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

losses = []


def benchmark_step():
    data, target = next(batches)
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()
    losses.append(loss.detach())


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end='\n' if nl else '')


log('Model: %s' % args.model)
log('Batch size: %d' % args.batch_size)
device = 'GPU' if args.cuda else 'CPU'
log('Number of %ss: %d' % (device, hvd.size()))

# Warm-up
log('Running warmup...')
timeit.timeit(benchmark_step, number=args.num_warmup_batches)

# Benchmark
log('Running benchmark...')
img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / time
    log('Iter #%d: %.1f img/sec per %s, loss %.4f' % (x, img_sec, device, losses[-1].item()))
    img_secs.append(img_sec)

# Results
img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log('Img/sec per %s: %.1f +-%.1f' % (device, img_sec_mean, img_sec_conf))
log('Total img/sec on %d %s(s): %.1f +-%.1f' %
    (hvd.size(), device, hvd.size() * img_sec_mean, hvd.size() * img_sec_conf))
controller.close()
