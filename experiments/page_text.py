"""The prose of the generated results pages (``python -m experiments.pages``): what the tables
are, where they were measured, which policy to use. Figures stay in the JSON; a sentence here
that needs one points at a table row instead of repeating it."""

from __future__ import annotations

# What made each results JSON: the records name their commit, not their machine (the sweeps
# before issue 50 ran on one 2-core AMD EPYC development machine; their notes say so).
EPYC = "2-core AMD EPYC (AVX512-BF16, no AMX), 24 GiB, no GPU; 8 workers and the server on the 2 cores"
XEON = "2-core Intel Xeon (AVX512-BF16, AMX), 24 GiB, no GPU; 8 workers on the 2 cores"
MEASURED_ON = {
    "values": EPYC, "values-cifar": EPYC, "partitions": EPYC, "scalecom": EPYC,
    "cifar-lenet": EPYC, "resnet20-cifar10-long": EPYC, "scaling": EPYC,
    "time-to-accuracy": "an emulated 9-host cluster on a 2-core Intel Xeon (AMX): each host a "
                        "network namespace with a sixth of a core and one tbf-shaped link",
    "tta-runs": XEON,
}

EXPERIMENTS_INTRO = [
    "# Results",
    "",
    "What psparse's policies and value formats do to accuracy, bytes and time to accuracy, one "
    "table per workload. Every figure below is read from `experiments/results/*.json` (and the "
    "recorded runs in `experiments/results/tta-runs/`) by `python -m experiments.pages`; how each "
    "was found, what was tried and what was wrong before is in the [notes](#notes).",
    "",
    "> **Measured where.** CPU only unless a row says otherwise: 2-core development machines "
    "(AMD EPYC with AVX512-BF16; Intel Xeon with AMX for the ResNet-20 grid and the cluster), "
    "24 GiB, torch 2.13.0 (CPU), 8 worker processes and the server sharing the 2 cores, so an "
    "iteration's compute is ~8× one worker's. Times between hosts come only from the emulated "
    "cluster (`launch/netns.sh`: network namespaces, tbf-shaped links, a CPU share per host). "
    "One GPU run exists (ResNet-20, 400 s on one H200: "
    "[notes](../docs/notes/resnet20-long.md)). Accuracy and bytes are exact for a seed, config, "
    "code and float-kernel set; wall times are ±15%.",
    "",
    "**Reading the tables.** \"±\" is the sample standard deviation over the seeds listed "
    "(ddof 1). *union/k*: entries the server broadcasts per iteration over one worker's k (1 "
    "when workers agree, 8 when they are disjoint). *Bytes*: everything all workers push "
    "(proposals included) plus the broadcast, per iteration, as a share of a dense ring "
    "allreduce of the same model (N × 2(N−1)/N × numel × 4 B, so DDP is 100%). Accuracy is on "
    "the whole test set at the end of the run.",
]

WHICH_POLICY = [
    "## Which policy to use",
    "",
    "- **Fewest bytes at top-k's accuracy:** an aligning rule with 4-bit values, "
    "`--policy vote --policy-arg keep=2 --values int4` or `--policy ema --values int4` (rows "
    "`vote keep=2 --values int4` and `ema --values int4` below): workers choose overlapping "
    "entries, so the broadcast shrinks, and int4 with error feedback at both ends cuts each "
    "value to half a byte.",
    "- **Full-precision values:** `--policy vote --policy-arg keep=1.5` keeps top-k's accuracy "
    "within its seed spread at about half its bytes, at 1% and 0.1%.",
    "- **Bytes above the last point at 1%:** ScaleCom (`--policy cltk --memory scalecom`).",
    "- **Not** `core` at 0.1% (it loses points there), and `topk` only as the reference: its "
    "union grows fastest as workers are added (the scaling table).",
    "- **Adam / AdamW (transformers):** `--memory adam` (each worker's own Adam step sent with "
    "error feedback, the aggregate applied by plain SGD) rather than AdamW on the aggregate, "
    "after a dense warm-up (`--dense-warmup`, a fifth of the run) and with `--values int4`, "
    "which makes the warm-up cheap; at 1% it still falls short of dense AdamW over a short run "
    "(the transformer table), so spend bytes there (a higher density) before cutting them "
    "further.",
    "- **Fewer synchronisations:** with SGD, `--local-steps 16 --outer-lr 1 --outer-momentum 0` "
    "and every entry in int4 (`--density 1 --values int4`), or `--local-steps 4 --policy core "
    "--values int4` on the slowest link: local SGD's accuracy per step with psparse's bytes (the "
    "local-steps table); pseudo-gradients at 1% lose accuracy once H reaches 16, and DiLoCo's "
    "published outer step (lr 0.7, Nesterov 0.9) diverges there over SGD with momentum. They "
    "pay while an exchange costs more than a step's compute; where per-step psparse costs "
    "little more than its compute (ResNet-20 with `vote keep=2 --values int4`: 15–18% of a "
    "step) it takes 0.81–1.08× the best H-16 run's time, every H-16 run ends 1.6–2.7 points "
    "under DDP's seed (six runs, 84.1–85.1%), and one of them (DiLoCo, 1 seed of 3) reaches 85% "
    "([notes](../docs/notes/local-steps.md)).",
    "- **Time:** on a slow link psparse wins on time to accuracy by moving fewer bytes; where "
    "DDP's communication is a small share of its iteration it does not (the cluster table's "
    "\"DDP's communication share\"). Policies: [docs/policies.md](../docs/policies.md).",
]

