"""A user's loop with local steps (docs/api.md, Local steps): tests/test_local_steps.py.

    psparse-launch --workers 2 --local-steps 4 tests/user_local_steps.py SYNCS [exchange]

Each rank takes SYNCS x 4 steps of its own SGD on digits, calling ``ps.local_step(loss)``
after every ``optimizer.step()``; with ``exchange`` it calls ``ps.exchange(loss)`` instead
(the mistake the session must name).
"""

import os
import sys

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import psparse

rank, syncs = int(os.environ["RANK"]), int(sys.argv[1])
wrong = sys.argv[2:] == ["exchange"]
x, y = load_digits(return_X_y=True)
x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
with psparse.connect(model, optimizer, iterations=syncs) as ps:
    synced = 0
    for step in range(syncs * 4):
        b = slice((step * 2 + rank) * 16 % 1400, (step * 2 + rank) * 16 % 1400 + 16)
        loss = F.cross_entropy(model(x[b]), y[b])
        loss.backward()
        if wrong:
            ps.exchange(loss)
        optimizer.step()
        optimizer.zero_grad()
        synced += ps.local_step(loss)
    assert synced == syncs, synced
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    ps.close(test_acc=acc)
