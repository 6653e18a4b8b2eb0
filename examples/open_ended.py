"""An open-ended run with early stopping, bf16 autocast, gradient accumulation and a OneCycle
schedule: LeNet-5 on MNIST, as people write it. Nobody declares the run's length: rank 0
evaluates every --eval-every steps and, once the schedule has brought the rate back down to
half its peak, calls ps.stop() when the accuracy has not gained more than --min-delta on its
best for --patience evaluations (or at the schedule's end); the request travels with its next
push, so every rank leaves after the same round.

Why not judge from the warm-up's end: around OneCycle's peak the accuracy shakes (measured at
--max-lr 0.05 on 2,000 images: 49% at step 29, 27% at step 39, then up again), and a patience
counted from there can stop a run that has not learned yet, at a point that moves with the
CPU's float kernels (AMX/bf16 or not). From half the peak rate on, the accuracy is near its
plateau on every kernel set measured, so a stop there is a real one.

As a user runs it (the first command below: 4 workers, the defaults, 2 epochs of all 60,000
images, a schedule of 936 steps) it reaches 98.2-98.3% test accuracy (chance: 10%) with
oneDNN's bf16 kernels, its AVX512 ones and torch's own (ONEDNN_MAX_CPU_ISA unset, AVX512_CORE,
AVX2); on the full set the accuracy keeps gaining, so it runs to the schedule's end. With the
test's small arguments it stops early, at iterations 90-110 of 124, at 87.4-91.2% on 3 seeds
under each of those settings (python -m experiments.open_ended_isa --user; docs/notes/float-kernels.md).

    psparse-launch --workers 4 --policy vote --policy-arg keep=1.5 examples/open_ended.py
    psparse-launch --workers 4 ... examples/open_ended.py --fixed   # the fixed-length form
    psparse-launch --workers 4 ... examples/open_ended.py --fixed --iterations 151

--fixed declares the length at connect (--iterations, default the schedule's) and never stops
early; the OneCycle schedule is laid out over --epochs in both forms, so an open-ended run that
stopped at iteration T and the fixed form with --iterations T+1 are the same run (same weights).
Each step is --micro micro-batches: all but the last backward inside ps.accumulating(), one
exchange. Forward passes run under torch.autocast(bfloat16) unless --precision fp32; the
parameters, hence the gradients psparse exchanges, stay float32. The psparse lines are marked
# psparse.
"""

import argparse
import contextlib

import torch
import torch.nn.functional as F
from mnist_lenet import accuracy, lenet, mnist

import psparse  # psparse

WARMUP = 0.3  # OneCycleLR's pct_start (its default): the share of the schedule spent rising


def main():
    args = parse_args()
    loader, test = mnist(args.batch_size, args.train_samples, seed=args.seed)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = lenet()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.max_lr, momentum=0.9)
    steps = args.epochs * len(loader)  # the schedule's nominal length
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.max_lr, total_steps=steps,
                                                   pct_start=WARMUP)
    peak = int(WARMUP * steps)  # the rate rises until here, then anneals
    ps = psparse.connect(model, optimizer,  # psparse: open-ended unless --fixed
                         iterations=(args.iterations or steps) if args.fixed else None)
    stopper = EarlyStopping(args.patience, args.min_delta)
    with ps:  # psparse: an exception is reported to the server; a finished run is closed
        while ps.running:  # psparse: epochs until the run ends, whatever their length
            for x, y in loader:
                loss = train_step(ps, model, x, y, args.micro, args.precision)
                ps.exchange(loss)  # psparse: the mean of all workers' gradients in p.grad
                optimizer.step()
                optimizer.zero_grad()
                schedule.step()
                if not ps.running:  # psparse: that round was the last, on every rank
                    break
                if ps.iteration % args.eval_every == 0 and ps.is_evaluator:
                    acc = accuracy(model, test, samples=args.eval_samples)
                    ps.log(test_acc=acc)  # psparse: into eval.jsonl
                    judged = ps.iteration > peak and schedule.get_last_lr()[0] <= args.max_lr / 2
                    if not args.fixed and judged and stopper.done(acc):
                        ps.say(f"no gain in {args.patience} evaluations: stopping")
                        ps.stop()  # psparse: the next round is every rank's last
                if not args.fixed and ps.iteration == steps - 1:
                    ps.stop()  # psparse: the schedule ends with the next round
        ps.close(test_acc=accuracy(model, test))  # psparse: the server writes summary.json


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2, help="the schedule's length (the most)")
    p.add_argument("--batch-size", type=int, default=32, help="per step and worker")
    p.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    p.add_argument("--max-lr", type=float, default=0.02)
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="bf16: forward passes under torch.autocast(bfloat16)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-samples", type=int, default=2000,
                   help="test images rank 0 evaluates on for early stopping")
    p.add_argument("--patience", type=int, default=3, help="evaluations without improvement")
    p.add_argument("--min-delta", type=float, default=0.0,
                   help="an improvement is a gain of more than this on the best accuracy")
    p.add_argument("--train-samples", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    p.add_argument("--fixed", action="store_true",
                   help="declare the length at connect and train it all (no early stopping)")
    p.add_argument("--iterations", type=int, default=None,
                   help="with --fixed: the length declared (default: the schedule's)")
    args = p.parse_args()
    if args.iterations is not None and not args.fixed:
        p.error("--iterations is the fixed form's length: add --fixed")
    return args


def train_step(ps, model, x, y, micro: int, precision: str) -> float:
    """One step's gradient over ``micro`` micro-batches (each loss / micro): the first ones
    only accumulate (with --overlap nothing is sent before the last backward)."""
    xs, ys = x.chunk(micro), y.chunk(micro)
    total = 0.0
    with ps.accumulating():  # psparse
        for xm, ym in zip(xs[:-1], ys[:-1]):
            loss = micro_loss(model, xm, ym, precision) / micro
            loss.backward()
            total += loss.item()
    loss = micro_loss(model, xs[-1], ys[-1], precision) / micro
    loss.backward()  # the last micro-batch: exchanged with the others' sum
    return total + loss.item()


def micro_loss(model, x, y, precision: str) -> torch.Tensor:
    """The forward pass, under bf16 autocast unless fp32: bf16 has float32's range, so no
    GradScaler; backward runs outside the autocast block, as torch recommends."""
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    with autocast:
        return F.cross_entropy(model(x), y)


class EarlyStopping:
    """Done when the accuracy has not gained more than ``min_delta`` on its best for
    ``patience`` evaluations."""

    def __init__(self, patience: int, min_delta: float = 0.0):
        self.patience, self.min_delta, self.best, self.stale = patience, min_delta, 0.0, 0

    def done(self, acc: float) -> bool:
        if acc > self.best + self.min_delta:
            self.best, self.stale = acc, 0
        else:
            self.stale += 1
        return self.stale >= self.patience


if __name__ == "__main__":
    main()
