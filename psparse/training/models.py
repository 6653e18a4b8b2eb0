"""Models by name: LeNet-5, ResNet-20, a small MLP, a character-level GPT, ``synthetic`` of any
size, or a user's factory.

Models: LeNet-5 (MNIST, CIFAR-10), ResNet-20 (CIFAR-10), a tiny MLP for fast tests, ``gpt``
(a small character-level transformer for ``--dataset text``: the model family adaptive
optimizers are used on), and ``synthetic``: a model of any size for load tests of the
communication system."""

from __future__ import annotations

import hashlib
import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import plugin
from ..config import MODEL_ARGS, ConfigError


class LeNet5(nn.Module):
    """LeNet-5 (LeCun et al. 1998) for images of shape ``in_shape`` = (C, H, W).

    The classic geometry is a 32x32 input: conv 5x5 -> 6, pool, conv 5x5 -> 16, pool to 5x5,
    fc 120, 84, classes. Inputs smaller than 32 are zero-padded by conv1 up to it (MNIST's
    28x28 with padding 2, as before); 32x32 and larger are not padded, and fc1 takes what
    the second pooling leaves. Sizes:

    * (1, 28, 28) MNIST: 61,706 parameters, so density 1% means k = 617;
    * (3, 32, 32) CIFAR-10: 62,006 parameters (k = 620 at 1%).
    """

    def __init__(self, num_classes: int = 10, in_shape: tuple[int, int, int] = (1, 28, 28)):
        super().__init__()
        channels, height, width = in_shape
        pad = max(0, (32 - min(height, width) + 1) // 2)

        def after(size: int) -> int:  # conv1 (padded), pool, conv2, pool
            return ((size + 2 * pad - 4) // 2 - 4) // 2

        h, w = after(height), after(width)
        self.conv1 = nn.Conv2d(channels, 6, 5, padding=pad)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * h * w, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """ResNet-20 for 32x32 colour images (He et al. 2016, CIFAR variant; ~0.27M parameters).

    Uses 1x1 projection shortcuts where the shape changes. BatchNorm running statistics are local
    to each worker (they are buffers, not gradients); evaluation uses rank 0's.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                layers.append(_BasicBlock(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        x = self.layers(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


class MLP(nn.Module):
    """Two-layer perceptron for flat inputs (the 8x8 digits set in tests)."""

    def __init__(self, in_features: int = 64, hidden: int = 32, num_classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


class _InjectGradient(torch.autograd.Function):
    """Identity on the logits; in backward, the synthetic model's gradient for its bulk."""

    @staticmethod
    def forward(ctx, logits, model, shift, *bulk):
        ctx.model, ctx.shift = model, shift
        return logits.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad, None, None, *ctx.model.bulk_gradient(ctx.shift))


class Synthetic(nn.Module):
    """A model of ``numel`` trainable parameters whose compute is small and whose gradient has a
    realistic heavy-tailed magnitude distribution: it loads the communication system (selection,
    pushes, the server's aggregation, broadcasts) as a network of that size would, at a cost in
    compute of a few passes over numel floats per iteration.

    Parameters: a linear read-out ``head`` (flattened input -> classes), which trains on the
    data as usual, and ``bulk``: the other entries, in ``layers`` matrices of 1024 columns whose
    sizes halve from one to the next (plus a vector for the remainder). The bulk takes no part
    in the arithmetic of the forward pass: a custom autograd function passes the logits through
    and, in backward, writes into every bulk entry i

        g_i = s_i * z_((i + shift) mod B)        (B bulk entries)

    - ``s``: a fixed per-entry scale, log-normal (``tail`` = the sigma of its log) times a
      per-layer factor spread over a decade (10^0.5 down to 10^-0.5: the largest layer has the
      smallest gradients), normalised so that the root mean square of g is ``scale``. The same
      entries are large in every iteration and on every worker, as in a real network;
    - ``z``: a fixed standard-normal bank read at an offset ``shift`` from a hash of the
      minibatch, so each worker and iteration draws differently and one batch always gives
      one gradient (runs, and resumed runs, repeat exactly).

    Both banks come from ``seed`` (not torch's global generator), so every rank holds the same.
    With the defaults the top 1% of bulk entries hold about 65% of the gradient's squared norm
    (LeNet-5 on MNIST: 64%; a Gaussian's: 8.5%). Memory: the two banks take 8 bytes per entry
    beside the parameters, and each backward one temporary numel-sized float32 vector.
    """

    WIDTH = 1024

    def __init__(self, in_shape: tuple[int, ...], num_classes: int, numel: int = 1_000_000,
                 layers: int = 4, tail: float = 1.15, scale: float = 1e-3, seed: int = 0):
        super().__init__()
        in_features = math.prod(in_shape)
        self.head = nn.Linear(in_features, num_classes)
        head = sum(p.numel() for p in self.head.parameters())
        if numel <= head:
            raise ConfigError(f"model-arg numel={numel}: the synthetic model needs more than "
                              f"its {head}-entry read-out head ({in_features} inputs x "
                              f"{num_classes} classes + biases)")
        bulk = numel - head
        shares = [bulk * 2 ** (layers - 1 - j) // (2 ** layers - 1) for j in range(layers)]
        shapes = [(n // self.WIDTH, self.WIDTH) for n in shares if n >= self.WIDTH]
        rest = bulk - sum(r * w for r, w in shapes)
        shapes += [(rest,)] if rest else []
        on_meta = self.head.weight.device.type == "meta"  # sized, not built (the launcher)
        self.bulk = nn.ParameterList(nn.Parameter(torch.zeros(shape)) for shape in shapes)
        self.bulk_numel = bulk
        self.seed = seed
        self._scale = self._noise = None
        if not on_meta:
            self._scale, self._noise = self._banks(shapes, tail, scale, seed)

    @staticmethod
    def _banks(shapes, tail: float, scale: float, seed: int):
        gen = torch.Generator().manual_seed(seed)
        sizes = [math.prod(s) for s in shapes]
        s = torch.randn(sum(sizes), generator=gen).mul_(tail).exp_()
        offset = 0
        for j, n in enumerate(sizes):  # 10^0.5 for the first (largest) layer ... 10^-0.5
            s[offset:offset + n] *= 10 ** (0.5 - j / max(1, len(sizes) - 1))
            offset += n
        s *= scale / float(s.square().mean().sqrt())  # E[z^2] = 1: rms(g) = scale
        return s, torch.randn(sum(sizes), generator=gen)

    def batch_shift(self, x: torch.Tensor) -> int:
        """The bank offset this minibatch reads z at: a hash of its bytes and the seed."""
        data = x.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
        digest = hashlib.blake2b(data, digest_size=8, key=self.seed.to_bytes(8, "little",
                                                                              signed=True))
        return int.from_bytes(digest.digest(), "little") % self.bulk_numel

    def bulk_gradient(self, shift: int) -> list[torch.Tensor]:
        """The synthetic gradient of every bulk tensor for bank offset ``shift``."""
        device = self.bulk[0].device
        if self._noise.device != device:
            self._scale, self._noise = self._scale.to(device), self._noise.to(device)
        flat = torch.empty(self.bulk_numel, device=device)
        n = self.bulk_numel - shift
        flat[:n] = self._noise[shift:]
        flat[n:] = self._noise[:shift]
        flat.mul_(self._scale)
        grads, offset = [], 0
        for p in self.bulk:
            grads.append(flat[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        return grads

    def forward(self, x):
        logits = self.head(torch.flatten(x, 1))
        if not (torch.is_grad_enabled() and self.training and self._noise is not None
                and any(p.requires_grad for p in self.bulk)):
            return logits
        return _InjectGradient.apply(logits, self, self.batch_shift(x), *self.bulk)


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

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
    """A character-level GPT: token and position embeddings, ``layers`` causal blocks, a final
    LayerNorm and an output head tied to the token embedding (one parameter, exchanged once).
    At the defaults (128 symbols, 64 positions, width 128, 2 blocks of 4 heads): 421,376
    parameters. ``forward`` maps (B, T) token ids to logits shaped (B, vocab, T), the layout
    ``F.cross_entropy`` takes with (B, T) targets (so the built-in loop's loss and accuracy
    work per character unchanged)."""

    def __init__(self, vocab: int = 128, block: int = 64, width: int = 128, layers: int = 2,
                 heads: int = 4, dropout: float = 0.1):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.blocks = nn.Sequential(*[Block(width, heads, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied
        for embedding in (self.tokens, self.positions):  # GPT-2's: logits start near uniform
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, idx):
        h = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(h))).transpose(1, 2)


MODELS = {"lenet": LeNet5, "resnet20": ResNet20, "mlp": MLP, "gpt": CharGPT,
          "synthetic": Synthetic}
# --model-arg of the synthetic model: converters and defaults (config.MODEL_ARGS: the keys)
SYNTHETIC_ARGS = {"numel": 1_000_000, "layers": 4, "tail": 1.15, "scale": 1e-3, "seed": 0}
_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}


def parse_count(key: str, text: str) -> int:
    """A positive integer written 25000000, 25_000_000, 25M, 2.5e7, 100k or 1G."""
    t = str(text).strip().replace("_", "").lower()
    mult = _SUFFIXES.get(t[-1:], 1)
    try:
        value = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        value = float("nan")
    if not (value >= 1 and value == int(value)):
        raise ConfigError(f"model-arg {key}={text!r}: expected a positive whole number such as "
                          "1000000, 25M, 2.5e7 or 100k")
    return int(value)


def synthetic_options(args: dict[str, str]) -> dict:
    """The synthetic model's keyword arguments from --model-arg strings, checked."""
    unknown = sorted(set(args) - set(MODEL_ARGS["synthetic"]))
    if unknown:
        raise ConfigError(f"model-arg {unknown[0]!r} unknown for model 'synthetic'; it takes "
                          f"{', '.join(MODEL_ARGS['synthetic'])}")
    out = dict(SYNTHETIC_ARGS)
    for key, text in args.items():
        if key in ("numel", "layers"):
            out[key] = parse_count(key, text)
        elif key == "seed":
            try:
                out[key] = int(text)
            except ValueError:
                out[key] = -1
            if not 0 <= out[key] < 2**63:
                raise ConfigError(f"model-arg seed={text!r}: expected an integer in "
                                  "[0, 2^63)")
        else:
            try:
                value = float(text)
            except ValueError:
                value = float("nan")
            if not (math.isfinite(value) and value > 0 if key == "scale" else
                    math.isfinite(value) and value >= 0):
                raise ConfigError(f"model-arg {key}={text!r}: expected a "
                                  f"{'positive' if key == 'scale' else 'non-negative'} number")
            out[key] = value
    if out["layers"] > 16:
        raise ConfigError(f"model-arg layers={out['layers']}: at most 16")
    return out


def check_factory(name: str, model_args: dict[str, str]):
    """The model factory ``name`` ("package.module:factory"), once its signature is known to
    take (in_shape, num_classes, **model_args); ValueError naming the problem otherwise."""
    factory = plugin.load(name, "model factory")
    try:
        inspect.signature(factory).bind((1, 1, 1), 1, **model_args)
    except TypeError as exc:
        raise ConfigError(f"model factory {name!r} cannot be called as factory(in_shape, "
                          f"num_classes{''.join(f', {k}=...' for k in model_args)}): "
                          f"{exc}") from None
    except ValueError:
        pass  # no signature to inspect (a builtin): the call itself will tell
    return factory


def build_model(name: str, in_shape: tuple[int, ...], num_classes: int,
                model_args: dict[str, str] | None = None) -> nn.Module:
    """A built-in network by name, or ``package.module:factory`` called as
    ``factory(in_shape, num_classes, **model_args)`` (in_shape = (C, H, W)); it must return an
    nn.Module. ``model_args``: --model-arg as strings (synthetic's are converted and checked)."""
    model_args = dict(model_args or {})
    if plugin.is_spec(name):
        factory = check_factory(name, model_args)
        model = factory(tuple(in_shape), num_classes, **model_args)
        if not isinstance(model, nn.Module):
            raise ValueError(f"model factory {name!r} returned {type(model).__name__}, "
                             "expected a torch.nn.Module")
        return model
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    if name == "synthetic":
        return Synthetic(tuple(in_shape), num_classes, **synthetic_options(model_args))
    if model_args:
        raise ConfigError(f"model {name!r} takes no model-arg (they are for "
                          f"{', '.join(MODEL_ARGS)} and package.module:factory models)")
    text = len(in_shape) == 1  # (characters,): token ids
    if (name == "gpt") != text:
        raise ConfigError(f"model {name!r} trains on "
                          f"{'text (--dataset text)' if name == 'gpt' else 'images'}, and the "
                          f"data set's samples are {'text' if text else 'images'} "
                          f"{tuple(in_shape)}: use --model gpt with --dataset text")
    if name == "gpt":
        return CharGPT(vocab=num_classes, block=in_shape[0])
    if name == "mlp":
        n = 1
        for d in in_shape:
            n *= d
        return MLP(n, 32, num_classes)
    if name == "lenet":
        return LeNet5(num_classes, tuple(in_shape))
    return MODELS[name](num_classes)
