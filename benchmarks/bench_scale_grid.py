"""The grid of benchmarks/bench_scale.py: which configurations it launches (N workers x S
server shards x model size x policy), each launch (on loopback, reused when finished, or on an
emulated cluster) and its per-shard figures. bench_scale.py's docstring says what is measured."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from experiments.harness import ROOT, EmulatedCluster, RunCache, RunDir

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
CLUSTER_RATE = "25mbit"
CLUSTER = "psbs"  # namespaces psbs-h0 .. psbs-h<N+S-1>, psbs-sw


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
    cache = RunCache(run_dir, args)  # a failed run is not marked ended: it is made again
    if not cache.finished():
        cache.start(fresh=True)
        t = time.time()
        proc = subprocess.run([sys.executable, "-m", "psparse.launch", "--quiet",
                               "--out", str(run_dir), *args], cwd=ROOT,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            return {**cfg, "run": name, "failed": (proc.stderr or proc.stdout)[-400:]}
        cache.finish()
        print(f"  {name}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    return {**cfg, "run": name, **measure(run_dir, cfg["servers"], warmup)}


def measure(run_dir: Path, servers: int, warmup: int = WARMUP) -> dict:
    run = RunDir(run_dir)
    records, summary = run.metrics(), run.summary()
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
            "code": run.code_id()}


def cluster_config(cfg: dict, runs: Path, rate: str, iterations: int = ITERATIONS,
                   cpus: str = "2", warmup: int = WARMUP) -> dict:
    """One configuration on an emulated cluster (launch/netns.sh cluster, root): S + N hosts,
    shard I on host hI, worker r on host h(S + r), every link shaped at ``rate``, each host a
    CPU share of ``cpus`` / (S + N) cores pinned to one CPU; no --bandwidth pacing (the links
    are real). The cluster is built for this run and taken down after it."""
    n, s = cfg["workers"], cfg["servers"]
    name = f"cluster-{rate}-{cfg['size']}-{cfg['policy']}-n{n}-s{s}"
    run_dir = runs / name
    shutil.rmtree(run_dir, ignore_errors=True)  # never reused: the cluster is built per run
    run_dir.mkdir(parents=True)
    with EmulatedCluster(CLUSTER, n + s, rate, cpus) as hosts:
        addrs = hosts.addrs
        # the hosts go by their addresses (workers reach shard I at --server-hosts' name), and
        # this remote shell enters the namespace that holds the address
        rsh = hosts.rsh_by_address(run_dir / "rsh.sh")
        (run_dir / "hostfile").write_text("".join(f"{a} slots=1\n" for a in addrs[s:s + n]))
        launch = [sys.executable, "-m", "psparse.launch", "--quiet", "--out", str(run_dir),
                  "--hostfile", str(run_dir / "hostfile"), "--rsh", f"bash {rsh}",
                  "--server-hosts", ",".join(addrs[:s]), "--server-host", addrs[0],
                  "--port", "5555", *launch_args(cfg, iterations, None)]
        t = time.time()
        proc = subprocess.run(hosts.launch_on(0, launch, ROOT), cwd=ROOT, capture_output=True,
                              text=True)
        if proc.returncode != 0:
            return {**cfg, "run": name, "failed": (proc.stderr or proc.stdout)[-400:]}
        print(f"  {name}: {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    return {**cfg, "run": name, "rate": rate, "cpus": cpus, **measure(run_dir, s, warmup)}


def grid_part(configs: list[dict], runs: Path, **kw) -> list:
    rows = []
    for i, cfg in enumerate(configs):
        print(f"[{i + 1}/{len(configs)}] {cfg}", file=sys.stderr, flush=True)
        rows.append(run_config(cfg, runs, **kw))
    return rows
