"""What the run's options refuse together, and the --server-limit syntax: rules the
configuration (config.py), the server and the worker each check with the facts they know."""

from __future__ import annotations

# What a round in buckets (--overlap / --bucket-mb) does not work with: one list, checked by the
# configuration (options), the worker (its policy object: a user's class) and the server (the
# agreed run and its own options), each with the facts it knows.
BUCKET_REFUSALS = (
    ("whole_model", "needs --granularity layer (whole-model selection needs the whole "
     "gradient, so it keeps one round per iteration)"),
    ("dense", "needs a density below 1 (a dense exchange has no selection to split by "
     "bucket)"),
    ("two_phase", "does not work with the two-phase policy {policy} (its proposal round needs "
     "every layer's accumulator; it keeps one round per iteration)"),
    ("overrides_select", "does not work with policy {policy}, which overrides select() (a "
     "bucket needs per-layer selection: select_slice or score)"),
    ("record_selections", "does not work with --record-selections (it records the whole "
     "gradient's top-k)"),
    ("scalecom", "does not work with --memory scalecom (its memory update after a push covers "
     "the whole vector)"),
    ("adam", "does not work with --memory adam (its Adam step advances once per round, over "
     "the whole vector)"),
    ("clip", "does not work with --clip-norm (clipping needs the whole gradient's norm before "
     "any bucket is accumulated)"),
    ("shards", "does not work with --servers > 1 yet (use one server)"),
    ("server_limit", "does not work with --server-limit (the limit cuts the whole round's "
     "aggregate)"),
    ("elastic", "does not work with --elastic yet"),
)


def bucket_refusal(**facts: bool) -> str | None:
    """Why a round in buckets cannot run given these facts (names of BUCKET_REFUSALS), or
    None; "{policy}" in the text is for the caller to fill."""
    unknown = set(facts) - {name for name, _ in BUCKET_REFUSALS}
    if unknown:
        raise ValueError(f"unknown bucket facts {sorted(unknown)}")
    for name, why in BUCKET_REFUSALS:
        if facts.get(name):
            return why
    return None


def memory_refusal(memory: str, beta, memories) -> str | None:
    """Why --memory and --memory-beta cannot go together, or None."""
    if memory not in memories:
        return f"memory must be one of {', '.join(memories)}, got {memory!r}"
    if beta is not None and memory != "scalecom":
        return (f"memory-beta {beta} is the scalecom memory's low-pass filter factor; memory "
                f"{memory!r} has none (drop memory-beta, or use memory scalecom)")
    if beta is not None and not (isinstance(beta, (int, float)) and 0 < beta <= 1):
        return (f"memory-beta must be in (0, 1] (1: plain error feedback; ScaleCom's filter "
                f"smooths the memory over about 1/beta rounds), got {beta!r}")
    return None


def warmup_refusal(density_warmup: float, dense_warmup: int,
                   iterations: int | None = None) -> str | None:
    """Why the warm-ups (--density-warmup, --dense-warmup) cannot run as given, or None."""
    if not density_warmup >= 0:
        return "density-warmup must be >= 0 (epochs)"
    if not (isinstance(dense_warmup, int) and dense_warmup >= 0):
        return f"dense-warmup must be a whole number of iterations >= 0, got {dense_warmup!r}"
    if dense_warmup and density_warmup:
        return ("dense-warmup (density 1 for N iterations) and density-warmup (DGC's four-fold "
                "schedule) are two warm-ups: choose one")
    if iterations and dense_warmup >= iterations:
        return (f"dense-warmup {dense_warmup} covers the whole run of {iterations} iterations: "
                "give fewer (or --density 1 for a dense run)")
    return None


def dense_warmup_refusal(policy: str, two_phase: bool, overrides_select: bool) -> str | None:
    """Why a policy's --dense-warmup would not send every entry, or None: the warm-up asks it
    for k = numel, which a one-phase rule that ranks entries answers with all of them."""
    if not (two_phase or overrides_select):
        return None
    how = "proposes first" if two_phase else "chooses its own count (it overrides select())"
    return (f"--dense-warmup asks the policy for k = numel entries, and policy {policy!r} {how}: "
            "its warm-up would not be dense; use a one-phase rule that ranks entries (topk, "
            "ema, core, penalty, frequency) or --density-warmup")


# The built-in loop's optimizers (--optimizer; training/loop.py's make_optimizer)
OPTIMIZERS = ("sgd", "adamw")


