"""Run configuration: one set of options shared by psparse-launch, psparse-server, psparse-worker.

``RunConfig`` declares every option once, with its default, help and scope, and checks a set
of values (``validate``). Where the values come from -- flags, config files, the launcher's
environment -- is ``psparse.options``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from .option_rules import (
    bucket_refusal,
    local_steps_refusal,
    loop_refusal,
    memory_refusal,
    model_args_refusal,
    parse_limit,
    warmup_refusal,
)
from .wire.transport import parse_rate

# Names only (the server imports this module and must not pull in torch); models.MODELS and
# data.DATASETS are checked against these in the tests.
MODELS = ("lenet", "mlp", "resnet20", "gpt", "synthetic")
MODEL_ARGS = {"synthetic": ("numel", "layers", "tail", "scale", "seed")}  # the models that take
# --model-arg, and their keys (models.SYNTHETIC_ARGS holds the defaults; a test keeps them equal)
DATASETS = ("mnist", "cifar10", "digits", "text")
# The built-in loop's (and the DDP baseline's) length without --epochs or --iterations
DEFAULT_EPOCHS = 8.0
# The built-in loop's learning-rate schedules (--lr-schedule; training/schedule.py)
LR_SCHEDULES = ("step", "cosine")
# The error-feedback memories (psparse/policies/memory.py takes both from here)
MEMORIES = ("residual", "dgc", "scalecom", "adam")
# --memory adam: the local Adam step's (beta1, beta2, eps), torch.optim.Adam's defaults
ADAM_BETAS = (0.9, 0.999, 1e-8)
SCALECOM_BETA = 0.1  # ScaleCom's low-pass filter's default beta (policies/memory.py's docstring)


# Policies with a proposal phase (policies.*.two_phase); names only, like MODELS (a test keeps
# them equal). --overlap refuses them.
TWO_PHASE_POLICIES = ("cltk", "vote")
# --overlap without --bucket-mb: buckets of about this many MB of gradients (DDP's default is
# 25 MB, for models of 100M parameters; psparse's are 60k (LeNet-5) to 0.27M (ResNet-20))
DEFAULT_BUCKET_MB = 0.1


# Keys psparse-launch adds to config.json beside the options (which code made the run, which
# baseline it trained); reading a config.json back skips them.
RECORD_ONLY = ("provenance", "baseline", "powersgd_rank", "powersgd_warmup")


class ConfigError(ValueError):
    """A configuration value or file is invalid; the text names it."""


def option(default, help: str, *, agreed: bool = True, server: bool = False,
           launcher: bool = False):
    """A RunConfig field with its help and scope (see RunConfig)."""
    return field(default=default, metadata={"help": help, "agreed": agreed, "server": server,
                                            "launcher": launcher})


def need(condition, message: str) -> None:
    """A ConfigError with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)


