"""Issue 53's time-to-accuracy row: the built-in transformer with AdamW on the emulated
cluster, psparse against DDP and DDP's bf16 compression hook.

    python -m experiments.transformer_tta                       # all stages (~70 min)
    python -m experiments.transformer_tta --stage accuracy --runs ddp,local-adam-topk
    python -m experiments.transformer_tta --stage timing --rates 25mbit,5mbit
    python -m experiments.transformer_tta --stage report
    python -m experiments.transformer_tta --runs diloco-h16,local16-dense-int4   # issue 55

Composed as experiments/time_to_accuracy.py composes LeNet's and ResNet-20's (a run is
bit-reproducible, so its loss after iteration t does not depend on the network):

    time to a target loss = (iterations to it, from a full-length run on this machine)
                          x (the steady iteration on the emulated cluster, same arguments)

* ``accuracy``: 1,200-iteration runs of experiments/transformer.py's built-in configuration
  (4 workers, AdamW, warm-up then cosine) on this machine, evaluated on the whole test text
  every 50 iterations (runs/transformer/tta/<run>-s<seed>); iterations to a target are those
  done at the first evaluation at or below it.
* ``timing``: the same arguments on the emulated cluster (experiments/cluster.py: one worker per
  host, the server on h0, each host 1/6 of a core, links at the rate), 30 iterations, no
  evaluation: the mean iteration after 3 (runs/cluster/gpt-<rate>/), at 25 and 5 Mbit/s. A
  run with a dense warm-up (``--dense-warmup W``) is composed from two measured iterations: W
  at psparse's dense one in the run's value format (``psparse-dense``, ``psparse-dense-int4``),
  the rest at its twin without the warm-up.
* ``report``: experiments/results/transformer-tta.json (the results page's table is made from
  it). A run whose folder is gone keeps what the JSON recorded of it (its evaluations, its
  cluster timing, their commits).

Issue 55's runs on DiLoCo's home ground (AdamW inside): ``diloco-h{H}`` and ``localsgd-h16``
(``--baseline ddp --local-steps H``: DiLoCo with its published outer step, lr 0.7 and Nesterov
0.9, and local SGD's averaging, over allreduce) and psparse's ``local16-*`` (the pseudo-gradient
through the server in int4, dense or at 10%, DiLoCo's outer step; ``-avg``: local SGD's). A run
with local steps H is as long in training steps as the others (1,200 / H synchronisations, evaluated every ~50
steps); its "iterations" are synchronisations, timed as 8 of them on the cluster (H local steps
and one exchange each), and --clip-aggregate clips each local step's gradient.

The targets are validation losses in nats/char (the unigram baseline is 3.05): 2.0 is dense
AdamW's loss after 300 iterations of experiments/transformer.py, 1.8 one that the 1% runs
reach only late.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from experiments.harness import RESULTS, ROOT, RunDir, int_option
from experiments.time_to_accuracy import launch_local, steady_ms, this_machine
from experiments.transformer import ADAMW, BUILTIN, INT4, LOCAL, TOPK, dense_first
from psparse.provenance import provenance
from psparse.wire.transport import parse_rate

WORKERS, ITERATIONS, EVAL_EVERY, TIMED = 4, 1200, 50, 30
TARGETS = (2.0, 1.8)
RATES = ("25mbit", "5mbit")
BASE = [*BUILTIN[:BUILTIN.index("--eval-every")], "--workers", str(WORKERS), "--threads", "1"]
RUNS = {  # name -> arguments after BASE
    "ddp": ["--baseline", "ddp", "--density", "1", *ADAMW],
    "ddp-bf16": ["--baseline", "bf16", "--density", "1", *ADAMW],
    "adamw-topk": [*TOPK, *ADAMW],
    "local-adam-topk": [*TOPK, *LOCAL],
    "local-adam-topk-int4": [*TOPK, *LOCAL, *INT4],
    "dense60-local-adam-topk": [*TOPK, *LOCAL, *dense_first(60)],
    "dense60-local-adam-topk-int4": [*TOPK, *LOCAL, *dense_first(60), *INT4],
}
DILOCO = ["--baseline", "ddp", "--density", "1"]
LOCAL_SGD = ["--outer-lr", "1", "--outer-momentum", "0"]
RUNS.update({  # issue 55: local steps (DiLoCo's outer step unless LOCAL_SGD)
    "diloco-h16": [*DILOCO, "--local-steps", "16", *ADAMW],
    "diloco-h64": [*DILOCO, "--local-steps", "64", *ADAMW],
    "localsgd-h16": [*DILOCO, "--local-steps", "16", *LOCAL_SGD, *ADAMW],
    "local16-dense-int4": ["--density", "1", *INT4, "--local-steps", "16", *ADAMW],
    "local16-topk10-int4": ["--density", "0.1", *INT4, "--local-steps", "16", *ADAMW],
    # local SGD's outer step (averaging): the better one over AdamW here (diloco vs localsgd)
    "local16-dense-int4-avg": ["--density", "1", *INT4, "--local-steps", "16", *LOCAL_SGD,
                               *ADAMW],
})
SEEDS = (0, 1, 2)  # the report reads these; the accuracy stage runs --seeds
TIMED_SYNCS = 8  # a run with local steps: synchronisations timed on the cluster
# the cluster runs: each run's own, but a dense warm-up is timed as psparse's dense iteration
# (in the run's value format)
DENSE, DENSE_INT4 = "psparse-dense", "psparse-dense-int4"
# (the warm-up runs' own options: --memory adam)
TIMING_ARGS = {DENSE: ["--density", "1", *LOCAL], DENSE_INT4: ["--density", "1", *LOCAL, *INT4],
               **{n: a for n, a in RUNS.items() if "--dense-warmup" not in a}}
PEERS = ("ddp", "ddp-bf16")


def local_steps_of(name: str) -> int:
    return int_option(RUNS.get(name, []), "--local-steps", 1)


def is_peer(name: str) -> bool:
    return "--baseline" in RUNS.get(name, [])


def accuracy_args(name: str) -> list[str]:
    """As long in training steps as every run: 1,200 / H synchronisations, evaluated about
    every 50 steps."""
    h = local_steps_of(name)
    return [*BASE, *RUNS[name], "--iterations", str(math.ceil(ITERATIONS / h)),
            "--eval-every", str(max(1, round(EVAL_EVERY / h)))]


def timed_iterations(name: str) -> int:
    return TIMED if local_steps_of(name) == 1 else TIMED_SYNCS


def warmup_of(name: str) -> int:
    return int_option(RUNS[name], "--dense-warmup", 0)


def twin_of(name: str) -> str:
    """The cluster run that times ``name``'s iterations after its dense warm-up."""
    if not warmup_of(name):
        return name
    args = RUNS[name]
    i = args.index("--dense-warmup")
    plain = args[:i] + args[i + 2:]
    return next(n for n, a in RUNS.items() if a == plain)


