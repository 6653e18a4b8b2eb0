"""Issue 17, item 5: how the parameter server scales with workers N and server shards S.

    python benchmarks/bench_scale.py                      # make bench-scale: every part
    python benchmarks/bench_scale.py --part aggregation   # server aggregation vs memcpy
    python benchmarks/bench_scale.py --part grid          # the N x S grid of real runs
    python benchmarks/bench_scale.py --part protocol      # bench_protocol.py's round trips
    python benchmarks/bench_scale.py --part cluster       # the grid on an emulated cluster (root)
    python benchmarks/bench_scale.py --part report        # tables and figure from the JSON
    python benchmarks/bench_scale.py --part grid --sizes lenet --workers 2,4 --servers 1,2

Parts (every ratio is measured in the same run as its baseline):

``aggregation``: the server's aggregation path (``psparse.aggregation.Aggregator.mean``, i.e.
``kernels.sparse_mean``: scatter-add of N pushes into the dense scratch, sorted union, mean at
the union, scratch zeroed) for N pushes of k entries each (half of every push shared by all
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
reused. Results: ``benchmarks/bench_scale.json``, figure ``benchmarks/bench_scale.png``.

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
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
from common import interleaved_medians  # noqa: E402

from psparse.aggregation import Aggregator  # noqa: E402
from psparse.transport import parse_rate  # noqa: E402

RESULTS = HERE / "bench_scale.json"
FIGURE = HERE / "bench_scale.png"

# aggregation part: (label, numel, density), N pushes each
AGG_CASES = [("LeNet-5", 61_706, 0.01), ("11.2M", 11_200_000, 0.01),
             ("25M", 25_000_000, 0.001)]
AGG_WORKERS = (2, 8, 16)

# grid part
SIZES = {
    "lenet": ["--model", "lenet", "--dataset", "mnist"],
    "synthetic-1M": ["--model", "synthetic", "--model-arg", "numel=1M", "--dataset", "digits"],
}
POLICIES = {
    "topk": ["--policy", "topk"],
    "core": ["--policy", "core"],
    "core-private1": ["--policy", "core", "--policy-arg", "private=1"],
}
POLICY_MIN_WORKERS = {"core-private1": 8}  # private=1 is the large-N variant (docs/policies.md)
WORKERS = (2, 4, 8, 16)
SERVERS = (1, 2, 4)
ITERATIONS = 30
WARMUP = 5
BANDWIDTH = "100Mbit"
DENSITY = "0.01"


# ---------------------------------------------------------------------------- aggregation

def pushes(rng, numel: int, k: int, n: int):
    shared = rng.choice(numel, k // 2, replace=False)
    idx = []
    for _ in range(n):
        own = rng.choice(numel, k, replace=False)
        own = own[~np.isin(own, shared)][: k - k // 2]
        idx.append(np.sort(np.concatenate([shared, own])).astype(np.int32))
    return idx, [rng.standard_normal(i.size).astype(np.float32) for i in idx]


def aggregation_part(cases=AGG_CASES, workers=AGG_WORKERS, repeats: int | None = None) -> list:
    rng = np.random.default_rng(0)
    rows = []
    for label, numel, density in cases:
        k = max(1, round(numel * density))
        agg = Aggregator(numel)
        for n in workers:
            idx, val = pushes(rng, numel, k, n)
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
    return md_table(body, ["model", "k", "N", "union", "pushed MB", "aggregate ms",
                           "memcpy ms", "aggregated M entries/s", "memcpy M entries/s",
                           "aggregate / memcpy throughput"])


# ---------------------------------------------------------------------------- grid

def plan(sizes=SIZES, policies=POLICIES, workers=WORKERS, servers=SERVERS) -> list[dict]:
    """Every grid configuration, small N first (a stopped sweep has all the small ones)."""
    out = []
    for n in workers:
        for size in sizes:
            for policy in policies:
                if n < POLICY_MIN_WORKERS.get(policy, 0):
                    continue
                for s in servers:
                    out.append({"size": size, "policy": policy, "workers": n, "servers": s})
    return out


def launch_args(cfg: dict, iterations: int, bandwidth: str | None) -> list[str]:
    args = ["--workers", str(cfg["workers"]), "--servers", str(cfg["servers"]),
            *SIZES[cfg["size"]], "--density", DENSITY, "--iterations", str(iterations),
            "--eval-every", "0", "--seed", "0", *POLICIES[cfg["policy"]]]
    if bandwidth:
        args += ["--bandwidth", bandwidth]
    return args


def run_config(cfg: dict, runs: Path, iterations: int = ITERATIONS,
               bandwidth: str | None = BANDWIDTH, warmup: int = WARMUP) -> dict:
    """One launch (reused if RUN_DIR holds a finished run of the same arguments) and its
    per-shard figures."""
    name = f"{cfg['size']}-{cfg['policy']}-n{cfg['workers']}-s{cfg['servers']}"
    run_dir = runs / name
    args = launch_args(cfg, iterations, bandwidth)
    stamp = run_dir / "bench_args.json"
    done = (stamp.exists() and json.loads(stamp.read_text()) == args
            and (run_dir / "summary.json").exists()
            and json.loads((run_dir / "summary.json").read_text()).get("status") == "ok")
    if not done:
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        t = time.time()
        proc = subprocess.run([sys.executable, "-m", "psparse.launch", "--quiet",
                               "--out", str(run_dir), *args], cwd=ROOT,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            return {**cfg, "run": name, "failed": (proc.stderr or proc.stdout)[-400:]}
        stamp.write_text(json.dumps(args))
        print(f"  {name}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    return {**cfg, "run": name, **measure(run_dir, cfg["servers"], warmup)}


def measure(run_dir: Path, servers: int, warmup: int = WARMUP) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    per_shard = np.zeros((len(records), servers))
    for i, r in enumerate(records):
        shards = r.get("shards") or [{"upload_bytes": r["upload_bytes"],
                                      "broadcast_bytes": r["broadcast_bytes"]}]
        if len(shards) != servers:
            raise ValueError(f"{run_dir}: iteration {r['iter']} has {len(shards)} shards")
        up = sum(s["upload_bytes"] for s in shards)
        down = sum(s["broadcast_bytes"] for s in shards)
        if (up, down) != (r["upload_bytes"], r["broadcast_bytes"]):
            raise ValueError(f"{run_dir}: iteration {r['iter']}: shard bytes do not sum to "
                             f"the totals")
        per_shard[i] = [s["upload_bytes"] + s["broadcast_bytes"] for s in shards]
    link = per_shard.mean(axis=0)  # bytes per iteration on each shard's link
    times = [r["time_s"] for r in records]
    w = min(warmup, len(times) - 2)
    return {"numel": summary["numel"], "k": summary["k"], "iterations": len(records),
            "union_k": summary["union_over_k_mean"],
            "shard_link_b": link.tolist(), "total_b": float(per_shard.sum(axis=1).mean()),
            "upload_b": float(np.mean([r["upload_bytes"] for r in records])),
            "broadcast_b": float(np.mean([r["broadcast_bytes"] for r in records])),
            "server_max_b": float(link.max()), "server_mean_b": float(link.mean()),
            "ms_per_iter": 1e3 * (times[-1] - times[w]) / (len(times) - 1 - w),
            "code": config.get("provenance", {}).get("code_id")}


NETNS = ROOT / "launch" / "netns.sh"
NSRSH = ROOT / "launch" / "nsrsh.sh"
CLUSTER_RATE = "25mbit"
CLUSTER = "psbs"  # namespaces psbs-h0 .. psbs-h<N+S-1>, psbs-sw


def cluster_config(cfg: dict, runs: Path, rate: str, iterations: int = ITERATIONS,
                   cpus: str = "2", warmup: int = WARMUP) -> dict:
    """One configuration on an emulated cluster (launch/netns.sh cluster, root): S + N hosts,
    shard I on host hI, worker r on host h(S + r), every link shaped at ``rate``, each host a
    CPU share of ``cpus`` / (S + N) cores pinned to one CPU; no --bandwidth pacing (the links
    are real). The cluster is built for this run and taken down after it."""
    n, s = cfg["workers"], cfg["servers"]
    name = f"cluster-{rate}-{cfg['size']}-{cfg['policy']}-n{n}-s{s}"
    run_dir = runs / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    subprocess.run(["bash", str(NETNS), "down", CLUSTER], capture_output=True)
    try:
        addrs = subprocess.run(["bash", str(NETNS), "cluster", CLUSTER, str(n + s), rate],
                               capture_output=True, text=True, check=True,
                               env={**os.environ, "PSNET_CPUS": cpus}).stdout.split()
        # the hosts go by their addresses (workers reach shard I at --server-hosts' name), and
        # this remote shell enters the namespace that holds the address
        rsh = run_dir / "rsh.sh"
        rsh.write_text("#!/bin/bash\nhost=$1; shift\n"
                       f"exec bash {NSRSH} {CLUSTER}-h$(( ${{host##*.}} - 1 )) \"$@\"\n")
        (run_dir / "hostfile").write_text("".join(f"{a} slots=1\n" for a in addrs[s:s + n]))
        launch = [sys.executable, "-m", "psparse.launch", "--quiet", "--out", str(run_dir),
                  "--hostfile", str(run_dir / "hostfile"), "--rsh", f"bash {rsh}",
                  "--server-hosts", ",".join(addrs[:s]), "--server-host", addrs[0],
                  "--port", "5555", *launch_args(cfg, iterations, None)]
        t = time.time()
        proc = subprocess.run(["bash", str(NSRSH), f"{CLUSTER}-h0",
                               f"cd {ROOT} && exec " + " ".join(map(shlex.quote, launch))],
                              cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            return {**cfg, "run": name, "failed": (proc.stderr or proc.stdout)[-400:]}
        print(f"  {name}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    finally:
        subprocess.run(["bash", str(NETNS), "down", CLUSTER], capture_output=True)
    return {**cfg, "run": name, "rate": rate, "cpus": cpus, **measure(run_dir, s, warmup)}


def grid_part(configs: list[dict], runs: Path, **kw) -> list:
    rows = []
    for i, cfg in enumerate(configs):
        print(f"[{i + 1}/{len(configs)}] {cfg}", file=sys.stderr, flush=True)
        rows.append(run_config(cfg, runs, **kw))
    return rows


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
    text = md_table(body, ["model", "policy", "N", "S", "union/k", "all shards KB/iter",
                           "busiest server link KB/iter", "mean server link KB/iter",
                           "busiest / S=1"]
                    + ([f"busiest link ms/iter at {bandwidth}"] if rate else [])
                    + ["ms/iter", "speed-up vs S=1"])
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
    return md_table(body, ["model", "policy", "N", "union/k", f"busiest link KB/iter, S = {s}",
                           f"mean link KB/iter, S = {s}", f"busiest / S=1, S = {s}"]
                    + ([f"busiest link ms/iter at {bandwidth}, S = {s}"] if rate else [])
                    + [f"measured ms/iter, S = {s}"])


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
    return md_table(body, ["model", "policy", "S", "N fitted", "busiest link ~ N^a",
                           "mean link ~ N^a", "ms/iter ~ N^a"])


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

def md_table(body: list, header: list) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in body]
    return "\n".join(lines)


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
