"""The catalogue of the emulated-cluster sweep (``python -m experiments.cluster``), as data:
psparse's runs and its peers' (DDP, DDP + PowerSGD), and per model the base arguments, the two
link rates and the target accuracies. experiments/cluster.py runs them, cluster_report.py
reads them back."""

from __future__ import annotations

from experiments.harness import int_option

WORKERS = 8  # one worker per host h1 .. h8; the server on h0

PSPARSE_RUNS = {
    "topk": ["--density", "0.01", "--policy", "topk"],
    "core": ["--density", "0.01", "--policy", "core"],
    "vote": ["--density", "0.01", "--policy", "vote", "--policy-arg", "keep=1.5"],
    "topk-limit2k": ["--density", "0.01", "--policy", "topk", "--server-limit", "2k"],
    # the fewest bytes at top-k's accuracy (docs/notes/value-formats.md), timed in issue 50
    "ema-int4": ["--density", "0.01", "--policy", "ema", "--values", "int4"],
    "vote2-int4": ["--density", "0.01", "--policy", "vote", "--policy-arg", "keep=2",
                   "--values", "int4"],
}
# powersgd-r1/-r4: section 6's runs, compressed from iteration 2; the issue-38 peers, each as
# users would run it: DDP's own fp16/bf16 compression hooks, and PowerSGD with the dense
# warm-up torch advises (start_powerSGD_iter), on a grid of rank 2, 4 x warm-up 100, 1000
PEER_RUNS = {
    "ddp": ["--baseline", "ddp", "--density", "1"],
    "powersgd-r1": ["--baseline", "powersgd", "--powersgd-rank", "1", "--powersgd-warmup", "2",
                    "--density", "1"],
    "powersgd-r4": ["--baseline", "powersgd", "--powersgd-rank", "4", "--powersgd-warmup", "2",
                    "--density", "1"],
    # the rank-2 iteration after warm-up, for time_to_accuracy.py's powersgd-r2-w* runs
    "powersgd-r2": ["--baseline", "powersgd", "--powersgd-rank", "2", "--powersgd-warmup", "2",
                    "--density", "1"],
    "ddp-fp16": ["--baseline", "fp16", "--density", "1"],
    "ddp-bf16": ["--baseline", "bf16", "--density", "1"],
    **{f"powersgd-r{r}-w{w}": ["--baseline", "powersgd", "--powersgd-rank", str(r),
                               "--powersgd-warmup", str(w), "--density", "1"]
       for r in (2, 4) for w in (100, 1000)},
}
# --local-steps H (issue 55): psparse's local steps with core and int4 values, the outer step
# local SGD's (learning rate 1, no momentum: the inner optimizer is SGD with momentum 0.9, and
# DiLoCo's outer momentum on top overshot in the tests' runs, docs/api.md); and what a slow-link
# user picks today, over torch.distributed: DiLoCo with its defaults (outer lr 0.7, Nesterov
# 0.9), its pseudo-gradients in bf16, and local SGD (parameter averaging)
LOCAL_STEPS = (4, 16, 64)
LOCAL_SGD = ["--outer-lr", "1", "--outer-momentum", "0"]
PSPARSE_RUNS.update({f"local{h}-core-int4": ["--density", "0.01", "--policy", "core", "--values",
                                             "int4", "--local-steps", str(h), *LOCAL_SGD]
                     for h in LOCAL_STEPS})
# a synchronisation is rare, so it can afford more entries: 10% density (seed-0 runs at 1% lost
# 2.5x the steps to 98% at H = 16, where dense local SGD reached it sooner than DDP)
PSPARSE_RUNS.update({f"local{h}-core-d10-int4": ["--density", "0.1", "--policy", "core",
                                                 "--values", "int4", "--local-steps", str(h),
                                                 *LOCAL_SGD] for h in (16, 64)})
# every entry in int4 (an index costs more than a 4-bit value: 10% density saves little)
PSPARSE_RUNS["local16-dense-int4"] = ["--density", "1", "--values", "int4", "--local-steps", "16",
                                      *LOCAL_SGD]
for h in LOCAL_STEPS:
    PEER_RUNS[f"diloco-h{h}"] = ["--baseline", "ddp", "--density", "1", "--local-steps", str(h)]
    PEER_RUNS[f"diloco-h{h}-bf16"] = ["--baseline", "bf16", "--density", "1", "--local-steps",
                                      str(h)]
    PEER_RUNS[f"localsgd-h{h}"] = ["--baseline", "ddp", "--density", "1", "--local-steps",
                                   str(h), *LOCAL_SGD]
RUNS = {**PSPARSE_RUNS, **PEER_RUNS}


def local_steps_of(name: str) -> int:
    """A run's --local-steps H (1: it exchanges every iteration)."""
    return int_option(RUNS[name], "--local-steps", 1)

# Sized for ~90 minutes of this 2-core machine (docs/notes/cluster-time-to-accuracy.md), on hosts of
# 1/6 core. LeNet: 300 iterations (1.3 epochs of 8 x 32 images), long enough for PowerSGD to
# reach the target too. ResNet-20: 100 iterations, the first minutes of training only. Start-up
# (~1 min per run: 8 torch imports) is extra. Evaluation (rank 0, on its 1/6 core) uses a fixed
# random subset of the test set (--eval-samples) so that it does not dominate the run: a full
# ResNet-20 test pass would take ~2 minutes there. Rates: LeNet's as in the first sweep (dense
# communication 70-85% of an iteration; no rate brings it near 30%: the ring's own CPU equals
# the compute on these shares); ResNet-20's from a measured step: 192 ms on a whole core, so
# ~1.15 s on 1/6 core, against a dense ring of 2 * 7/8 * 1.09 MB = 1.9 MB per host each way:
# 0.4 s at 40 Mbit/s (communication ~30% of an iteration) and 1.6 s at 10 Mbit/s (~60%).
MODELS = {
    "lenet": {"base": ["--workers", "8", "--model", "lenet", "--dataset", "mnist",
                       "--iterations", "300", "--eval-every", "25", "--eval-samples", "2000",
                       "--threads", "1"],
              "rates": ["80mbit", "25mbit"], "targets": [0.9, 0.8]},
    "resnet20": {"base": ["--workers", "8", "--model", "resnet20", "--dataset", "cifar10",
                          "--batch-size", "32", "--lr", "0.1", "--weight-decay", "1e-4",
                          "--iterations", "100", "--eval-every", "25", "--eval-samples", "1000",
                          "--threads", "1"],
                 "rates": ["40mbit", "10mbit"], "targets": [0.3, 0.25]},
}
HOST_CPUS = 1.5  # cores shared by the 9 hosts (--cpus)
