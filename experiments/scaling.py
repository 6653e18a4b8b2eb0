"""Issue 18: how the broadcast grows with the number of workers N, and which part of the union
is shared by all workers and which is private.

    python -m experiments.scaling                    # make exp-scaling: both parts
    python -m experiments.scaling --part union       # only the N sweep (about 30 min here)
    python -m experiments.scaling --part accuracy    # only the accuracy runs at N = 16, 32
    python -m experiments.scaling --part accuracy-long  # N = 32, top-k and vote, 4 epochs
    python -m experiments.scaling --part report      # tables and figure from scaling.json

Part ``union`` (the issue's measurement, extended): LeNet/MNIST, density 1% (k = 617), 32
images per worker per iteration, 150 iterations, seed 0, at N = 2, 4, 8, 16 and 32 workers, for
top-k and the aligning rules (core, core with ``private=1``, vote keep=1.5, ema, penalty pi=0.1).
Every worker records the indices it pushed (``--record-selections``), which splits each
round's union by how many workers pushed an index: by all N (the shared part), by 2..N-1, or by
one worker only (private). The server's broadcast bytes per iteration (on the wire, all N
copies) are fitted against N on log-log axes; an aligning rule would ideally give N^1 (union/k
flat in N), the union of N disjoint top-k sets N^2.

Part ``accuracy``: N = 16 and 32 workers, 2 epochs (the same 120,000 images per run at any N,
so 234 iterations at N = 16 and 117 at N = 32), seeds 0, 1, 2: top-k, core (own=0.125), core
private=1 and vote keep=1.5, final test accuracy on the whole test set.

Part ``accuracy-long``: the N = 32 runs of top-k and vote again for 4 epochs (234 iterations;
at 2 epochs N = 32 has only 117 iterations, early in training, where seeds spread widely).

Runs land in runs/scaling/, runs/scaling-accuracy/ and runs/scaling-accuracy-e4/ (a finished run is reused, see
experiments.run.run_one); the tables in experiments/results/scaling.md and .json, the figure in
experiments/results/scaling.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from experiments.figures import pyplot, save
from experiments.harness import RESULTS, ROOT, RunDir, made_by, md_table, mean_of, mean_sd
from experiments.run import run_one
from experiments.sweeps import SWEEP_POLICIES
from psparse.analysis import locality

BASE = ["--model", "lenet", "--dataset", "mnist", "--density", "0.01", "--eval-every", "0"]
WORKERS = (2, 4, 8, 16, 32)
POLICIES = {
    "topk": SWEEP_POLICIES["topk"],
    "core": SWEEP_POLICIES["core"],
    "core-private1": ["--policy", "core", "--policy-arg", "private=1"],
    "vote": SWEEP_POLICIES["vote"],
    "ema": SWEEP_POLICIES["ema"],
    "penalty": SWEEP_POLICIES["penalty"],
}
ACCURACY_WORKERS = (16, 32)
ACCURACY_POLICIES = ("topk", "core", "core-private1", "vote")
ACCURACY_SEEDS = (0, 1, 2)


def union_parts(run_dir: Path, workers: int) -> dict[str, float]:
    """Mean over iterations, in units of k, of the union's indices pushed by all ``workers``,
    by 2..workers-1 of them, and by one only (from the workers' recorded selections)."""
    files = sorted(run_dir.glob("selections-rank-*.npz"))
    if len(files) != workers:
        raise FileNotFoundError(f"{run_dir}: {len(files)} selection files for {workers} workers")
    sent = [locality.load(f)["sent"] for f in files]
    parts = {"all": [], "several": [], "one": []}
    for t in range(min(len(s) for s in sent)):
        _, counts = np.unique(np.concatenate([s[t] for s in sent]), return_counts=True)
        k = np.mean([s[t].size for s in sent])
        parts["all"].append(np.count_nonzero(counts == workers) / k)
        parts["one"].append(np.count_nonzero(counts == 1) / k)
        parts["several"].append(np.count_nonzero((counts > 1) & (counts < workers)) / k)
    return {f"{name}_k": float(np.mean(v)) for name, v in parts.items()}


def per_iteration_bytes(run_dir: Path) -> dict[str, float]:
    metrics = RunDir(run_dir).metrics()
    return {"broadcast_b": float(np.mean([m["broadcast_bytes"] for m in metrics])),
            "upload_b": float(np.mean([m["upload_bytes"] for m in metrics]))}


def run_union_part(data_dir: str | None) -> list[dict]:
    rows = []
    plan = [(p, n) for n in WORKERS for p in POLICIES]  # small N first: a stopped sweep has all
    for i, (policy, n) in enumerate(plan):
        args = ["--workers", str(n), *BASE, "--iterations", "150", "--record-selections",
                *POLICIES[policy]]
        row = run_one("scaling", f"{policy}-n{n}", args, 0, data_dir, 0.98,
                      label=f"{i + 1}/{len(plan)} ")
        if "failed" in row:
            rows.append({**row, "policy": policy})
            continue
        run_dir = ROOT / row["dir"]
        row.update(policy=policy, **union_parts(run_dir, n), **per_iteration_bytes(run_dir))
        rows.append(row)
    return rows


def run_accuracy_part(data_dir: str | None, epochs: int = 2, workers=ACCURACY_WORKERS,
                      policies=ACCURACY_POLICIES) -> list[dict]:
    rows = []
    plan = [(p, n, s) for s in ACCURACY_SEEDS for n in workers for p in policies]
    sweep = "scaling-accuracy" if epochs == 2 else f"scaling-accuracy-e{epochs}"
    for i, (policy, n, seed) in enumerate(plan):
        args = ["--workers", str(n), *BASE, "--epochs", str(epochs), *POLICIES[policy]]
        row = run_one(sweep, f"{policy}-n{n}", args, seed, data_dir, 0.98,
                      label=f"{i + 1}/{len(plan)} ")
        rows.append({**row, "policy": policy})
    return rows


def exponents(rows: list[dict], key: str) -> dict[str, dict]:
    """Per policy: the least-squares slope of log(key) against log(N) over every N, and the
    slopes between neighbouring N."""
    out = {}
    for policy in POLICIES:
        pts = sorted((r["workers"], r[key]) for r in rows
                     if r.get("policy") == policy and "failed" not in r)
        if len(pts) < 2:
            continue
        n, y = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
        out[policy] = {"fit": float(np.polyfit(n, y, 1)[0]),
                       "neighbours": [float((y[i + 1] - y[i]) / (n[i + 1] - n[i]))
                                      for i in range(len(pts) - 1)],
                       "workers": [p[0] for p in pts]}
    return out


def union_table(rows: list[dict]) -> str:
    body = [[r["policy"], r["workers"], f"{r['union_k_mean']:.2f}", f"{r['all_k']:.2f}",
             f"{r['several_k']:.2f}", f"{r['one_k']:.2f}", f"{r['broadcast_b']:,.0f}",
             f"{r['upload_b']:,.0f}", f"{r['broadcast_b'] + r['upload_b']:,.0f}",
             f"{100 * r['test_acc']:.2f}"]
            for r in sorted((r for r in rows if "failed" not in r),
                            key=lambda r: (list(POLICIES).index(r["policy"]), r["workers"]))]
    failed = [f"{r['run']}: {r['failed'][:80]}" for r in rows if "failed" in r]
    return md_table(["policy", "N", "union/k", "shared by all N, /k", "by 2..N-1, /k",
                     "by one worker, /k", "broadcast B/iter", "upload B/iter",
                     "server link B/iter (up + bcast)", "acc % after 150 it"], body) + \
        "\n" + (f"\nFailed: {'; '.join(failed)}" if failed else "")


def exponent_table(rows: list[dict]) -> str:
    bcast, link = exponents(rows, "broadcast_b"), exponents(rows, "server_b")
    return md_table(["policy", "broadcast B/iter ~ N^a: fitted a", "a between neighbouring N",
                     "server link (up + bcast) ~ N^a"],
                    [[policy, f"{e['fit']:.2f}", ", ".join(f"{a:.2f}" for a in e["neighbours"]),
                      f"{link[policy]['fit']:.2f}"] for policy, e in bcast.items()])


def accuracy_table(rows: list[dict]) -> str:
    body = []
    for n in ACCURACY_WORKERS:
        for policy in ACCURACY_POLICIES:
            rs = [r for r in rows if r["policy"] == policy and r.get("workers", n) == n
                  and r["run"] == f"{policy}-n{n}"]
            ok = [r for r in rs if "failed" not in r]
            if not ok:
                continue
            failed = f" ({len(rs) - len(ok)} failed)" if len(ok) < len(rs) else ""
            body.append([n, policy, f"{len(ok)}{failed}",
                         mean_sd([100 * r["test_acc"] for r in ok]),
                         f"{mean_of(ok, 'union_k_mean'):.2f}", f"{mean_of(ok, 'union_k_p95'):.2f}",
                         f"{100 * mean_of(ok, 'sent_over_allreduce'):.2f}"])
    return md_table(["N", "policy", "seeds", "final acc % (± sample SD)", "union/k mean",
                     "union/k p95", "up + bcast, % of dense allreduce"], body)


def figure(rows: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    fits = exponents(rows, "broadcast_b")
    for policy in POLICIES:
        pts = sorted((r["workers"], r["broadcast_b"], r["union_k_mean"], r["all_k"])
                     for r in rows if r.get("policy") == policy and "failed" not in r)
        if not pts:
            continue
        n = [p[0] for p in pts]
        line, = left.plot(n, [p[1] for p in pts], "o-",
                          label=f"{policy} (N^{fits[policy]['fit']:.2f})"
                          if policy in fits else policy)
        right.plot(n, [p[2] for p in pts], "o-", color=line.get_color(), label=policy)
        if policy.startswith("core"):  # the shared part: the core every worker sends
            right.plot(n, [p[3] for p in pts], ":", color=line.get_color(),
                       label=f"{policy}: shared by all N")
    ref = min(r["broadcast_b"] for r in rows if r.get("workers") == WORKERS[0]
              and "failed" not in r)
    for power, style in ((1, "--"), (2, "-.")):
        left.plot(WORKERS, [ref * (n / WORKERS[0]) ** power for n in WORKERS], style,
                  color="grey", linewidth=0.8, label=f"N^{power}")
    left.set(xscale="log", yscale="log", xlabel="workers N", ylabel="broadcast bytes / iteration",
             title="Server broadcast (all N copies) against N")
    right.set(xscale="log", xlabel="workers N", ylabel="union / k",
              title="Union size, and the part every worker pushed")
    for ax in (left, right):
        ax.set_xticks(WORKERS, [str(n) for n in WORKERS])
        ax.tick_params(axis="x", which="minor", labelbottom=False)  # only the N ticks
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("LeNet/MNIST, density 1% (k = 617), 150 iterations, seed 0", fontsize=9)
    return save(fig, path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.scaling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("union", "accuracy", "accuracy-long", "both", "report"),
                   default="both",
                   help="which runs to make (finished runs are reused); report: only rewrite "
                        "the tables and the figure from results/scaling.json")
    p.add_argument("--data-dir", default=None, help="passed to psparse-launch")
    args = p.parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "scaling.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    if args.part in ("union", "both"):
        saved["union"] = run_union_part(args.data_dir)
    if args.part in ("accuracy", "both"):
        saved["accuracy"] = run_accuracy_part(args.data_dir)
    if args.part == "accuracy-long":
        saved["accuracy-long"] = run_accuracy_part(args.data_dir, epochs=4, workers=(32,),
                                                   policies=("topk", "vote"))
    for r in saved.get("union", []):
        if "failed" not in r:
            r["server_b"] = r["broadcast_b"] + r["upload_b"]
    path.write_text(json.dumps(saved, indent=1))
    text = []
    if saved.get("union"):
        text += ["## Union and bytes against N\n", union_table(saved["union"]), "",
                 "## Exponents\n", exponent_table(saved["union"]), "",
                 made_by(saved["union"]), ""]
        print(f"wrote {figure(saved['union'], RESULTS / 'scaling.png')}")
    if saved.get("accuracy"):
        text += ["## Accuracy at N = 16 and 32 (2 epochs)\n", accuracy_table(saved["accuracy"]),
                 "", made_by(saved["accuracy"]), ""]
    if saved.get("accuracy-long"):
        text += ["## Accuracy at N = 32 over 4 epochs (234 iterations)\n",
                 accuracy_table(saved["accuracy-long"]), "", made_by(saved["accuracy-long"]), ""]
    (RESULTS / "scaling.md").write_text("\n".join(text))
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
