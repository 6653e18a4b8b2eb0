"""A torch.compile'd LeNet-5 on MNIST with the optimizer set-ups people use:

    --optimizers groups   one AdamW, two parameter groups (features at lr/3, the head at lr)
    --optimizers two      two optimizers (SGD with momentum for the features, Adam for the
                          head), given to connect() as a list (checkpoints keep both)
    --optimizers none     no optimizer: the loop applies p.grad itself (optimizer=None)

    psparse-launch --workers 4 --density 0.01 examples/compiled_groups.py --optimizers two

--backend picks torch.compile's backend (inductor, the default, needs a C compiler; eager or
aot_eager do not; none: no compile). psparse sees the compiled module's parameters as any
module's: compile before or after connect, but connect before the first forward pass.
"""

import argparse

import torch
import torch.nn.functional as F
from mnist_lenet import accuracy, lenet, mnist

import psparse  # psparse


def optimizers(kind: str, model, lr: float):
    """(what connect gets, the list the loop steps)."""
    features, head = model[:-1].parameters(), model[-1].parameters()
    if kind == "groups":
        adamw = torch.optim.AdamW([{"params": features, "lr": lr / 3},
                                   {"params": head}], lr=lr)
        return adamw, [adamw]
    if kind == "two":
        pair = [torch.optim.SGD(features, lr=10 * lr, momentum=0.9),
                torch.optim.Adam(head, lr=lr)]
        return pair, pair
    return None, []


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--optimizers", choices=["groups", "two", "none"], default="groups")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam(W)'s; SGD's is 10x")
    p.add_argument("--manual-lr", type=float, default=0.1,
                   help="the step size of the update by hand (--optimizers none)")
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--train-samples", type=int, default=None)
    args = p.parse_args()
    loader, test = mnist(32, args.train_samples)
    torch.manual_seed(0)
    model = lenet()
    given, stepped = optimizers(args.optimizers, model, args.lr)
    compiled = model if args.backend == "none" else torch.compile(model, backend=args.backend)
    with psparse.connect(model, given, iterations=args.iterations) as ps:  # psparse
        while ps.running:
            for x, y in loader:
                loss = F.cross_entropy(compiled(x), y)
                loss.backward()
                ps.exchange(loss)  # psparse: the aggregate in every p.grad
                if not stepped:  # optimizer=None: plain SGD by hand
                    with torch.no_grad():
                        for q in model.parameters():
                            q -= args.manual_lr * q.grad
                for opt in stepped:
                    opt.step()
                model.zero_grad()
                if not ps.running:
                    break
        ps.close(test_acc=accuracy(compiled, test))  # psparse


if __name__ == "__main__":
    main()
