"""A DDP script in fp16 with a GradScaler whose scale moves (large first scale, short growth
interval: it overflows, backs off and grows again), psparse as its comm hook; for
tests/test_ddp_hook.py.

    psparse-launch --workers 2 tests/user_ddp_amp.py --record DIR        # the run
    psparse-launch --workers 2 tests/user_ddp_amp.py --replay DIR        # its replay

--record writes, per rank, the scale of every step and whether the step was skipped (the
scaler backed off). --replay reads rank 0's record and trains without the skipped steps at
all (their batches are drawn and dropped: no forward, no exchange, no step) and with every
other step at the recorded scale (``scaler.update(new_scale=...)``): the run a GradScaler
would have made had it known the overflows in advance. Its weights must equal the recorded
run's, bit for bit.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import psparse
import psparse.ddp_hook


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=40)
    p.add_argument("--init-scale", type=float, default=2.0 ** 22)
    p.add_argument("--growth-interval", type=int, default=4)
    p.add_argument("--record", default=None)
    p.add_argument("--replay", default=None)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    per = 1500 // world
    x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    replay = taken = None
    if args.replay:
        replay = json.loads(open(os.path.join(args.replay, "scales-rank-0.json")).read())
        taken = [t for t, skip in enumerate(replay["skipped"]) if not skip]
    scaler = torch.amp.GradScaler("cpu", init_scale=replay["scales"][taken[0]] if replay
                                  else args.init_scale, growth_interval=args.growth_interval)
    steps = len(taken) if replay else args.iterations
    dist.init_process_group("gloo")
    net = DistributedDataParallel(model)
    ps = psparse.ddp_hook.register(net, optimizer, iterations=steps, scaler=scaler)
    scales, skipped = [], []
    with ps:
        for it in range(args.iterations):
            b = slice((it * 32) % (per - 32), (it * 32) % (per - 32) + 32)
            if replay and replay["skipped"][it]:
                continue  # the step the recorded run skipped: not taken at all
            scale = scaler.get_scale()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(net(x[b]), y[b])
            scaler.scale(loss).backward()  # the hook exchanges the unscaled buckets
            scaler.step(optimizer)
            later = [t for t in taken if t > it] if replay else []
            if later:  # the recorded run's scale at its next step taken
                scaler.update(new_scale=replay["scales"][later[0]])
            else:
                scaler.update()
            optimizer.zero_grad()
            scales.append(scale)
            skipped.append(scaler.get_scale() < scale)  # the scaler backed off: skipped
    if args.record:
        with open(os.path.join(args.record, f"scales-rank-{rank}.json"), "w") as f:
            json.dump({"scales": scales, "skipped": skipped}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
