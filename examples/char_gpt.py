"""A character-level GPT with AdamW through psparse: a language model's loop.

    psparse-launch --workers 4 --density 0.01 examples/char_gpt.py --steps 300

The text is the Python standard library's own source (every machine with Python has it; no
download: ``psparse.data.text.corpus``). The model is the built-in ``--model gpt`` (token and
position embeddings, causal self-attention blocks, an output head tied to the token embedding;
its logits come shaped (B, vocab, T), the layout ``F.cross_entropy`` takes with (B, T) targets).
Unlike the built-in loop (``psparse-launch --model gpt --dataset text``) this loop draws windows
at random offsets. AdamW uses two parameter groups (no weight decay on biases, LayerNorms and
embeddings), warm-up then cosine, and clips the aggregate after ``exchange``. It logs a validation loss in nats per character, which is what a language model
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

import numpy as np
import torch
import torch.nn.functional as F

import psparse  # psparse
from psparse.data.text import corpus, unigram_loss
from psparse.training.models import CharGPT  # the built-in --model gpt: an ordinary nn.Module


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
    loss = F.cross_entropy(model(x), y)
    model.train()
    return float(loss)


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
            loss = F.cross_entropy(model(x), y)
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
