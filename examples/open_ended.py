"""An open-ended run with early stopping, gradient accumulation and a OneCycle schedule:
LeNet-5 on MNIST, as people write it. Nobody declares the run's length: rank 0 evaluates every
--eval-every steps and calls ps.stop() when the accuracy stops improving (or the schedule is
over); the request travels with its next push, so every rank leaves after the same round.

    psparse-launch --workers 4 --policy vote --policy-arg keep=1.5 examples/open_ended.py
    psparse-launch --workers 4 ... examples/open_ended.py --fixed   # the fixed-length form

Each step is --micro micro-batches: all but the last backward inside ps.accumulating(), one
exchange. The psparse lines are marked  # psparse.
"""

import argparse

import torch
import torch.nn.functional as F
from mnist_lenet import accuracy, lenet, mnist

import psparse  # psparse


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2, help="the schedule's length (the most)")
    p.add_argument("--batch-size", type=int, default=32, help="per step and worker")
    p.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    p.add_argument("--max-lr", type=float, default=0.02)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--patience", type=int, default=3, help="evaluations without improvement")
    p.add_argument("--train-samples", type=int, default=None)
    p.add_argument("--fixed", action="store_true",
                   help="declare the length at connect and train it all (no early stopping)")
    args = p.parse_args()
    loader, test = mnist(args.batch_size, args.train_samples)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = lenet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.max_lr, momentum=0.9)
    steps = args.epochs * len(loader)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.max_lr, total_steps=steps)
    ps = psparse.connect(model, optimizer,  # psparse: open-ended unless --fixed
                         iterations=steps if args.fixed else None)
    stopper = EarlyStopping(args.patience)
    with ps:  # psparse: an exception is reported to the server; a finished run is closed
        while ps.running:  # psparse: epochs until the run ends, whatever their length
            for x, y in loader:
                loss = train_step(ps, model, x, y, args.micro)
                ps.exchange(loss)  # psparse: the mean of all workers' gradients in p.grad
                optimizer.step()
                optimizer.zero_grad()
                schedule.step()
                if not ps.running:  # psparse: that round was the last, on every rank
                    break
                if ps.iteration % args.eval_every == 0 and ps.is_evaluator:
                    acc = accuracy(model, test, samples=2000)
                    ps.log(test_acc=acc)  # psparse: into eval.jsonl
                    if not args.fixed and stopper.done(acc):
                        ps.say(f"no gain in {args.patience} evaluations: stopping")
                        ps.stop()  # psparse: the next round is every rank's last
                if not args.fixed and ps.iteration == steps - 1:
                    ps.stop()  # psparse: the schedule ends with the next round
        ps.close(test_acc=accuracy(model, test))  # psparse: the server writes summary.json


def train_step(ps, model, x, y, micro: int) -> float:
    """One step's gradient over ``micro`` micro-batches (each loss / micro): the first ones
    only accumulate (with --overlap nothing is sent before the last backward)."""
    xs, ys = x.chunk(micro), y.chunk(micro)
    total = 0.0
    with ps.accumulating():  # psparse
        for xm, ym in zip(xs[:-1], ys[:-1]):
            loss = F.cross_entropy(model(xm), ym) / micro
            loss.backward()
            total += loss.item()
    loss = F.cross_entropy(model(xs[-1]), ys[-1]) / micro
    loss.backward()  # the last micro-batch: exchanged with the others' sum
    return total + loss.item()


class EarlyStopping:
    """Done when the accuracy has not improved on its best for ``patience`` evaluations."""

    def __init__(self, patience: int):
        self.patience, self.best, self.stale = patience, 0.0, 0

    def done(self, acc: float) -> bool:
        if acc > self.best:
            self.best, self.stale = acc, 0
        else:
            self.stale += 1
        return self.stale >= self.patience


if __name__ == "__main__":
    main()
