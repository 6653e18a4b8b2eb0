"""A user's loop with local steps (docs/api.md, Local steps): tests/test_local_steps.py.

    psparse-launch --workers 2 --local-steps 4 tests/user_local_steps.py SYNCS [exchange|lose]

Each rank takes SYNCS x 4 steps of its own SGD on digits, calling ``ps.local_step(loss)``
after every ``optimizer.step()``; with ``exchange`` it calls ``ps.exchange(loss)`` instead
(the mistake the session must name); with ``lose`` the last rank dies mid-run (os._exit,
between two local steps: an --elastic run goes on without it).
"""

import os
import sys

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import psparse

rank, syncs = int(os.environ["RANK"]), int(sys.argv[1])
wrong, lose = sys.argv[2:] == ["exchange"], sys.argv[2:] == ["lose"]
x, y = load_digits(return_X_y=True)
x, y = torch.tensor(x, dtype=torch.float32) / 16, torch.tensor(y)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
with psparse.connect(model, optimizer, iterations=syncs) as ps:
    synced = 0
    for step in range(syncs * 4):
        b = slice((step * 3 + rank) * 16 % 1400, (step * 3 + rank) * 16 % 1400 + 16)
        loss = F.cross_entropy(model(x[b]), y[b])
        loss.backward()
        if wrong:
            ps.exchange(loss)
        optimizer.step()
        optimizer.zero_grad()
        synced += ps.local_step(loss)
        if lose and rank == ps.world_size - 1 and step == syncs * 2 + 1:
            os._exit(3)  # no goodbye: the server finds it lost
    assert synced == syncs, synced
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    ps.close(test_acc=acc)
