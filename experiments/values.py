"""Issue 39: fewer bits per entry. Value formats with error feedback at both ends, measured.

    python -m experiments.values            # make exp-values (about 40 min here)

LeNet/MNIST, 8 workers, 2 epochs (468 iterations; the section 7 setup), density 1% and 0.1%:
`topk` and `vote keep=1.5` with values in fp32 (the baseline), int8 and int4 (the server's
error memory on), seeds 0, 1, 2; bf16 and ScaleCom (`cltk` + the scalecom memory) at int8 on
seed 0; int8 and int4 without the server's memory (``--no-broadcast-memory``) for `topk` at 1%,
seed 0, to show what that memory buys. ``--cifar``: LeNet-5/CIFAR-10 at section 3's 30 epochs
(the `cifar-lenet` sweep's settings), `vote keep=1.5` with int4 values at 1% and 0.1%, seeds 0-2,
against that sweep's fp32 runs (experiments/results/cifar-lenet.json; ~7 min a run here).

Per cell: final test accuracy (full test set; chance 10%) ± the sample SD over seeds, the bytes
on the wire (pushes + broadcasts, every process) as a share of a dense ring allreduce's, the
same as a share of `topk`-fp32's at that density, and the share of the bytes that are values
(metrics.jsonl's upload_value_bytes + broadcast_value_bytes; the rest is index frames and
headers).

Results: experiments/results/values.{md,json}; runs in runs/values/.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from experiments.harness import RESULTS, ROOT, RunDir, made_by, md_table, mean_sd
from experiments.run import run_one
from experiments.sweeps import LENET, SWEEP_POLICIES, SWEEPS

POLICIES = {"topk": SWEEP_POLICIES["topk"], "vote": SWEEP_POLICIES["vote"],
            "scalecom": ["--policy", "cltk", "--memory", "scalecom"]}


def _runs() -> tuple[dict[str, list[str]], dict[str, list[int]]]:
    runs, seeds = {}, {}
    for density in ("0.01", "0.001"):
        d = ["--density", density]
        for policy in ("topk", "vote"):
            for values in ("fp32", "int8", "int4", "bf16"):
                name = f"{policy}-{values}-d{density}"
                runs[name] = [*d, *POLICIES[policy], "--values", values]
                seeds[name] = [0] if values == "bf16" else [0, 1, 2]
        runs[f"scalecom-int8-d{density}"] = [*d, *POLICIES["scalecom"], "--values", "int8"]
        seeds[f"scalecom-int8-d{density}"] = [0]
    for values in ("int8", "int4"):
        name = f"topk-{values}-nomemory-d0.01"
        runs[name] = ["--density", "0.01", *POLICIES["topk"], "--values", values,
                      "--no-broadcast-memory"]
        seeds[name] = [0]
    return runs, seeds


RUNS, SEEDS = _runs()
CIFAR = {f"cifar-vote-int4-d{d}": [*SWEEPS["cifar-lenet"]["base"], "--density", d,
                                    *POLICIES["vote"], "--values", "int4"]
         for d in ("0.01", "0.001")}


def value_share(row: dict) -> float:
    """The value frames' share of a run's bytes (metrics.jsonl)."""
    metrics = RunDir(ROOT / row["dir"]).metrics()
    values = sum(m["upload_value_bytes"] + m["broadcast_value_bytes"] for m in metrics)
    total = sum(m["upload_bytes"] + m["broadcast_bytes"] for m in metrics)
    return values / total


def table(rows: list[dict]) -> str:
    lines = []
    for name in RUNS:
        got = [r for r in rows if r["run"] == name and "test_acc" in r]
        if not got:
            continue
        density = name.rsplit("-d", 1)[1]
        base = [r for r in rows if r["run"] == f"topk-fp32-d{density}" and "test_acc" in r]
        base_bytes = np.mean([r["sent_bytes_per_iteration"] for r in base]) if base else None
        lines.append([
            name, len(got), mean_sd([100 * r["test_acc"] for r in got]),
            f"{100 * np.mean([r['sent_over_allreduce'] for r in got]):.2f}",
            "-" if base_bytes is None else
            f"{np.mean([r['sent_bytes_per_iteration'] for r in got]) / base_bytes:.3f}",
            f"{100 * np.mean([r['value_share'] for r in got]):.0f}"])
    return md_table(["run", "seeds", "final acc % (± sample SD)",
                     "bytes, % of dense allreduce", "bytes / topk-fp32's",
                     "values, % of bytes"], lines) + "\n\n" + made_by(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.values", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=None, help="folder holding MNIST (default: data)")
    p.add_argument("--only", default=None,
                   help="comma-separated run names (default: all of RUNS)")
    p.add_argument("--cifar", action="store_true",
                   help="the LeNet-5/CIFAR-10 runs instead (results/values-cifar.{md,json})")
    args = p.parse_args(argv)
    if args.cifar:
        return cifar(args.data_dir)
    names = args.only.split(",") if args.only else list(RUNS)
    plan = [(n, s) for n in names for s in SEEDS[n]]
    rows = []
    for i, (name, seed) in enumerate(plan):
        row = run_one("values", name, [*LENET, *RUNS[name]], seed, args.data_dir, 0.98,
                      label=f"{i + 1}/{len(plan)} ")
        if "test_acc" in row:
            row["value_share"] = value_share(row)
        rows.append(row)
        print(f"{i + 1}/{len(plan)} {name} seed {seed}: "
              f"{row.get('test_acc', row.get('failed'))}", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "values.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / "values.md").write_text(table(rows) + "\n")
    print(table(rows))
    return 0


def cifar(data_dir: str | None) -> int:
    """vote keep=1.5 with int4 values on LeNet-5/CIFAR-10 against the cifar-lenet sweep's
    fp32 top-k and vote runs (same arguments but --values)."""
    plan = [(name, seed) for name in CIFAR for seed in (0, 1, 2)]
    rows = [run_one("values", name, CIFAR[name], seed, data_dir, 0.6, progress=True,
                    label=f"{i + 1}/{len(plan)} ") for i, (name, seed) in enumerate(plan)]
    for row in rows:
        if "test_acc" in row:
            row["value_share"] = value_share(row)
    earlier = json.loads((RESULTS / "cifar-lenet.json").read_text())
    lines = []
    for density in ("0.01", "0.001"):
        base = [r for r in earlier if r["run"] == f"topk-d{density}"]
        base_bytes = np.mean([r["sent_bytes_per_iteration"] for r in base])
        for name, got in ((f"topk-fp32-d{density}", base),
                          (f"vote-fp32-d{density}",
                           [r for r in earlier if r["run"] == f"vote-d{density}"]),
                          (f"cifar-vote-int4-d{density}",
                           [r for r in rows if r["run"] == f"cifar-vote-int4-d{density}"
                            and "test_acc" in r])):
            if not got:
                continue
            lines.append([name, len(got), mean_sd([100 * r["test_acc"] for r in got]),
                          f"{100 * np.mean([r['sent_over_allreduce'] for r in got]):.2f}",
                          f"{np.mean([r['sent_bytes_per_iteration'] for r in got]) / base_bytes:.3f}",
                          " ".join(sorted({str(r.get('code'))[:7] for r in got}))])
    text = md_table(["run", "seeds", "final acc % (± sample SD)", "bytes, % of dense allreduce",
                     "bytes / topk-fp32's", "made by"], lines)
    (RESULTS / "values-cifar.json").write_text(json.dumps(rows, indent=1))
    (RESULTS / "values-cifar.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