def dense_of(name: str) -> str:
    """The cluster run that times ``name``'s dense warm-up: psparse's dense iteration in the
    run's value format."""
    return DENSE_INT4 if "int4" in RUNS[name] else DENSE


def accuracy_dir(name: str, seed: int) -> Path:
    return ROOT / "runs" / "transformer" / "tta" / f"{name}-s{seed}"


def iterations_to(evals: list[dict], target: float) -> int | None:
    """Iterations done at the first evaluation with test_loss at or below ``target``."""
    return next((e["iter"] + 1 for e in evals if e["test_loss"] <= target), None)


def composed_s(name: str, iterations: int, steady: dict[str, float]) -> float:
    warm = min(iterations, warmup_of(name))
    dense = warm * steady[dense_of(name)] if warm else 0.0
    return (dense + (iterations - warm) * steady[twin_of(name)]) / 1e3


def report(rates) -> dict:
    """Per rate and target: each run's iterations to the target, its composed time and its
    ratio to DDP's and to the bf16 hook's; every figure named for where it was measured."""
    out = {"workload": f"psparse-launch {' '.join(BASE)}, {ITERATIONS} iterations "
                       f"(accuracy, evaluated every {EVAL_EVERY}) / {TIMED} (cluster timing)",
           "machine": this_machine(), "commit": provenance()["git_commit"], "targets": TARGETS,
           "runs": [], "timing": {}, "rows": []}
    path = RESULTS / "transformer-tta.json"
    recorded = json.loads(path.read_text()) if path.is_file() else {"runs": [], "timing": {}}
    curves: dict[str, dict[int, list]] = {}  # run -> seed -> evaluations
    for name in RUNS:
        for seed in SEEDS:
            run = RunDir(accuracy_dir(name, seed))
            summary = run.summary()
            if summary and summary.get("status") == "ok":
                record = {"run": name, "seed": seed, "code": run.code_id(),
                          "final_loss": summary["test_loss"],
                          "evals": [{"iter": e["iter"], "test_loss": e["test_loss"]}
                                    for e in run.evals()]}
            else:  # the folder is gone (another machine, a clean clone): what the JSON recorded
                record = next((r for r in recorded["runs"]
                               if r["run"] == name and r.get("seed", 0) == seed), None)
            if record is not None:
                curves.setdefault(name, {})[seed] = record["evals"]
                out["runs"].append({**record, "local_steps": local_steps_of(name)})
    from experiments.cluster_report import run_dir
    for rate in rates:
        timing = dict(recorded["timing"].get(rate, {}))
        for name in TIMING_ARGS:
            d = run_dir("gpt", rate, name, 0)
            summary = RunDir(d).summary()
            if summary and summary.get("status") == "ok":
                links = json.loads((d / "links.json").read_text())
                timing[name] = {"steady_ms": steady_ms(d), "code": RunDir(d).code_id(),
                                "link_mb_per_iteration": max(
                                    (h["rx_bytes"] + h["tx_bytes"]) / 1e6 / timed_iterations(name)
                                    for h in links.values() if isinstance(h, dict))}
        out["timing"][rate] = {n: t for n, t in timing.items() if n in TIMING_ARGS}
        steady = {n: t["steady_ms"] for n, t in out["timing"][rate].items()}
        for target in TARGETS:
            times = {}  # run -> seed -> (iterations to the target, composed seconds)
            for name, by_seed in curves.items():
                for seed, evals in by_seed.items():
                    n = iterations_to(evals, target)
                    timed = n is not None and twin_of(name) in steady and \
                        (not warmup_of(name) or dense_of(name) in steady)
                    times.setdefault(name, {})[seed] = \
                        (n, composed_s(name, n, steady) if timed else None)
            # the fastest local-steps peer (DiLoCo or local SGD) at this rate and target, by
            # its mean over the seeds that reached it
            mean = {n: statistics.fmean(t[1] for t in by_seed.values())
                    for n, by_seed in times.items() if all(t[1] for t in by_seed.values())}
            best_diloco = min((n for n in mean if is_peer(n) and local_steps_of(n) > 1),
                              key=mean.get, default=None)
            for name, by_seed in times.items():
                out["rows"].append(row(rate, target, name, by_seed, times, best_diloco))
    return out


