"""PyTorch Lightning with psparse: ``Trainer(strategy=PsparseStrategy(...))`` under psparse-launch
(LOCAL_RANK set: Lightning takes the processes as launched), on scikit-learn's digits; the
module logs ``test_acc`` in validation, which the run's final report carries
(tests/test_ddp_hook.py).

    psparse-launch --workers 2 tests/user_lightning.py [--precision 16-mixed]
"""

import argparse
import os

import lightning as L
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from psparse.lightning import PsparseStrategy


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def training_step(self, batch, _):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("test_acc", (self.net(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--precision", default="32-true")
    args = p.parse_args()
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    torch.manual_seed(0)
    module = Classifier()
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), num_nodes=1,
        max_steps=args.iterations, val_check_interval=args.iterations // 2,
        precision=args.precision, strategy=PsparseStrategy(process_group_backend="gloo"),
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, DataLoader(TensorDataset(x[:1500], y[:1500]), batch_size=32),
                DataLoader(TensorDataset(x[1500:], y[1500:]), batch_size=100))


if __name__ == "__main__":
    main()
