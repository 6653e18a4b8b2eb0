"""PyTorch Lightning with psparse as DDP's communication (tests/test_ddp_hook.py):
``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=psparse.ddp_hook.hook)`` under psparse-launch
(LOCAL_RANK set: Lightning takes the processes as launched), on scikit-learn's digits."""

import argparse
import os

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import psparse.ddp_hook


class CPUHookDDPStrategy(DDPStrategy):
    """Lightning 2.6 registers ``ddp_comm_hook`` only on CUDA devices
    (``DDPStrategy._register_ddp_hooks``); on the CPU this registers it the same way."""

    def _register_ddp_hooks(self) -> None:
        self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

    def training_step(self, batch, _):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=20)
    args = p.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    torch.manual_seed(0)
    module = Classifier()
    state = psparse.ddp_hook.connect(module, iterations=args.iterations)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, num_nodes=1, max_steps=args.iterations,
        strategy=CPUHookDDPStrategy(process_group_backend="gloo", ddp_comm_state=state,
                             ddp_comm_hook=psparse.ddp_hook.hook),
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(x[:1500], y[:1500]), batch_size=32))
    with torch.no_grad():
        accuracy = float((module.net(x[1500:]).argmax(1) == y[1500:]).float().mean())
    state.session.close(test_acc=accuracy)


if __name__ == "__main__":
    main()
