"""Issue 53: a character-level GPT with AdamW at 1% density, where the gap to dense comes from,
and the remedy measured over 3 seeds.

    python -m experiments.transformer                      # the built-in loop (about 40 min)
    python -m experiments.transformer --workload script    # the user's script (about 25 min)
    python -m experiments.transformer --only adamw-topk,local-adam-topk --seeds 0

Two workloads, the same model (421,376 parameters, tied head), AdamW, warm-up then cosine,
4 workers × 16 windows of 64 characters of the standard library's source:

* ``builtin``: ``psparse-launch --model gpt --dataset text --optimizer adamw`` (weight decay on
  every parameter, the aggregate clipped to 1 with ``--clip-aggregate``, windows every 16
  characters), 300 iterations, and 1,200 for the run-length comparison (``-long``);
* ``script``: ``examples/char_gpt.py`` as a user wrote it (two parameter groups, windows at
  random offsets), 300 steps.

One run per configuration and seed:

* ``adamw-dense`` / ``local-adam-dense``: everything sent (the baseline; and the remedy's own
  dense point, which differs from dense AdamW only in whose gradient the moments see);
* ``adamw-topk``: AdamW on the 1% aggregate, as a user writes it (the gap of issue 53);
* ``adamw-topk-layer``: the same with per-tensor budgets (``--granularity layer``: every
  tensor, the embeddings and LayerNorms included, gets its share of k);
* ``local-adam-topk``: the remedy, each worker's own Adam step sent with error feedback
  (``--memory adam``, plain SGD on the aggregate, each worker's gradient clipped to 1 with
  ``--clip-norm``), then with 4-bit values and with an aligning rule
  (``vote keep=1.5 --values int4``);
* ``dense{30,60}-adamw-topk``, ``frozen{30,60}-adamw-topk`` (built-in only): 1-bit Adam's schedule,
  AdamW on the aggregate after 30 (60) dense iterations (``--dense-warmup``), its second moment
  frozen from then on (``--freeze-variance``), and the dense warm-up alone, without the
  freeze, to tell the two apart;
  ``dense{30,60}-local-adam-topk``: the dense warm-up before ``--memory adam`` (and with
  4-bit values, ``-int4``);
* ``-long`` (built-in only): dense, AdamW at 1% and the remedy at 1,200 iterations: whether the
  gap is the error feedback's delay (about numel / union entries, rounds between two sends of
  an entry) against the run's length.

Figures per run: the final validation loss (nats/char), its share of dense AdamW's gain over
the unigram baseline, union/k, and bytes per iteration as a share of a dense ring allreduce.
Results: experiments/results/transformer-{builtin,script}.json (the results page's tables are
made from them); runs in runs/transformer/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np

from experiments.harness import RESULTS, ROOT, RunCache, RunDir
from experiments.run import dense_allreduce_bytes, sent_per_iteration, union_over_k
from experiments.time_to_accuracy import this_machine
from psparse.data import text
from psparse.provenance import provenance

SCRIPT = ROOT / "examples" / "char_gpt.py"
STEPS, LONG, WORKERS = 300, 1200, 4
TOPK = ["--density", "0.01"]
INT4 = ["--values", "int4"]
VOTE = ["--policy", "vote", "--policy-arg", "keep=1.5"]
SCRIPT_RUNS = {  # name -> (psparse-launch options, the script's options)
    "adamw-dense": (["--density", "1"], []),
    "local-adam-dense": (["--density", "1"], ["--local-adam"]),
    "adamw-topk": (TOPK, []),
    "adamw-topk-layer": ([*TOPK, "--granularity", "layer"], []),
    "local-adam-topk": (TOPK, ["--local-adam"]),
    "local-adam-topk-int4": ([*TOPK, *INT4], ["--local-adam"]),
    "local-adam-vote-int4": ([*TOPK, *VOTE, *INT4], ["--local-adam"]),
}
# the built-in loop: warm-up over 30 iterations (an epoch is 966), then cosine to 0
BUILTIN = ["--model", "gpt", "--dataset", "text", "--optimizer", "adamw", "--lr", "3e-3",
           "--lr-schedule", "cosine", "--warmup-epochs", "0.031", "--batch-size", "16",
           "--weight-decay", "0.1", "--eval-every", "100"]
ADAMW, LOCAL = ["--clip-aggregate", "1"], ["--memory", "adam", "--clip-norm", "1"]


def dense_first(iterations: int) -> list[str]:
    return ["--dense-warmup", str(iterations)]



BUILTIN_RUNS = {  # name -> psparse-launch options (the iterations added)
    "adamw-dense": ["--density", "1", *ADAMW],
    "local-adam-dense": ["--density", "1", *LOCAL],
    "adamw-topk": [*TOPK, *ADAMW],
    "local-adam-topk": [*TOPK, *LOCAL],
    "local-adam-topk-int4": [*TOPK, *LOCAL, *INT4],
    "local-adam-vote-int4": [*TOPK, *LOCAL, *VOTE, *INT4],
    "dense30-adamw-topk": [*TOPK, *ADAMW, *dense_first(30)],
    "frozen30-adamw-topk": [*TOPK, *ADAMW, *dense_first(30), "--freeze-variance"],
    "frozen60-adamw-topk": [*TOPK, *ADAMW, *dense_first(60), "--freeze-variance"],
    "dense30-local-adam-topk": [*TOPK, *LOCAL, *dense_first(30)],
    "dense60-adamw-topk": [*TOPK, *ADAMW, *dense_first(60)],
    "dense60-local-adam-topk": [*TOPK, *LOCAL, *dense_first(60)],
    "dense60-local-adam-topk-int4": [*TOPK, *LOCAL, *dense_first(60), *INT4],
    "adamw-dense-long": ["--density", "1", *ADAMW],
    "adamw-topk-long": [*TOPK, *ADAMW],
    "local-adam-topk-long": [*TOPK, *LOCAL],
}
SEEDS = (0, 1, 2)


def unigram_loss() -> float:
    """The baseline: the test text's loss under the training text's character frequencies."""
    codes = text.corpus()
    split = int(0.9 * len(codes))
    return text.unigram_loss(codes[:split], codes[split:])


def command(workload: str, name: str, seed: int) -> list[str]:
    """psparse-launch's arguments for one run (after --out): the run's identity."""
    if workload == "script":
        launch_args, script_args = SCRIPT_RUNS[name]
        return [*launch_args, "--workers", str(WORKERS), "examples/char_gpt.py",
                "--steps", str(STEPS), "--seed", str(seed), *script_args]
    steps = LONG if name.endswith("-long") else STEPS
    return [*BUILTIN, *BUILTIN_RUNS[name], "--workers", str(WORKERS),
            "--iterations", str(steps), "--seed", str(seed)]


def run(workload: str, name: str, seed: int) -> dict:
    """One run (reused when this configuration and seed already ended there), its row."""
    out = ROOT / "runs" / "transformer" / workload / f"{name}-s{seed}"
    identity = command(workload, name, seed)
    cache = RunCache(out, identity)
    if not cache.finished():
        print(f"[transformer] {name} seed {seed} ...", flush=True)
        cache.start(fresh=True)
        code = subprocess.run([sys.executable, "-m", "psparse.launch", "--out", str(out),
                               "--overwrite", "--quiet", *identity], cwd=ROOT).returncode
        if code < 0 or code == 130:
            raise SystemExit(f"[transformer] {name} seed {seed} stopped (exit {code})")
        cache.finish()
    return row(out, name, seed)


def row(out, name: str, seed: int) -> dict:
    d = RunDir(out)
    summary = d.summary()
    if summary is None or summary["status"] != "ok":
        return {"run": name, "seed": seed,
                "failed": "no summary" if summary is None else summary["error"]}
    metrics = d.metrics()
    sent = sent_per_iteration(metrics)
    return {"run": name, "seed": seed, "test_loss": summary["test_loss"],
            "test_acc": summary.get("test_acc"), "iterations": summary["iterations"],
            "union_k": float(np.mean(union_over_k(metrics))),
            "sent_over_allreduce": sent / dense_allreduce_bytes(summary["world_size"],
                                                                summary["numel"]),
            "numel": summary["numel"], "code": d.code_id(), "dir": str(out.relative_to(ROOT))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.transformer",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=("builtin", "script"), default="builtin",
                    help="the built-in loop (--model gpt) or examples/char_gpt.py")
    ap.add_argument("--only", help="comma-separated configurations (default: all of the "
                    "workload's): " + ", ".join(BUILTIN_RUNS))
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)),
                    help="comma-separated seeds (default: 0,1,2)")
    args = ap.parse_args(argv)
    runs = BUILTIN_RUNS if args.workload == "builtin" else SCRIPT_RUNS
    names = args.only.split(",") if args.only else list(runs)
    unknown = [n for n in names if n not in runs]
    if unknown:
        ap.error(f"unknown configuration {unknown[0]!r}; choose from {', '.join(runs)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    path = RESULTS / f"transformer-{args.workload}.json"
    kept = json.loads(path.read_text())["rows"] if path.is_file() else []
    done = {(r["run"], r["seed"]): r for r in kept}
    for i, name in enumerate(names):
        for seed in seeds:
            done[(name, seed)] = run(args.workload, name, seed)
            print(f"[transformer] {i + 1}/{len(names)} {name} seed {seed}: "
                  f"{done[(name, seed)].get('test_loss', done[(name, seed)].get('failed'))}",
                  flush=True)
    rows = [done[key] for key in sorted((k for k in done if k[0] in runs),
                                        key=lambda k: (list(runs).index(k[0]), k[1]))]
    what = "examples/char_gpt.py" if args.workload == "script" else \
        "psparse-launch --model gpt --dataset text --optimizer adamw"
    result = {"workload": f"{what}, {WORKERS} workers, {STEPS} steps (-long: {LONG})",
              "unigram_loss": unigram_loss(), "machine": this_machine(),
              "commit": provenance()["git_commit"], "rows": rows}
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
