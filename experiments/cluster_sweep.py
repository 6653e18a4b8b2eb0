"""The catalogue of the emulated-cluster sweep (``python -m experiments.cluster``), as data:
psparse's runs and its peers' (DDP, DDP + PowerSGD), and per model the base arguments, the two
link rates and the target accuracies. experiments/cluster.py runs them, cluster_report.py
reads them back."""

from __future__ import annotations

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
RUNS = {**PSPARSE_RUNS, **PEER_RUNS}

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