def loop_refusal(optimizer: str, memory: str, nesterov: bool, clip_aggregate: float | None,
                 freeze_variance: bool = False, dense_warmup: int = 0) -> str | None:
    """Why the built-in loop's optimizer options cannot go together, or None."""
    if freeze_variance and (optimizer != "adamw" or memory == "adam"):
        return ("freeze-variance freezes the second moment of the AdamW that applies the "
                "aggregate: it needs --optimizer adamw without --memory adam (whose Adam step "
                "is each worker's own)")
    if freeze_variance and not dense_warmup:
        return ("freeze-variance freezes AdamW's second moment at the end of the dense "
                "warm-up: give its length with --dense-warmup N (1-bit Adam used about 15-25% "
                "of the run)")
    if optimizer not in OPTIMIZERS:
        return f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}"
    if optimizer == "adamw" and memory == "dgc":
        return ("memory dgc is SGD's momentum correction; with --optimizer adamw use --memory "
                "adam (each worker's own Adam step) or the default residual")
    if optimizer == "adamw" and nesterov:
        return "nesterov is SGD's momentum (drop it with --optimizer adamw)"
    if clip_aggregate is not None and not clip_aggregate > 0:
        return "clip-aggregate must be > 0"
    if clip_aggregate is not None and memory == "adam":
        return ("with --memory adam the aggregate is an Adam step, not a gradient: clip each "
                "worker's gradient with --clip-norm instead of --clip-aggregate")
    return None


def parse_limit(text: str) -> tuple[float, str]:
    """``"5000"`` -> (5000, "entries"); ``"2k"`` -> (2, "k"); ``"Nk"`` -> (0, "Nk")."""
    t = str(text).strip()
    try:
        if t.lower() == "nk":
            return 0.0, "Nk"
        if t.lower().endswith("k"):
            mult = float(t[:-1])
            if mult > 0:
                return mult, "k"
        elif int(t) > 0:
            return float(int(t)), "entries"
    except ValueError:
        pass
    raise ValueError(f"server limit {text!r}: expected an entry count (5000), a multiple of k "
                     "(2k, 1.5k) or Nk (world size times k)")


def model_args_refusal(model: str, model_args, takes: dict) -> str | None:
    """Why --model-arg cannot go with --model, or None: key=value entries, for a model that
    takes them (``takes``: config.MODEL_ARGS), with keys it knows (the values are checked where
    the model is built: models.build_model)."""
    for item in model_args or []:
        if not (isinstance(item, str) and "=" in item and item.partition("=")[0].strip()):
            return f"model-arg entries must be key=value, got {item!r}"
    if not model_args or ":" in model:
        return None  # a factory's own keyword arguments: its signature checks them
    if model not in takes:
        return (f"model {model!r} takes no model-arg (they are for {', '.join(takes)} and "
                "package.module:factory models)")
    for item in model_args:
        key = item.partition("=")[0].strip()
        if key not in takes[model]:
            return f"model-arg {key!r} unknown for model {model!r}; it takes {', '.join(takes[model])}"
    return None


# --local-steps: the outer step's defaults, DiLoCo's (Douillard et al. 2023: SGD with Nesterov
# momentum 0.9 at learning rate 0.7 on the averaged pseudo-gradient)
DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM = 0.7, 0.9


def local_steps_refusal(local_steps, outer_lr, outer_momentum, *, memory: str, overlap: bool,
                        freeze_variance: bool) -> str | None:
    """Why --local-steps and the outer step's options cannot run as given, or None."""
    if not (isinstance(local_steps, int) and local_steps >= 1):
        return f"local-steps must be a whole number >= 1, got {local_steps!r}"
    if outer_lr is not None and not outer_lr > 0:
        return f"outer-lr must be > 0, got {outer_lr!r}"
    if outer_momentum is not None and not 0 <= outer_momentum < 1:
        return f"outer-momentum must be in [0, 1), got {outer_momentum!r}"
    if local_steps == 1:
        if (outer_lr or 1) != 1 or outer_momentum:
            return ("outer-lr and outer-momentum are the outer step of --local-steps H >= 2; "
                    "with one local step the aggregate goes to the optimizer every iteration "
                    "(outer-lr 1 and outer-momentum 0 are that; give --local-steps)")
        return None
    if memory in ("dgc", "adam"):
        return (f"--local-steps exchanges pseudo-gradients (the change of the weights over the "
                f"local steps), and memory {memory!r} would apply momentum or Adam to them a "
                "second time; use --memory residual or scalecom (the outer step has momentum)")
    if overlap:
        return ("--local-steps does not work with --overlap: the pseudo-gradient exists only "
                "after the local steps, not during a backward pass")
    if freeze_variance:
        return ("--local-steps does not work with --freeze-variance: the inner AdamW steps on "
                "each worker's own gradients, so there is no aggregate variance to freeze")
    return None