SWEEPS = [
    "## Running the sweeps",
    "",
    "`python -m experiments.run SWEEP` (or `make exp-SWEEP`) runs each configuration of a sweep "
    "as one `psparse-launch` command (`--dry-run` prints them) into `runs/SWEEP/<run>-s<seed>/`, "
    "then writes `experiments/results/SWEEP.md`, `SWEEP.json` and its figures. A finished run "
    "with the same arguments is reused and a stopped one resumes from its newest checkpoint when "
    "the code is unchanged; `--only a,b` picks runs, `--seeds 0,1,2` repeats them, `--report` "
    "writes the table of the runs finished so far. Then `python -m experiments.pages` rewrites "
    "this page (`--check` says whether it is current; the tests run it).",
    "",
    "| sweep | what | runs, time here |",
    "|---|---|---|",
    "| `values` (`--cifar`) | LeNet-5 / MNIST (and CIFAR-10), `topk`, `vote`, `ema`, ScaleCom × "
    "`--values` fp32, bf16, int8, int4 at 1% and 0.1%, 3 seeds | 90 + 28; 20 s (4–5 min) each |",
    "| `local_steps` (`make exp-local-steps`) | LeNet-5 / MNIST: `--local-steps` 4, 16, 64 "
    "against DiLoCo, local SGD and DDP; accuracy here, timing on the emulated cluster at 25, "
    "5 and 80 Mbit/s; the peers checked against torchft | 24 + 36 on the cluster; 3 min, 1–4 "
    "min each |",
    "| `python -m experiments.torchft_cluster` (root, `make torchft` first) | torchft's own "
    "`DiLoCo` and `LocalSGD` timed on the emulated cluster (lighthouse on h0, a replica group "
    "per worker host), beside psparse's peers (the local-steps page) | 2 per rate; ~1 min "
    "each |",
    "| `partitions` | `micro`, `exdyna` against top-k, `vote`, `ema`, ScaleCom; MNIST and "
    "CIFAR-10; 3 seeds, `--probe-recall` | 96; 30–110 s each |",
    "| `scalecom` | ScaleCom against `core` and `vote`, 3 seeds | 42; ~50 s each |",
    "| `cifar-lenet` | LeNet-5 / CIFAR-10, 30 epochs, every rule at 1% and 0.1% | 33; 5–7 min "
    "each |",
    "| `scaling` | N = 2..32 workers: union/k and accuracy | 60; 7 s to 2.5 min each |",
    "| `low-density` | why `core` loses at 0.1%, and what holds | 26; 1.5–7 min each |",
    "| `python -m experiments.transformer` (`--workload script`) | the character-level GPT "
    "with AdamW at 1%, `--memory adam`, the dense warm-up and the frozen variance | 51 (21); "
    "2.5 min each, 10 min at 1,200 iterations |",
    "| `python -m experiments.transformer_tta` (root) | the built-in transformer's time to a "
    "validation loss: 1,200-iteration runs here (`--seeds 1,2` for the best of each family), "
    "timed on the emulated cluster at 25 and 5 Mbit/s | 11 + 12 more seeds, 11 on the "
    "cluster; 6–10 min + 1 min each |",
    "| `resnet20-cifar10-long` | ResNet-20 / CIFAR-10, 30 epochs, step schedule, float32 | 3; "
    "67–90 min each |",
    "| `python -m experiments.time_to_accuracy` (`make exp-tta`, root) | full-length accuracy "
    "runs here, timed on the emulated cluster; `--stage status` lists the grid, `--stage record` "
    "keeps finished runs in `experiments/results/tta-runs/` | LeNet ~1 min, ResNet-20 30–45 min "
    "each |",
    "| `python -m experiments.cost_projection` | the cost model at 64–1024 workers, 25.6M–1B "
    "parameters, 1–100 Gbit/s: one server, shards beside the workers (link only, and as built "
    "with the CPU per message measured on the emulated cluster), the rings "
    "([a model](results/cost-projection.md), checked within 15% against the emulated "
    "cluster's runs, [measured](results/shards-cluster.md)) | seconds |",
    "| `python -m experiments.shards_cluster` (root) | one server, two shards on hosts of their "
    "own and a shard beside each worker on the emulated cluster, LeNet-5 at 25 Mbit/s, 4 and 8 "
    "workers, fp32 and int4, with --shard-edges, DDP and its bf16 hook on the same hosts, "
    "and the cost model's prediction of each "
    "([measured](results/shards-cluster.md): on 1/6-core hosts the shards beside the workers "
    "are CPU-bound, 1.35–2.2x one server's time; ResNet-20 at 10 Mbit/s with `--model "
    "resnet20`, [measured](results/shards-cluster-resnet20.md): 0.83x in fp32) | LeNet-5: 12 + "
    "a profile run here, ~1–2 min each; ResNet-20: 7, ~5 min each |",
    "| `lenet-mnist`, `paced-100mbit`, `paced-20mbit`, `policies`, `cost-model`, `locality`, "
    "`cluster`, `open-ended-isa` | the earlier sweeps (their notes below) | |",
    "",
    "`lenet-mnist.toml` is the `make demo` run as a config file "
    "(`psparse-launch --config experiments/lenet-mnist.toml`).",
]