def row(rate: str, target: float, name: str, by_seed: dict, times: dict,
        best_diloco: str | None) -> dict:
    """One run's row at a rate and target: seed 0's figures (the page's headline) and, with
    more seeds, every seed's, the ratios paired by seed (a seed against the peer's same
    seed)."""
    def ratios(peer) -> dict[int, float]:
        return {s: by_seed[s][1] / times[peer][s][1] for s in sorted(by_seed)
                if peer and by_seed[s][1] and times.get(peer, {}).get(s, (0, None))[1]}
    first_seed = min(by_seed)  # 0 unless that run is missing
    n, seconds = by_seed[first_seed]
    h = local_steps_of(name)
    out = {"rate": rate, "target": target, "run": name, "iterations": n, "composed_s": seconds,
           "vs_ddp": ratios("ddp").get(first_seed),
           "vs_ddp_bf16": ratios("ddp-bf16").get(first_seed), "link_rate_bits": parse_rate(rate)}
    if h > 1:
        out.update({"local_steps": h, "peer": is_peer(name),
                    "steps": None if n is None else n * h, "best_diloco": best_diloco,
                    "vs_best_diloco": ratios(best_diloco).get(first_seed)})
    if len(by_seed) > 1:
        seeds = sorted(by_seed)
        out["by_seed"] = {"seeds": seeds, "iterations": [by_seed[s][0] for s in seeds],
                          "composed_s": [by_seed[s][1] for s in seeds],
                          "vs_ddp": list(ratios("ddp").values()),
                          "vs_ddp_bf16": list(ratios("ddp-bf16").values()),
                          **({"vs_best_diloco": list(ratios(best_diloco).values())}
                             if h > 1 else {})}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.transformer_tta",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", default="accuracy,timing,report",
                    help="comma-separated stages, in this order (default all)")
    ap.add_argument("--runs", default=",".join(RUNS),
                    help=f"runs of the accuracy stage (default all: {', '.join(RUNS)}); the "
                         "timing stage times the ones the composition needs")
    ap.add_argument("--rates", default=",".join(RATES),
                    help="the cluster's link rates (default %(default)s)")
    ap.add_argument("--seeds", default="0",
                    help="comma-separated seeds of the accuracy stage (default 0; the report "
                         "reads every seed it finds)")
    args = ap.parse_args(argv)
    names, stages, rates = args.runs.split(","), args.stage.split(","), args.rates.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        ap.error(f"unknown run {unknown[0]!r}; choose from {', '.join(RUNS)}")
    if "accuracy" in stages:
        for seed in (int(s) for s in args.seeds.split(",")):
            for name in names:
                launch_local(accuracy_dir(name, seed), accuracy_args(name), seed, None)
    if "timing" in stages:
        from experiments.cluster import emulated_cluster, run_one
        code_id = provenance()["code_id"]
        timed = list(dict.fromkeys([twin_of(n) for n in names] +
                                   [dense_of(n) for n in names if warmup_of(n)]))
        for rate in rates:
            with emulated_cluster(rate) as hosts:
                for name in timed:
                    run_one("gpt", rate, name, hosts, code_id, False, None,
                            base=[*BASE, "--iterations", str(timed_iterations(name)),
                                  "--eval-every", "0", "--eval-samples", "64"],
                            run_args=TIMING_ARGS[name])
    if "report" in stages:
        result = report(rates)
        path = RESULTS / "transformer-tta.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        for r in result["rows"]:
            print(f"{r['rate']} to {r['target']}: {r['run']}: {r['iterations']} iterations, "
                  + (f"{r['composed_s']:.0f} s" if r["composed_s"] else "not composed")
                  + (f", {r['vs_ddp']:.2f}x DDP" if r["vs_ddp"] else ""))
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