@dataclass
class RunConfig:
    """Every option, declared once: its default, its help (the flag's and the docs'), and its
    scope -- ``agreed`` (every worker must share it: the run description's ``config``, the
    default), ``server`` (psparse-server takes it) and ``launcher`` (set on psparse-launch or
    psparse-server, never in one worker's ``connect()``: the server acts on it too)."""

    # What to train.
    model: str = option("lenet",
        f"network to train: {', '.join(sorted(MODELS))} (a load-test model of any "
        "size: --model-arg numel=25M), or package.module:factory (factory(in_shape, "
        "num_classes, **model_args) -> torch.nn.Module)")
    model_args: list[str] | None = option(None,
        "model parameter key=value, repeatable: synthetic takes numel (1M, 25M, 2.5e7; "
        "default 1M), layers, tail, scale, seed; a factory gets them as keyword "
        "arguments (strings)")
    dataset: str = option("mnist",
        f"training data: {', '.join(DATASETS)}, or package.module:factory "
        "(factory(data_dir) -> psparse.data.Dataset)")
    data_dir: str | None = option(None,
        "folder holding the data sets (default: $PSPARSE_DATA or ./data)", agreed=False)
    workers: int = option(8, "number of workers N (world size)", server=True, launcher=True)
    # How much to send: k = round(density * numel) entries per worker per iteration.
    density: float = option(0.01,
        "fraction of the model's entries each worker pushes per iteration (k = density "
        "x numel; 1.0 is dense)")
    granularity: str = option("model",
        "select over the whole model, or per layer with k split by layer size")
    # Communication in buckets of layers (DDP-style), pushed as they are ready in backward.
    overlap: bool = option(False,
        "with --granularity layer: push each bucket of layers (--bucket-mb) from "
        "backward as soon as its gradients are ready, so communication overlaps the "
        "rest of backward (same results as without; docs/api.md, Overlap)")
    bucket_mb: float | None = option(None,
        "with --granularity layer: exchange the gradient in buckets of layers of about "
        "this many MB, in reverse layer order, as parts of each round (default: "
        f"{DEFAULT_BUCKET_MB} with --overlap, else one round)")
    policy: str = option("topk",
        "selection policy: topk, randomk, threshold, frequency, ema, penalty, cltk, "
        "core, vote, micro, exdyna, or package.module:ClassName")
    policy_args: list[str] | None = option(None,
        "policy parameter key=value (repeatable; default: the policy's defaults)")
    memory: str = option("residual",
        "error feedback: residual (acc += g), dgc (momentum correction + factor "
        "masking; the optimizer then applies plain SGD), scalecom (ScaleCom's "
        "low-pass-filtered memory, m = (1-beta) m + beta (m + g - sent)) or adam (each "
        "worker's own Adam step, acc += m_hat / (sqrt(v_hat) + eps), sent with error feedback; "
        "the optimizer then applies plain SGD: for AdamW users at low density)")
    # scalecom's filter factor; validate() sets the default
    memory_beta: float | None = option(None,
        "with --memory scalecom: the low-pass filter's beta in (0, 1]; 1 is plain error "
        f"feedback (default: {SCALECOM_BETA})")
    # The values' wire format: agreed through the run description's "values" field, not config
    values: str = option("fp32",
        "format of every pushed and broadcast value: fp32 (4 bytes), bf16 or fp16 (2), int8 "
        "(1, plus a float32 scale per --value-block values) or int4 (1/2, the same scales); "
        "what rounding takes from a push goes back into the worker's accumulator, and the "
        "server keeps the broadcast's rounding error for the next round (docs/api.md, Value "
        "formats)", agreed=False)
    value_block: int = option(128,
        "with --values int8/int4: values per float32 scale (larger: fewer scale bytes, a "
        "coarser scale for small values)", agreed=False)
    no_broadcast_memory: bool = option(False,
        "with --values other than fp32: the server drops the broadcast's rounding error "
        "instead of adding it into the next round's aggregate (to measure what that memory "
        "buys)", agreed=False)
    clip_norm: float | None = option(None,
        "clip each local gradient to this L2 norm before accumulating (default: no "
        "clipping)")
    density_warmup: float = option(0.0,
        "density warm-up, the DGC paper's four-fold schedule (not its released code's, "
        "which interpolates geometrically to --density): 25% in epoch 1, 6.25% in epoch 2, "
        "1.56% in epoch 3, ... "
        "for this many epochs, never below --density")
    dense_warmup: int = option(0,
        "send every entry (density 1) for this many first iterations, then --density: the "
        "dense warm-up of 1-bit Adam's schedule, whose end --freeze-variance freezes AdamW's "
        "second moment at (default: none)")
    # How long and how.
    epochs: float | None = option(None,
        "training length in passes over the data (ignored when --iterations is given; "
        f"default: {DEFAULT_EPOCHS:g} for the built-in loop; a script's run is as long as "
        "connect() says: iterations, or epochs x its batches_per_epoch when --epochs is given, "
        "else open-ended)")
    iterations: int | None = option(None,
        "training length in synchronous iterations (default: from --epochs)")
    batch_size: int = option(32, "minibatch size per worker")
    local_steps: int = option(1,
        "each worker takes this many optimizer steps (--lr, --optimizer) on its own data, "
        "then exchanges its pseudo-gradient (the weights' change since the last "
        "synchronisation) like a gradient; every worker applies the aggregate with the outer "
        "step (--outer-lr, --outer-momentum). --iterations counts synchronisations (default 1: "
        "every iteration exchanges the gradient; docs/api.md, Local steps)")
    outer_lr: float | None = option(None,
        "with --local-steps >= 2: the outer step's learning rate on the aggregate "
        "pseudo-gradient (default: DiLoCo's 0.7)")
    outer_momentum: float | None = option(None,
        "with --local-steps >= 2: the outer step's Nesterov momentum (default: DiLoCo's "
        "0.9; 0 is plain SGD)")
    lr: float = option(0.05, "learning rate applied to the aggregate (SGD's, or AdamW's)")
    lr_steps: str | None = option(None,
        "epochs at which the learning rate is multiplied by 0.1, comma-separated (e.g. "
        "80,120; default: constant)")
    lr_schedule: str = option("step",
        "the built-in loop's learning rate over the run: step (x0.1 at every --lr-steps "
        "epoch) or cosine (from --lr down to 0 at the run's last iteration)")
    warmup_epochs: float = option(0.0,
        "the built-in loop first ramps the learning rate linearly up to --lr over this many "
        "epochs (W iterations: lr x (it+1)/W; Goyal et al. 2017), then follows --lr-schedule "
        "(default: no warm-up)")
    optimizer: str = option("sgd",
        "the built-in loop's optimizer: sgd (--momentum, --nesterov, --weight-decay) or adamw "
        "(torch.optim.AdamW: --lr, --weight-decay as its decoupled decay, betas 0.9, 0.999); "
        "with --memory adam the Adam step is each worker's own (sent with error feedback) and "
        "the aggregate is applied by plain SGD")
    momentum: float = option(0.9, "SGD momentum")
    nesterov: bool = option(False, "SGD with Nesterov momentum (needs --momentum > 0)")
    weight_decay: float = option(0.0, "weight decay (SGD's, or AdamW's decoupled decay)")
    freeze_variance: bool = option(False,
        "the built-in loop's --optimizer adamw stops updating its second moment at the end of "
        "--dense-warmup (1-bit Adam's schedule, Tang et al. 2021): from then on its step is a "
        "fixed scaling of the momentum of the aggregates, so error feedback's late entries "
        "count in full (psparse.training.optim.FrozenVarianceAdamW; docs/api.md)")
    clip_aggregate: float | None = option(None,
        "the built-in loop clips the aggregate (the exchanged gradient every replica holds "
        "alike) to this L2 norm before the optimizer step, as DDP users clip after the "
        "allreduce (--clip-norm instead clips each worker's own gradient before error "
        "feedback); default: no clipping")
    amp: str | None = option(None,
        "the built-in loop's (and --baseline runs') forward pass under torch.autocast in bf16 "
        "or fp16 (with a GradScaler every rank skips alike); weights, accumulator and wire "
        "stay float32 (or --values) (default: float32)")
    channels_last: bool = option(False,
        "the built-in loop feeds images in channels-last memory order: channels-last "
        "convolutions (faster on oneDNN CPUs and tensor cores; other floats)")
    seed: int = option(0, "seed for initial weights, data shards and shuffling")
    record_selections: bool = option(False,
        "workers save each iteration's top-k gradient indices and sent indices to "
        "RUN_DIR/selections-rank-R.npz, for psparse-locality", agreed=False)
    probe_recall: int = option(0,
        "every this many iterations, measure how much of the global top-k (of the sum of "
        "all workers' accumulators) the round's aggregate holds, into RUN_DIR/recall.jsonl "
        "(0: never; needs a run directory every worker shares; no extra traffic)")
    checkpoint_every: int = option(0,
        "every this many iterations the server and every worker save their state to "
        "RUN_DIR/checkpoint/ (0: never); --resume RUN_DIR continues",
        agreed=False, server=True, launcher=True)
    eval_every: int = option(100,
        "rank 0 evaluates test accuracy every this many iterations (0: only at the end)")
    eval_samples: int | None = option(None,
        "evaluate on this many test images, a fixed random subset (seed 0, the same in "
        "every run), instead of the whole test set: for slow hosts (default: all)")
    check_every: int = option(10,
        "workers send a weight checksum every this many iterations; the server stops "
        "the run if replicas differ")
    threads: int | None = option(None,
        "torch threads per worker (default: cores / workers on this host, at least 1)",
        agreed=False)
    device: str = option("cpu",
        "cpu, cuda (one GPU per worker: local rank modulo the visible devices; "
        "CUDA_VISIBLE_DEVICES respected) or auto")
    # Server and robustness.
    servers: int = option(1,
        "key-range server shards S: the flat parameter vector is split into S "
        "contiguous ranges of about equal size, each served by its own server process "
        "(psparse-launch starts them; by hand: psparse-server --shard I/S)",
        agreed=False, launcher=True)
    shard_edges: str | None = option(None, "with --servers S: the S - 1 keys E1,E2,... where "
        "the shards' ranges meet, for equal load (psparse-locality RUN --shards S proposes "
        "them; default: equal sizes)", agreed=False, launcher=True)
    server_limit: str | None = option(None,
        "largest broadcast per round: an entry count, a multiple of k (2k) or Nk; the "
        "rest is held in a server residual and sent later; with --servers S each shard "
        "gets its part, L*(I+1)//S - L*I//S (default: no limit)",
        agreed=False, server=True, launcher=True)
    server_device: str = option("cpu",
        "where the server sums the pushes: cpu, or cuda (one scatter-add on the GPU; "
        "pays off for large unions)", agreed=False, server=True, launcher=True)
    bandwidth: str | None = option(None,
        "emulate the server's link at this rate (100Mbit, 1Gbit): pushes and broadcasts "
        "of a round take bytes*8/rate (default: no pacing)",
        agreed=False, server=True, launcher=True)
    tensorboard: str | None = option(None,
        "write TensorBoard event files to DIR/<the run directory's name>/, one TensorBoard run "
        "per psparse run: per iteration the loss, union/k, KB pushed and broadcast, overflow "
        "and restarts, and the evaluations (from the launcher), rank 0's compute, select and "
        "wait milliseconds (from rank 0); needs the tensorboard package (pip install "
        "'psparse[tensorboard]'; default: off)", agreed=False, launcher=True)
    curve_keys: str | None = option(None,
        "folder of CurveZMQ keys made by psparse-keys: traffic is encrypted and the "
        "server accepts only workers whose public key is in FOLDER/authorized (default: "
        "no authentication)", agreed=False, server=True)
    elastic: bool = option(False,
        "when a worker is lost, go on with the others (the mean is over those present) "
        "instead of ending the run", agreed=False, server=True, launcher=True)
    timeout: float = option(30.0,
        "seconds of silence (no message, no heartbeat) after which a worker or the "
        "server counts as lost; no wait lasts more than 10x this", agreed=False, server=True)
    register_timeout: float = option(120.0,
        "seconds the server waits for every worker to register (processes starting on a "
        "busy cluster can take a while)", agreed=False, server=True, launcher=True)
    max_message_mb: float = option(1024.0,
        "largest message accepted, in MB (ZMQ_MAXMSGSIZE)", agreed=False, server=True)
    # psparse-launch's positional TRAIN.PY: the user's own loop (psparse.connect) replaces the
    # built-in one, so model and dataset are the script's. Not a flag; kept in config.json.
    script: str | None = option(None,
        "the user's training script (psparse-launch's positional argument)")


    def validate(self) -> RunConfig:
        """Every option checked (a ConfigError naming the first bad one); itself."""
        self._check_exchange()
        self._check_training()
        self._check_run()
        return self

    def _check_exchange(self) -> None:
        """What is trained and what each worker sends."""
        need(self.model in MODELS or ":" in self.model,
             f"model {self.model!r} unknown; choose one of {sorted(MODELS)} or give "
             "package.module:factory")
        why = model_args_refusal(self.model, self.model_args, MODEL_ARGS)
        need(why is None, why or "")
        need(self.dataset in DATASETS or ":" in self.dataset,
             f"dataset {self.dataset!r} unknown; choose one of {list(DATASETS)} or give "
             "package.module:factory")
        need(self.model not in MODELS or self.dataset not in DATASETS or
             (self.model == "gpt") == (self.dataset == "text") and not
             (self.model == "synthetic" and self.dataset == "text"),
             f"model {self.model!r} does not train on dataset {self.dataset!r}: --model gpt "
             "takes --dataset text (characters), the others take images")
        need(isinstance(self.workers, int) and self.workers >= 1, "workers must be >= 1")
        need(0 < self.density <= 1, f"density must be in (0, 1], got {self.density}")
        if self.memory == "scalecom" and self.memory_beta is None:
            self.memory_beta = SCALECOM_BETA  # recorded in config.json: the beta the run used
        why = memory_refusal(self.memory, self.memory_beta, MEMORIES) or \
            warmup_refusal(self.density_warmup, self.dense_warmup, self.iterations)
        need(why is None, why or "")
        self._check_values()
        need(self.clip_norm is None or self.clip_norm > 0, "clip-norm must be > 0")
        need(self.policy_args is None or all(isinstance(a, str) and "=" in a
                                             for a in self.policy_args),
             f"policy-arg entries must be key=value, got {self.policy_args!r}")
        need(self.granularity in ("model", "layer"),
             f"granularity must be 'model' or 'layer', got {self.granularity!r}")
        self._check_buckets()

    def _check_training(self) -> None:
        """The built-in loop's length and optimizer, evaluation and checks."""
        need(self.epochs is None or self.epochs > 0, f"epochs must be > 0, got {self.epochs}")
        need(self.iterations is None or self.iterations >= 1, "iterations must be >= 1")
        need(self.batch_size >= 1, "batch-size must be >= 1")
        need(self.lr > 0, "lr must be > 0")
        try:
            steps = self.lr_step_epochs()
        except ValueError:
            steps = None
        need(steps is not None and all(s > 0 for s in steps) and steps == sorted(steps),
             f"lr-steps must be increasing positive epochs like 80,120, got {self.lr_steps!r}")
        need(0 <= self.momentum < 1, "momentum must be in [0, 1)")
        need(not self.nesterov or self.momentum > 0,
             "nesterov needs momentum > 0 (Nesterov momentum with none is plain SGD)")
        need(self.lr_schedule in LR_SCHEDULES,
             f"lr-schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        need(self.lr_schedule != "cosine" or not self.lr_steps,
             "lr-steps are for --lr-schedule step; cosine decays on its own (drop lr-steps)")
        need(isinstance(self.warmup_epochs, (int, float)) and self.warmup_epochs >= 0,
             f"warmup-epochs must be >= 0, got {self.warmup_epochs!r}")
        need(self.amp in (None, "bf16", "fp16"),
             f"amp must be bf16 or fp16 (leave it out for float32), got {self.amp!r}")
        need(self.weight_decay >= 0, "weight-decay must be >= 0")
        why = loop_refusal(self.optimizer, self.memory, self.nesterov, self.clip_aggregate,
                           self.freeze_variance, self.dense_warmup)
        need(why is None, why or "")
        need(self.eval_every >= 0, "eval-every must be >= 0 (0: only at the end)")
        need(self.eval_samples is None or self.eval_samples >= 1, "eval-samples must be >= 1")
        need(self.check_every >= 1, "check-every must be >= 1")
        need(self.checkpoint_every >= 0, "checkpoint-every must be >= 0")
        need(self.threads is None or self.threads >= 1, "threads must be >= 1")
        why = local_steps_refusal(self.local_steps, self.outer_lr, self.outer_momentum,
                                  memory=self.memory, overlap=self.overlap,
                                  freeze_variance=self.freeze_variance)
        need(why is None, why or "")

    def _check_run(self) -> None:
        """Devices, the server's options and the shards."""
        need(self.device in ("cpu", "cuda", "auto"),
             f"device must be cpu, cuda or auto, got {self.device!r}")
        need(self.server_device in ("cpu", "cuda"),
             f"server-device must be cpu or cuda, got {self.server_device!r}")
        need(self.timeout > 0, "timeout must be > 0")
        need(self.register_timeout > 0, "register-timeout must be > 0")
        need(self.max_message_mb > 0, "max-message-mb must be > 0")
        need(isinstance(self.servers, int) and self.servers >= 1,
             f"servers must be >= 1 (key-range server shards), got {self.servers!r}")
        from .wire.keyranges import parse_edges
        try:  # the parsers' own words
            if self.bandwidth is not None:
                parse_rate(self.bandwidth)
            if self.server_limit is not None:
                parse_limit(self.server_limit)
            if self.servers > 1 or self.shard_edges is not None:
                parse_edges(self.shard_edges, self.servers)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def _check_values(self) -> None:
        from .ops.values.formats import ValueFormat
        try:
            ValueFormat.named(self.values, self.value_block)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        need(not self.no_broadcast_memory or self.values != "fp32",
             "no-broadcast-memory is for rounded values (--values bf16, fp16, int8 or int4): "
             "fp32 broadcasts have no rounding error to keep")

    def value_spec(self) -> dict | None:
        """The run description's ``values`` field (None for fp32: the field is left out)."""
        from .ops.values.formats import FORMATS
        return None if self.values == "fp32" else {
            "dtype": FORMATS[self.values], "block": self.value_block,
            "server_memory": not self.no_broadcast_memory}

    def _check_buckets(self) -> None:
        """--overlap / --bucket-mb: buckets of layers exchanged as parts of a round (docs/api.md,
        Overlap). What they do not work with is refused here, naming the option."""
        if self.bucket_mb is not None and not (isinstance(self.bucket_mb, (int, float))
                                               and self.bucket_mb > 0):
            raise ConfigError(f"bucket-mb must be > 0 (MB of float32 gradients per bucket), "
                              f"got {self.bucket_mb!r}")
        if not (self.overlap or self.bucket_mb is not None):
            return
        why = bucket_refusal(
            whole_model=self.granularity != "layer", dense=self.density >= 1,
            two_phase=self.policy in TWO_PHASE_POLICIES, scalecom=self.memory == "scalecom", adam=self.memory == "adam",
            clip=self.clip_norm is not None, shards=self.servers > 1,
            server_limit=self.server_limit is not None, elastic=self.elastic)
        if why is not None:
            raise ConfigError(f"{'--overlap' if self.overlap else '--bucket-mb'} {why}"
                              .replace("{policy}", repr(self.policy)))

    def model_kwargs(self) -> dict[str, str]:
        """--model-arg as {key: value} (strings; the last of a repeated key wins)."""
        return dict((k.strip(), v.strip()) for k, _, v in
                    (item.partition("=") for item in self.model_args or []))

    def epochs_or_default(self) -> float:
        """The built-in loop's length in epochs: --epochs, else DEFAULT_EPOCHS."""
        return DEFAULT_EPOCHS if self.epochs is None else self.epochs

    def lr_step_epochs(self) -> list[float]:
        return [float(s) for s in self.lr_steps.split(",")] if self.lr_steps else []

    def lr_at(self, epoch: float) -> float:
        """The step schedule's learning rate at ``epoch``: --lr, times 0.1 for every
        --lr-steps epoch passed (the ResNet paper's schedule)."""
        return self.lr * 0.1 ** sum(epoch >= s for s in self.lr_step_epochs())

    def agreed(self) -> dict:
        """The options every worker must share, as the ``config`` map of the run description
        (docs/protocol.md): plain values (nil, bool, int, float, str, list of str), compared
        field by field by the server."""
        return {k: v for k, v in asdict(self).items() if k not in LOCAL_OPTIONS}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


def _scope(key: str) -> tuple[str, ...]:
    return tuple(f.name for f in fields(RunConfig) if f.metadata[key])


HELP = {f.name: f.metadata["help"] for f in fields(RunConfig)}
# Options that only place or guard a process: they may differ between workers.
LOCAL_OPTIONS = tuple(f.name for f in fields(RunConfig) if not f.metadata["agreed"])
# The options psparse-server takes (its other flags are its own: --bind, --port, --shard, ...).
SERVER_CONFIG = _scope("server")
# Options the server acts on too (checkpoints at the same iterations, the broadcast limit, ...):
# they come from the launcher's configuration, never from one worker's connect()
LAUNCHER_OPTIONS = _scope("launcher")