TRANSFORMER_INTRO = [
    "## A transformer with AdamW: character-level GPT, 4 workers at 1%",
    "",
    "AdamW applied to a sparse aggregate keeps only part of dense AdamW's gain over the unigram "
    "baseline at the same number of steps. `--memory adam` (each worker's own Adam step, sent "
    "with error feedback, applied by plain SGD) recovers part of it, and a dense warm-up "
    "(`--dense-warmup`) before it more, at the warm-up's bytes; AdamW's variance frozen after "
    "the warm-up (1-bit Adam's schedule, `--freeze-variance`) adds nothing measurable to the "
    "warm-up alone. None reaches dense within its seed spread. Why, and what each remedy changes: "
    "[notes](../docs/notes/adam-low-density.md). \"share of dense's gain\" is (unigram − loss) "
    "/ (unigram − dense AdamW's mean loss at the same iterations).",
    "",
]

NOTES_INTRO = ["## Notes", "",
               "The investigations behind the tables, one file each in `docs/notes/`:", ""]

BENCH_INTRO = [
    "# Benchmarks",
    "",
    "Every benchmark prints ratios against a baseline measured in the same run, never a time "
    "alone. `make bench` runs the CPU ones (kernels' compile and cache-load time, selection "
    "against argpartition, each policy's selection against top-k's, server aggregation against "
    "memcpy, the protocol round trip against a raw ZeroMQ echo, a server shard's round against "
    "a raw relay) and merges their figures into `benchmarks/results/bench.json`; "
    "`python -m experiments.pages` makes this table from it. The GPU path has checks of its own "
    "([notes](../docs/notes/bench-gpu.md)). Each row's commit, cores and date are the "
    "measurement's; the ratio's physical limit and what was tried are in the row's notes.",
]


def _r(x, digits=2):
    return f"{x:.{digits}f}"


def _agg(e):
    c = e["cases"]
    return "; ".join(f"{name}: {_r(v['ratio'])}× memcpy's speed (target {v['target']})"
                     for name, v in c.items())


def _protocol(e):
    return (f"{e['payload']}: {_r(e['ratio'])} of raw's CPU speed (target {e['target']}); "
            f"the protocol's own CPU {_r(e['protocol_own_cpu_ms'])} ms")


def _shard(e):
    return (f"{_r(e['ratio'])} of the relay's speed (CPU {e['cpu_ms_per_round']['ours']} vs "
            f"{e['cpu_ms_per_round']['relay']} ms a round), k = {e['k']:,}")


