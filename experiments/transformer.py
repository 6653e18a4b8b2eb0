"""Issue 53: a character-level GPT with AdamW at 1% density, where the gap to dense comes from,
and the remedy measured over 3 seeds.

    python -m experiments.transformer            # make exp-transformer (about 25 min on 2 cores)
    python -m experiments.transformer --only adamw-topk,local-adam-topk --seeds 0

``examples/char_gpt.py`` (421,376 parameters, tied head, AdamW in two parameter groups, warm-up
then cosine, 300 steps, 4 workers × 16 windows of 64 characters of the standard library's
source) through ``psparse-launch``, one run per configuration and seed:

* ``adamw-dense`` / ``local-adam-dense``: everything sent (the baseline; and the remedy's own
  dense point, which differs from dense AdamW only in whose gradient the moments see);
* ``adamw-topk``: AdamW on the 1% aggregate, as a user writes it (the gap of issue 53);
* ``adamw-topk-layer``: the same with per-tensor budgets (``--granularity layer``: every
  tensor, the embeddings and LayerNorms included, gets its share of k);
* ``local-adam-topk``: the remedy, each worker's own Adam step sent with error feedback
  (``--memory adam``, plain SGD on the aggregate), then with 4-bit values and with an aligning
  rule (``vote keep=1.5 --values int4``).

Figures per run: the final validation loss (nats/char), its share of dense AdamW's gain over
the unigram baseline, union/k, and bytes per iteration as a share of a dense ring allreduce.
Results: experiments/results/transformer-adamw.json (the results page's table is made from it);
runs in runs/transformer/.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys

import numpy as np

from experiments.harness import RESULTS, ROOT, RunCache, RunDir
from experiments.run import dense_allreduce_bytes, sent_per_iteration, union_over_k
from experiments.time_to_accuracy import this_machine
from psparse.provenance import provenance

SCRIPT = ROOT / "examples" / "char_gpt.py"
STEPS, WORKERS = 300, 4
TOPK = ["--density", "0.01"]
RUNS = {  # name -> (psparse-launch options, the script's options)
    "adamw-dense": (["--density", "1"], []),
    "local-adam-dense": (["--density", "1"], ["--local-adam"]),
    "adamw-topk": (TOPK, []),
    "adamw-topk-layer": ([*TOPK, "--granularity", "layer"], []),
    "local-adam-topk": (TOPK, ["--local-adam"]),
    "local-adam-topk-int4": ([*TOPK, "--values", "int4"], ["--local-adam"]),
    "local-adam-vote-int4": ([*TOPK, "--policy", "vote", "--policy-arg", "keep=1.5",
                              "--values", "int4"], ["--local-adam"]),
}
SEEDS = (0, 1, 2)
STEM = "transformer-adamw"


def unigram_loss() -> float:
    """The example's unigram baseline (its own function, on its own text)."""
    spec = importlib.util.spec_from_file_location("char_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    codes = module.corpus(1_100_000)
    split = int(0.9 * len(codes))
    return module.unigram_loss(codes[:split], codes[split:])


def run(name: str, seed: int) -> dict:
    """One run (reused when this configuration and seed already ended there), its row."""
    launch_args, script_args = RUNS[name]
    out = ROOT / "runs" / "transformer" / f"{name}-s{seed}"
    identity = [*launch_args, "--workers", str(WORKERS), "examples/char_gpt.py",
                "--steps", str(STEPS), "--seed", str(seed), *script_args]
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
            "union_k": float(np.mean(union_over_k(metrics))),
            "sent_over_allreduce": sent / dense_allreduce_bytes(summary["world_size"],
                                                                summary["numel"]),
            "numel": summary["numel"], "code": d.code_id(), "dir": str(out.relative_to(ROOT))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.transformer",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated configurations (default: all): "
                    + ", ".join(RUNS))
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)),
                    help="comma-separated seeds (default: 0,1,2)")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        ap.error(f"unknown configuration {unknown[0]!r}; choose from {', '.join(RUNS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    path = RESULTS / f"{STEM}.json"
    kept = json.loads(path.read_text())["rows"] if path.is_file() else []
    done = {(r["run"], r["seed"]): r for r in kept}
    for i, name in enumerate(names):
        for seed in seeds:
            done[(name, seed)] = run(name, seed)
            print(f"[transformer] {i + 1}/{len(names)} {name} seed {seed}: "
                  f"{done[(name, seed)].get('test_loss', done[(name, seed)].get('failed'))}",
                  flush=True)
    rows = [done[key] for key in sorted(done, key=lambda k: (list(RUNS).index(k[0]), k[1]))
            if key[0] in RUNS]
    result = {"workload": f"examples/char_gpt.py, {WORKERS} workers, {STEPS} steps",
              "unigram_loss": unigram_loss(), "machine": this_machine(),
              "commit": provenance()["git_commit"], "rows": rows}
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
