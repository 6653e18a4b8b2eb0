"""Issue 17, item 5: how the parameter server scales with workers N and server shards S.

    python benchmarks/bench_scale.py                      # make bench-scale: every part
    python benchmarks/bench_scale.py --part aggregation   # server aggregation vs memcpy
    python benchmarks/bench_scale.py --part grid          # the N x S grid of real runs
    python benchmarks/bench_scale.py --part protocol      # bench_protocol.py's round trips
    python benchmarks/bench_scale.py --part cluster       # the grid on an emulated cluster (root)
    python benchmarks/bench_scale.py --part report        # tables and figure from the JSON
    python benchmarks/bench_scale.py --part grid --sizes lenet --workers 2,4 --servers 1,2

Parts (every ratio is measured in the same run as its baseline):

``aggregation``: the server's aggregation path (``psparse.server.aggregation.Aggregator.mean``: the
compiled rank-order sum of ``agg_kernels``, whose reference ``reference.sparse_mean`` is the
scatter-add of N pushes into the dense scratch, sorted union, mean at the union, scratch
zeroed) for N pushes of k entries each (half of every push shared by all
workers, half its own), against one memory copy (``numpy.copyto``) of the same bytes (N·k int32
indices and float32 values), interleaved medians of wall time. Entries aggregated per second
= N·k / time; the ratio is the aggregation's throughput as a fraction of memcpy's.

``grid``: real ``psparse-launch`` runs at N = 2, 4, 8, 16 workers and S = 1, 2, 4 key-range
server shards, for ``--policy topk``, ``--policy core`` and (at N >= 8) ``--policy core
--policy-arg private=1``, at two model sizes (LeNet-5/MNIST, 61,706 parameters, and the
synthetic load-test model at 1M parameters on scikit-learn's digits), density 1%, 30
iterations, ``--eval-every 0``, seed 0, on loopback with ``--bandwidth 100Mbit`` (each server
shard paces its own link: every round's pushes, then its broadcast, hold the round for bytes x
8 / rate). From the shards' metrics: the bytes per iteration on each server shard's link
(upload + broadcast, all N workers' copies), their maximum and mean over the shards, and
ms/iteration (training time after 5 warm-up iterations, the slowest shard's clock). Bytes are
deterministic (same seed and config, same bytes); times are not. The per-server bytes are
fitted against N on log-log axes (exponent a in bytes ~ N^a: N·k would give 1, N²·k 2).
Runs land in ``--runs`` (default runs/bench-scale); a finished run with the same arguments is
reused (experiments/harness.py, ``RunCache``). Results: ``benchmarks/bench_scale.json``, figure ``benchmarks/bench_scale.png``.

``cluster`` (root; not part of ``all``): the grid's launches on an emulated cluster
(``launch/netns.sh cluster``, rebuilt for every run and taken down after it): S + N hosts,
shard I on host hI (``--server-hosts``), worker r on host h(S + r), every link shaped at
``--cluster-rate`` (default 25mbit), each host a CPU share of ``--cluster-cpus`` / (S + N)
cores, pinned; no ``--bandwidth``. The hosts go by their addresses; the run's remote shell
(``rsh.sh`` in its run directory) enters the namespace that holds the address. E.g.
``--part cluster --sizes synthetic-1M --policies topk,core --iterations 20``.

``protocol``: ``bench_protocol.main()`` as it is (1 MB and 100 MB round trips vs a raw ZeroMQ
echo, and the 1 MB delta-coded row); not duplicated here.

``overlap`` (not part of ``all``): runs ``benchmarks/bench_overlap.py`` when it exists (the
overlapped vs unoverlapped iteration; another change adds it); ``make bench-scale`` runs it
after ``--part all``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
from bench_scale_grid import (  # noqa: E402
    BANDWIDTH,
    CLUSTER_RATE,
    DENSITY,
    ITERATIONS,
    POLICIES,
    SERVERS,
    SIZES,
    WARMUP,
    WORKERS,
    cluster_config,
    grid_part,
    plan,
)
from common import half_shared_pushes, interleaved_medians  # noqa: E402

from experiments.harness import md_table  # noqa: E402
from psparse.server.aggregation import Aggregator  # noqa: E402
from psparse.wire.transport import parse_rate  # noqa: E402

RESULTS = HERE / "bench_scale.json"
FIGURE = HERE / "bench_scale.png"

# aggregation part: (label, numel, density), N pushes each
AGG_CASES = [("LeNet-5", 61_706, 0.01), ("11.2M", 11_200_000, 0.01),
             ("25M", 25_000_000, 0.001)]
AGG_WORKERS = (2, 8, 16)


# ---------------------------------------------------------------------------- aggregation

def aggregation_part(cases=AGG_CASES, workers=AGG_WORKERS, repeats: int | None = None) -> list:
    rng = np.random.default_rng(0)
    rows = []
    for label, numel, density in cases:
        k = max(1, round(numel * density))
        agg = Aggregator(numel)
        for n in workers:
            idx, val = half_shared_pushes(rng, numel, k, n)
            src = np.concatenate([np.concatenate(idx).view(np.uint8),
                                  np.concatenate(val).view(np.uint8)])
            dst = np.empty_like(src)
            union, _ = agg.mean(idx, val)
            assert not agg.accumulator.any()  # the scratch is left zeroed
            reps = repeats or (15 if n * k < 1_000_000 else 7)
            t_copy, t_agg = interleaved_medians(lambda: np.copyto(dst, src),
                                                lambda: agg.mean(idx, val), reps)
            entries = n * k
            rows.append({"case": label, "numel": numel, "density": density, "k": k,
                         "workers": n, "union": int(union.size), "bytes": int(src.nbytes),
                         "agg_s": t_agg, "copy_s": t_copy,
                         "agg_entries_per_s": entries / t_agg,
                         "copy_entries_per_s": entries / t_copy, "ratio": t_copy / t_agg})
    return rows


def aggregation_table(rows: list) -> str:
    body = [[r["case"], f"{r['k']:,}", r["workers"], f"{r['union']:,}",
             f"{r['bytes'] / 1e6:.2f}", f"{r['agg_s'] * 1e3:.3f}", f"{r['copy_s'] * 1e3:.3f}",
             f"{r['agg_entries_per_s'] / 1e6:.1f}", f"{r['copy_entries_per_s'] / 1e6:.0f}",
             f"{r['ratio']:.1%}"] for r in rows]
    return md_table(["model", "k", "N", "union", "pushed MB", "aggregate ms", "memcpy ms",
                     "aggregated M entries/s", "memcpy M entries/s",
                     "aggregate / memcpy throughput"], body)


# ---------------------------------------------------------------------------- grid tables
# (the grid's configurations and runs: bench_scale_grid.py)

def exponents(rows: list, key: str = "server_max_b") -> dict:
    """(size, policy, S) -> least-squares slope of log(key) against log(N)."""
    out = {}
    groups: dict = {}
    for r in rows:
        if "failed" not in r:
            groups.setdefault((r["size"], r["policy"], r["servers"]), []).append(
                (r["workers"], r[key]))
    for g, pts in groups.items():
        if len(pts) >= 2:
            n, y = np.log([p[0] for p in sorted(pts)]), np.log([p[1] for p in sorted(pts)])
            out[g] = float(np.polyfit(n, y, 1)[0])
    return out


def grid_table(rows: list, bandwidth: str | None = BANDWIDTH) -> str:
    """The grid as a markdown table; with ``bandwidth``, also the time the busiest shard's
    paced link needs per iteration (its bytes x 8 / rate: what --bandwidth holds the round for,
    a floor under ms/iter that does not depend on the CPU)."""
    rate = parse_rate(bandwidth) if bandwidth else None
    ok = [r for r in rows if "failed" not in r]
    one = {(r["size"], r["policy"], r["workers"]): r for r in ok if r["servers"] == 1}
    body = []
    for r in sorted(ok, key=lambda r: (list(SIZES).index(r["size"]),
                                       list(POLICIES).index(r["policy"]), r["workers"],
                                       r["servers"])):
        base = one.get((r["size"], r["policy"], r["workers"]))
        frac = f"{r['server_max_b'] / base['server_max_b']:.2f}" if base else "-"
        speed = f"{base['ms_per_iter'] / r['ms_per_iter']:.2f}x" if base else "-"
        body.append([r["size"], r["policy"], r["workers"], r["servers"], f"{r['union_k']:.2f}",
                     f"{r['total_b'] / 1e3:,.1f}", f"{r['server_max_b'] / 1e3:,.1f}",
                     f"{r['server_mean_b'] / 1e3:,.1f}", frac]
                    + ([f"{r['server_max_b'] * 8e3 / rate:.0f}"] if rate else [])
                    + [f"{r['ms_per_iter']:.0f}", speed])
    text = md_table(["model", "policy", "N", "S", "union/k", "all shards KB/iter",
                     "busiest server link KB/iter", "mean server link KB/iter", "busiest / S=1"]
                    + ([f"busiest link ms/iter at {bandwidth}"] if rate else [])
                    + ["ms/iter", "speed-up vs S=1"], body)
    failed = [f"{r['run']}: {r['failed'][-200:]}" for r in rows if "failed" in r]
    return text + ("\n\nFailed: " + "; ".join(failed) if failed else "")


def summary_table(rows: list, bandwidth: str | None = BANDWIDTH) -> str:
    """One row per (model, policy, N): the busiest (and mean) server link at S = 1, 2, 4, the
    paced link time of the busiest shard, and ms/iteration."""
    rate = parse_rate(bandwidth) if bandwidth else None
    ok = {(r["size"], r["policy"], r["workers"], r["servers"]): r for r in rows
          if "failed" not in r}
    groups = sorted({k[:3] for k in ok}, key=lambda g: (
        list(SIZES).index(g[0]), list(POLICIES).index(g[1]), g[2]))
    servers = sorted({k[3] for k in ok})
    body = []
    for g in groups:
        got = [ok.get((*g, s)) for s in servers]
        one = ok.get((*g, 1))

        def each(fmt, got=got):
            return " / ".join(fmt(r) if r else "-" for r in got)
        body.append([g[0], g[1], g[2], f"{next(r for r in got if r)['union_k']:.2f}",
                     each(lambda r: f"{r['server_max_b'] / 1e3:,.0f}"),
                     each(lambda r: f"{r['server_mean_b'] / 1e3:,.0f}"),
                     each(lambda r: f"{r['server_max_b'] / one['server_max_b']:.2f}"
                          if one else "-")]
                    + ([each(lambda r: f"{r['server_max_b'] * 8e3 / rate:.0f}")] if rate else [])
                    + [each(lambda r: f"{r['ms_per_iter']:.0f}")])
    s = "/".join(map(str, servers))
    return md_table(["model", "policy", "N", "union/k", f"busiest link KB/iter, S = {s}",
                     f"mean link KB/iter, S = {s}", f"busiest / S=1, S = {s}"]
                    + ([f"busiest link ms/iter at {bandwidth}, S = {s}"] if rate else [])
                    + [f"measured ms/iter, S = {s}"], body)


def exponent_table(rows: list) -> str:
    e_max, e_mean, e_ms = (exponents(rows, k) for k in
                           ("server_max_b", "server_mean_b", "ms_per_iter"))
    body = []
    for (size, policy, s), a in sorted(e_max.items(), key=lambda kv: (
            list(SIZES).index(kv[0][0]), list(POLICIES).index(kv[0][1]), kv[0][2])):
        ns = sorted(r["workers"] for r in rows if "failed" not in r and
                    (r["size"], r["policy"], r["servers"]) == (size, policy, s))
        body.append([size, policy, s, ",".join(map(str, ns)), f"{a:.2f}",
                     f"{e_mean[(size, policy, s)]:.2f}", f"{e_ms[(size, policy, s)]:.2f}"])
    return md_table(["model", "policy", "S", "N fitted", "busiest link ~ N^a",
                     "mean link ~ N^a", "ms/iter ~ N^a"], body)


def figure(rows: list, path: Path = FIGURE, cluster: list | None = None,
           cluster_rate: str | None = None) -> Path | None:
    """Busiest server link and ms/iteration against N: a row per model size of the loopback
    grid, and one per model size of the emulated-cluster runs (``cluster``)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = [r for r in rows if "failed" not in r]
    panels = [(s, ok, "loopback") for s in SIZES if any(r["size"] == s for r in ok)]
    ok_cluster = [r for r in cluster or [] if "failed" not in r]
    panels += [(s, ok_cluster, f"emulated cluster, {cluster_rate} links") for s in SIZES
               if any(r["size"] == s for r in ok_cluster)]
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 4.2 * len(panels)), squeeze=False)
    colors = {1: "tab:blue", 2: "tab:orange", 4: "tab:green"}
    styles = {"topk": "-", "core": "--", "core-private1": ":"}
    for row, (size, ok, where) in zip(axes, panels):
        for policy in POLICIES:
            for s in SERVERS:
                pts = sorted((r["workers"], r["server_max_b"], r["ms_per_iter"]) for r in ok
                             if (r["size"], r["policy"], r["servers"]) == (size, policy, s))
                if not pts:
                    continue
                n = [p[0] for p in pts]
                kw = dict(color=colors.get(s), ls=styles.get(policy), marker="o", ms=3,
                          label=f"{policy}, S={s}")
                row[0].plot(n, [p[1] / 1e3 for p in pts], **kw)
                row[1].plot(n, [p[2] for p in pts], **kw)
        numel = next(r["numel"] for r in ok if r["size"] == size)
        row[0].set_title(f"{size} ({numel:,} parameters), {where}: busiest server link",
                         fontsize=9)
        row[0].set_ylabel("KB per iteration (up + broadcast)")
        row[1].set_title(f"{size}, {where}: time per iteration", fontsize=9)
        row[1].set_ylabel("ms per iteration")
        for ax in row:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(WORKERS, [str(n) for n in WORKERS])
            ax.minorticks_off()
            ax.set_xlabel("workers N")
            ax.grid(alpha=0.3)
        row[1].legend(fontsize=7, ncol=3)
    fig.suptitle(f"psparse: bytes per server link and ms/iteration against N, S = 1, 2, 4 "
                 f"(density {DENSITY}; loopback: --bandwidth {BANDWIDTH} per shard)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- glue

def protocol_part() -> int:
    import bench_protocol
    return bench_protocol.main()


def overlap_part() -> int:
    script = HERE / "bench_overlap.py"
    if not script.exists():
        print("benchmarks/bench_overlap.py is not there yet: no overlap figures")
        return 0
    return subprocess.run([sys.executable, str(script)], cwd=ROOT).returncode


def report(results: dict) -> str:
    parts = []
    if results.get("aggregation"):
        parts.append("Server aggregation of N pushes vs one memory copy of the same bytes "
                     "(medians; ratio measured in this run)\n\n"
                     + aggregation_table(results["aggregation"]))
    if results.get("grid"):
        codes = [r.get("code") or "?" for r in results["grid"] if "failed" not in r]
        commits = sorted({c.split("+")[0][:10] for c in codes})
        dirty = sum("+dirty" in c for c in codes)
        parts.append("Bytes per server link and time per iteration (runs made by commit "
                     + ", ".join(commits)
                     + (f"; {dirty} of {len(codes)} with uncommitted edits" if dirty else "")
                     + ")\n\n"
                     + grid_table(results["grid"],
                                  results.get("grid_setup", {}).get("bandwidth", BANDWIDTH)))
        parts.append("The same, one row per model, policy and N\n\n"
                     + summary_table(results["grid"],
                                     results.get("grid_setup", {}).get("bandwidth", BANDWIDTH)))
        parts.append("Fitted exponents against N\n\n" + exponent_table(results["grid"]))
    if results.get("cluster"):
        setup = results.get("cluster_setup", {})
        parts.append(f"Emulated cluster (launch/netns.sh: S + N hosts, links "
                     f"{setup.get('rate')}, {setup.get('cpus')} cores shared by the hosts), "
                     "one row per model, policy and N\n\n"
                     + summary_table(results["cluster"], setup.get("rate")))
    return "\n\n".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default="all",
                   choices=["all", "aggregation", "grid", "cluster", "protocol", "overlap",
                            "report"])
    p.add_argument("--runs", default=str(ROOT / "runs" / "bench-scale"))
    p.add_argument("--results", default=str(RESULTS), help="JSON of the figures")
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--workers", default=",".join(map(str, WORKERS)))
    p.add_argument("--servers", default=",".join(map(str, SERVERS)))
    p.add_argument("--iterations", type=int, default=ITERATIONS)
    p.add_argument("--bandwidth", default=BANDWIDTH, help="per shard; 'none' for no pacing")
    p.add_argument("--figure", default=str(FIGURE))
    p.add_argument("--cluster-rate", default=CLUSTER_RATE,
                   help="--part cluster: every emulated link's rate (tc tbf)")
    p.add_argument("--cluster-cpus", default="2",
                   help="--part cluster: cores shared by the emulated hosts (PSNET_CPUS)")
    a = p.parse_args(argv)
    results_path = Path(a.results)
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    rc = 0
    if a.part in ("all", "aggregation"):
        results["aggregation"] = aggregation_part()
        results_path.write_text(json.dumps(results, indent=1))
    if a.part in ("all", "grid"):
        configs = plan({s: SIZES[s] for s in a.sizes.split(",")},
                       {q: POLICIES[q] for q in a.policies.split(",")},
                       tuple(int(n) for n in a.workers.split(",")),
                       tuple(int(s) for s in a.servers.split(",")))
        bandwidth = None if a.bandwidth == "none" else a.bandwidth
        rows = grid_part(configs, Path(a.runs), iterations=a.iterations, bandwidth=bandwidth)
        key = lambda r: (r["size"], r["policy"], r["workers"], r["servers"])  # noqa: E731
        fresh = {key(r) for r in rows}
        results["grid"] = [r for r in results.get("grid", []) if key(r) not in fresh] + rows
        results["grid_setup"] = {"iterations": a.iterations, "bandwidth": bandwidth,
                                 "density": DENSITY, "warmup": WARMUP, "host": os.uname()[1]}
        results_path.write_text(json.dumps(results, indent=1))
    if a.part == "cluster":  # root; not part of all (the grid's loopback runs are)
        configs = plan({s: SIZES[s] for s in a.sizes.split(",")},
                       {q: POLICIES[q] for q in a.policies.split(",")},
                       tuple(int(n) for n in a.workers.split(",")),
                       tuple(int(s) for s in a.servers.split(",")))
        rows = []
        for i, cfg in enumerate(configs):
            print(f"[cluster {i + 1}/{len(configs)}] {cfg}", file=sys.stderr, flush=True)
            rows.append(cluster_config(cfg, Path(a.runs), a.cluster_rate, a.iterations,
                                       a.cluster_cpus))
            key = lambda r: (r["size"], r["policy"], r["workers"], r["servers"])  # noqa: E731
            results["cluster"] = [r for r in results.get("cluster", [])
                                  if key(r) not in {key(x) for x in rows}] + rows
            results["cluster_setup"] = {"iterations": a.iterations, "rate": a.cluster_rate,
                                        "cpus": a.cluster_cpus, "warmup": WARMUP}
            results_path.write_text(json.dumps(results, indent=1))
    if a.part in ("all", "grid", "aggregation", "cluster", "report"):
        print(report(results))
        if results.get("grid") and figure(results["grid"], Path(a.figure),
                                          results.get("cluster"),
                                          results.get("cluster_setup", {}).get("rate")):
            print(f"\nfigure: {a.figure}")
    if a.part in ("all", "protocol"):
        rc |= protocol_part()
    if a.part == "overlap":  # make bench-scale runs bench_overlap.py itself, after this
        rc |= overlap_part()
    return rc


if __name__ == "__main__":
    sys.exit(main())