def _values(e):
    return "; ".join(f"{name}: {_r(v['reused']['vs_memcpy'])}× memcpy" for name, v in e.items()
                     if isinstance(v, dict) and "reused" in v)


def _amp(e):
    s = e["speedup_vs_fp32"]
    return (f"bf16 + channels-last {_r(s['bf16-cl'])}× float32's iteration "
            f"({e['iteration_ms']['fp32']} → {e['iteration_ms']['bf16-cl']} ms; compute-only "
            f"{e['compute_limit_ms']['bf16-cl']} ms)")


def _policy(e):
    keys = sorted(k for k in e if k.count("@") == 2 and not k.startswith("floor")
                  and k.endswith("@11000000@0.01"))
    return "; ".join(f"{k.split('@')[0]} {e[k]}×" for k in keys) + " (11M at 1%)"


def _passes(e):
    return "; ".join(f"{k}: {v}" for k, v in e.items() if "@" in k) + f" (target ≤ {e['target']})"


BENCH_ROWS = [
    # (bench.json key, what, reading(entry) -> str, baseline, notes link)
    ("kernel_compile_s", "compiling every CPU kernel (numba, cold cache)",
     lambda e: f"{e['seconds']} s", "–", "[cpu kernels](../docs/notes/bench-cpu-kernels.md)"),
    ("kernel_cache_load_s", "loading them from the cache",
     lambda e: f"{e['seconds']} s (process {e['process_s']} s)", "import alone "
     "(`import_only_process_s`)", "[cpu kernels](../docs/notes/bench-cpu-kernels.md)"),
    ("host_topk_copy_passes", "top-k selection on the host, in copies of the input",
     _passes, "one memcpy of the input", "[selection](../docs/notes/bench-select.md)"),
    ("policy_vs_topk", "each policy's selection work", _policy, "top-k's, same run",
     "[selection](../docs/notes/bench-select.md)"),
    ("aggregation_vs_memcpy", "the server's sum of 8 pushes", _agg,
     "memcpy of the pushes' bytes", "[cpu kernels](../docs/notes/bench-cpu-kernels.md)"),
    ("protocol_1mb_vs_raw_cpu", "a push and its aggregate, 1 MB", _protocol,
     "raw ZeroMQ echo", "[protocol](../docs/notes/bench-protocol.md)"),
    ("protocol_delta_1mb_vs_raw_cpu", "the same with delta-coded indices", _protocol,
     "raw ZeroMQ echo", "[protocol](../docs/notes/bench-protocol.md)"),
    ("protocol_100mb_vs_raw_cpu", "the same, 100 MB", _protocol, "raw ZeroMQ echo",
     "[protocol](../docs/notes/bench-protocol.md)"),
    ("shard_round_vs_relay", "a server shard's round, 11.2M entries at 1%", _shard,
     "a ZeroMQ relay of the same bytes", "[scale](../docs/notes/bench-scale.md)"),
    ("shard_round_vs_relay_61706", "the same at LeNet-5's size", _shard,
     "a ZeroMQ relay of the same bytes", "[scale](../docs/notes/bench-scale.md)"),
    ("values_vs_memcpy", "packing and unpacking a value format", _values,
     "memcpy of the float32 values", "[values](../docs/notes/bench-values.md)"),
    ("worker_memory", "a worker's peak memory, 25M-parameter model",
     lambda e: f"top-k {_r(e['topk_x'])}× the model, `vote` {_r(e['vote_x'])}×",
     "plain torch training (`plain_torch_x`)", "[memory](../docs/notes/bench-memory.md)"),
    ("loop_amp", "ResNet-20 built-in loop, 8 workers on 2 cores", _amp,
     "the float32 loop, same run", "[amp](../docs/notes/bench-amp.md)"),
]

BENCH_NOTES = [
    "Measured without a row here (their figures are in their notes): the test suite's time "
    "([notes](../docs/notes/bench-test-suite.md)), recovery from a lost worker "
    "([notes](../docs/notes/bench-restart.md)), overlap with backward "
    "([notes](../docs/notes/bench-overlap.md)), scaling with workers and shards "
    "(`bench_scale.json`, [notes](../docs/notes/bench-scale.md)), and the GPU checks on one "
    "H200 ([notes](../docs/notes/bench-gpu.md)).",
]
