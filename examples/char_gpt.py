"""A character-level GPT with AdamW through psparse: a language model's loop.

    psparse-launch --workers 4 --density 0.01 examples/char_gpt.py --steps 300

The text is the Python standard library's own source (every machine with Python has it; no
download). The model has token and position embeddings, causal self-attention blocks, and an
output head tied to the token embedding. AdamW uses two parameter groups (no weight decay on
biases, LayerNorms and embeddings), warm-up then cosine, and clips the aggregate after
``exchange``. It logs a validation loss in nats per character, which is what a language model
has instead of an accuracy. The unigram baseline (the loss of predicting the characters'
frequencies) is printed for comparison.

Adaptive optimizers meet sparse aggregates badly (docs/api.md): at 1% density AdamW on the
aggregate ends well above dense's loss (``--density 1``) at the same number of steps.
``--local-adam`` is the remedy: each worker takes its own Adam step and psparse sends that step
with error feedback (``memory="adam"``); the aggregate is applied by plain SGD with the same
learning rate, schedule and weight decay, and clipping moves to each worker's gradient
(``clip_norm=1.0``), since the aggregate is a step, not a gradient.

    psparse-launch --workers 4 --density 0.01 examples/char_gpt.py --steps 300 --local-adam

The psparse lines are marked  # psparse. Everything else is an ordinary PyTorch loop.
"""

import argparse
import math
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import psparse  # psparse


def corpus(chars: int) -> np.ndarray:
    """The first ``chars`` characters of the standard library's modules (sorted by name) as
    byte codes, non-ASCII bytes as 0. It is the same on every rank; it differs between Python
    versions."""
    text = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text += path.read_bytes()
        if len(text) >= chars:
            break
    codes = np.frombuffer(bytes(text[:chars]), dtype=np.uint8).copy()
    codes[codes >= 128] = 0
    return codes


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width), nn.Dropout(dropout))
        self.heads, self.dropout = heads, dropout

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    def __init__(self, vocab: int = 128, block: int = 64, width: int = 128, layers: int = 2,
                 heads: int = 4, dropout: float = 0.1):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.blocks = nn.Sequential(*[Block(width, heads, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied: one parameter, exchanged once
        for embedding in (self.tokens, self.positions):  # GPT-2's: logits start near uniform
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def windows(codes: np.ndarray, starts: np.ndarray, block: int):
    x = torch.from_numpy(np.stack([codes[s:s + block] for s in starts]).astype(np.int64))
    y = torch.from_numpy(np.stack([codes[s + 1:s + block + 1] for s in starts]).astype(np.int64))
    return x, y


@torch.no_grad()
def validation_loss(model, codes: np.ndarray, block: int) -> float:
    """Mean cross-entropy (nats per character) over the validation text in whole windows."""
    model.eval()
    starts = np.arange(0, len(codes) - block - 1, block)
    x, y = windows(codes, starts, block)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    model.train()
    return float(loss)


def unigram_loss(train: np.ndarray, valid: np.ndarray) -> float:
    """The validation loss of predicting the training text's character frequencies."""
    counts = np.bincount(train, minlength=128) + 1.0
    return float(-np.log(counts[valid] / counts.sum()).mean())


def main(**psparse_options):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16, help="windows per worker and step")
    p.add_argument("--block", type=int, default=64, help="characters per window")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30, help="steps of linear warm-up")
    p.add_argument("--chars", type=int, default=1_100_000,
                   help="characters of text: the last 10%% are the validation text")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0, help="initial weights and batches")
    p.add_argument("--local-adam", action="store_true",
                   help="each worker's own Adam step goes through psparse (memory='adam'), "
                        "applied by plain SGD; else AdamW steps on the aggregate")
    args = p.parse_args()
    rank = int(os.environ["RANK"])  # set by the launcher
    codes = corpus(args.chars)
    split = int(0.9 * len(codes))
    train, valid = codes[:split], codes[split:]
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = CharGPT(block=args.block)
    no_decay = [q for n, q in model.named_parameters() if q.dim() < 2 or "tokens" in n
                or "positions" in n]
    decay = [q for n, q in model.named_parameters() if not any(q is r for r in no_decay)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if args.local_adam:  # plain SGD's weight decay is AdamW's decoupled one
        optimizer = torch.optim.SGD(groups, lr=args.lr)
        psparse_options = {"memory": "adam", "clip_norm": 1.0, **psparse_options}  # psparse
    else:
        optimizer = torch.optim.AdamW(groups, lr=args.lr)

    def lr_at(step):  # linear warm-up, then cosine to 0 (a function of the step: resumable)
        return args.lr * min((step + 1) / args.warmup,
                             0.5 * (1 + math.cos(math.pi * step / args.steps)))

    with psparse.connect(model, optimizer, iterations=args.steps,  # psparse
                         **psparse_options) as ps:
        if ps.is_evaluator:
            ps.say(f"{sum(q.numel() for q in model.parameters())} parameters; unigram "
                   f"validation loss {unigram_loss(train, valid):.3f} nats/char")
        for step in range(ps.start, ps.iterations):
            # a pure function of the step: a resumed run draws the same windows
            starts = np.random.default_rng([args.seed, rank, step]).integers(
                0, len(train) - args.block - 1, args.batch)
            x, y = windows(train, starts, args.block)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            ps.exchange(loss)  # psparse: the aggregate is now in every p.grad
            if not args.local_adam:  # clips the aggregate, as after DDP's allreduce
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            optimizer.step()
            optimizer.zero_grad()
            if ps.is_evaluator and (step + 1) % args.eval_every == 0 and step + 1 < ps.iterations:
                ps.log(test_loss=validation_loss(model, valid, args.block))  # psparse
        final = {"test_loss": validation_loss(model, valid, args.block)} \
            if ps.is_evaluator else {}
        ps.close(**final)  # psparse: the server writes summary.json


if __name__ == "__main__":
    main()
