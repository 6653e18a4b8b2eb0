"""An ordinary DDP training script with psparse's one line, ``psparse.ddp_hook.register(model)``,
and nothing else of psparse: no run length, no close (tests/test_ddp_hook.py).

    psparse-launch --workers 2 tests/user_ddp_one_line.py STEPS [EXTRA]

Every rank trains STEPS steps (rank 1 EXTRA more: a mismatch the server must name).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import psparse.ddp_hook

rank = int(os.environ["RANK"])
steps = int(sys.argv[1]) + (int(sys.argv[2]) if len(sys.argv) > 2 and rank == 1 else 0)
x, y = load_digits(return_X_y=True)
x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
dist.init_process_group("gloo")
model = DistributedDataParallel(model)
psparse.ddp_hook.register(model)  # the one line
for it in range(steps):
    b = slice(it * 16 % 1400, it * 16 % 1400 + 16)
    F.cross_entropy(model(x[b]), y[b]).backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
