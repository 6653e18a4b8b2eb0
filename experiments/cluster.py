"""psparse against DDP and DDP + PowerSGD on an emulated cluster with one shaped link per host.

    python -m experiments.cluster                 # make exp-cluster: every model and rate
    python -m experiments.cluster --only lenet --rates 25mbit --runs topk,ddp

For each model and link rate, ``launch/netns.sh cluster`` builds 9 hosts (h0: the server's
host, h1..h8: one worker each), each a network namespace with one veth link to a bridge, shaped
in both directions with tc tbf at the rate, and a CPU share of --cpus / 9 cores (default 1.5 of
this machine's 2: 1/6 core per host; cgroup cpu quota: the hosts compute side by side, as
separate machines would, not one after another; the other 0.5 core is left to everything else,
which should be capped there, see docs/notes/cluster-time-to-accuracy.md). Every run is ``psparse-launch --hostfile`` started inside h0 with
``--rsh launch/nsrsh.sh`` entering the workers' hosts: the real cluster path. The link byte
counters of every host (``ip -s link``) are read before and after each run.

Results: experiments/results/cluster-<model>.{md,json}, cluster-<model>-<rate>.png (test
accuracy against wall time), and the cost model's predictions (``psparse-model``'s formulas with
the run's own compute time and the link rate) against the measured time per iteration. A finished
run is reused only when it was made by the same code (config.json's provenance code_id) with
the same arguments, unless ``--reuse-any``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from experiments.cluster_report import report, run_dir
from experiments.cluster_sweep import HOST_CPUS, MODELS, RUNS, WORKERS
from experiments.harness import NSRSH, RESULTS, ROOT, EmulatedCluster, RunCache
from psparse.provenance import provenance

CLUSTER = "psx"  # namespaces psx-h0 .. psx-h8, psx-sw


def emulated_cluster(rate: str, cpus: float = HOST_CPUS, pin: bool = True) -> EmulatedCluster:
    """The sweep's 9 hosts: h0 the server's, h1 .. h8 one worker each."""
    return EmulatedCluster(CLUSTER, WORKERS + 1, rate, cpus, pin)


# When training starts, the same event for both: every worker is connected and the first
# iteration has not begun (psparse's server: every worker registered; DDP's rank 0: its process
# group and DDP wrapper are up). Both runs' clocks (metrics.jsonl's time_s) start there too.
# (server-0.log: shard 0 of --servers S, which logs the same line; before issue 54 found it, the
# sharded runs never got their CPU shares)
TRAINING_STARTS = {"server.log": "workers registered", "server-0.log": "workers registered",
                   "rank-0.log": "process group ready"}


def quota_when_training(out: Path, hosts: EmulatedCluster, quota_us: int,
                        done: threading.Event) -> None:
    """Start-up (8 torch imports, data loading) runs unthrottled: at 2/9 of a core each it
    takes minutes and is not part of any measured time. The CPU shares apply from the moment
    training starts (``TRAINING_STARTS``), for psparse and DDP at the same event, so both
    first iterations (the cold start, reported apart) run on the hosts' shares. (Before issue
    38 DDP's quota waited for its first iteration, which so ran on whole cores.)"""
    logs = out / "logs"
    while not done.is_set():
        for name, marker in TRAINING_STARTS.items():
            log = logs / name
            if log.is_file() and marker in log.read_text(errors="replace"):
                hosts.set_cpu_quota(quota_us)
                return
        time.sleep(0.05)


def _proc_cpu(out: Path) -> dict[int, list]:
    """pid -> [role, CPU seconds (user + system)] of the run's processes: "server" (the
    launcher's forked psparse server), "launcher", or "worker" (psparse workers, DDP ranks)."""
    hz = os.sysconf("SC_CLK_TCK")
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if str(out).encode() not in args:
                continue
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        module = args[2].decode() if len(args) > 2 else ""
        found[int(pid)] = [module, int(stat[1]), (int(stat[11]) + int(stat[12])) / hz]
    launchers = {pid for pid, (m, _, _) in found.items() if m == "psparse.launch"}
    # a server forked by the launcher runs as psparse.launch; one started on another host
    # (--server-hosts: a shard beside a worker) as psparse.server
    return {pid: ["launcher" if m == "psparse.launch" and ppid not in launchers else
                  "server" if m in ("psparse.launch", "psparse.server") else "worker", cpu]
            for pid, (m, ppid, cpu) in found.items()}


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of a process's threads, user and system apart, in three groups: its main
    thread (decoding, aggregating, encoding), ZeroMQ's I/O thread (the sockets' TCP work) and
    the rest ({} once the process is gone)."""
    hz = os.sysconf("SC_CLK_TCK")
    split: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return split
    for tid in tids:
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        group = "main" if tid == str(pid) else "io" if comm.startswith("ZMQbg/IO") else "other"
        for kind, field in (("user", 11), ("system", 12)):
            key = f"{group}_{kind}"
            split[key] = split.get(key, 0.0) + int(stat[field]) / hz
    return split


def sample_cpu(out: Path, done: threading.Event, period: float = 0.25) -> None:
    """CPU time of every process of the run, with the iteration count, to cpu-samples.jsonl
    (for the cost model's CPU terms: the server's CPU per round, the workers' per iteration),
    and the server's by thread, user and system apart (``server_threads``)."""
    with open(out / "cpu-samples.jsonl", "w") as f:
        while not done.is_set():
            # a sharded run merges its metrics at the end: shard 0's count the iterations
            metrics = out / "metrics.jsonl"
            if not metrics.is_file():
                metrics = out / "shard-0" / "metrics.jsonl"
            iters = metrics.read_bytes().count(b"\n") if metrics.is_file() else 0
            procs = _proc_cpu(out)
            server = [int(pid) for pid, (role, _) in procs.items() if role == "server"]
            f.write(json.dumps({"t": time.time(), "iters": iters, "procs": procs,
                                "server_threads": _thread_cpu(server[0]) if server else {}})
                    + "\n")
            f.flush()
            done.wait(period)


def reusable(out: Path, identity: dict, code_id: str | None, reuse_any: bool) -> bool:
    """A finished run with these arguments, made by this code (or any code with reuse_any)."""
    cache = RunCache(out, identity)
    if not cache.finished():
        return False
    if reuse_any or (code_id is not None and cache.finished(code_id)):
        return True
    print(f"[cluster] {out}: the finished run was made by other code "
          f"({cache.dir.code_id()}, now {code_id}); running it again (--reuse-any keeps it)",
          flush=True)
    return False


def run_one(model: str, rate: str, name: str, hosts: EmulatedCluster, code_id: str,
            reuse_any: bool, data_dir: str | None, seed: int = 0,
            base: list[str] | None = None, run_args: list[str] | None = None) -> Path:
    """One cluster run of ``name`` on ``model`` with the sweep's base arguments (or ``base``:
    time_to_accuracy's ResNet-20 has its own schedule and precision) and the sweep's arguments
    of ``name`` (or ``run_args``: the transformer's runs are its own)."""
    out = run_dir(model, rate, name, seed)
    args = (MODELS[model]["base"] if base is None else base) + \
        (RUNS[name] if run_args is None else run_args) + ["--seed", str(seed)]
    if data_dir:
        args += ["--data-dir", data_dir]
    # the hosts' CPU: share and pinning (netns.sh pins each host to one CPU; PSNET_PIN=0 not)
    quota = hosts.cpu_quota_us()
    identity = {"args": args, "rate": rate, "cpu_share": quota / 10000,
                "pinned": hosts.pinned()}
    if reusable(out, identity, code_id, reuse_any):
        return out
    cache = RunCache(out, identity)
    cache.start(fresh=True)  # also no metrics or server log of an earlier run to mislead
    hostfile = out / "hostfile"
    hostfile.write_text("".join(f"{hosts.host(i)} slots=1\n" for i in range(1, WORKERS + 1)))
    addrs = hosts.addrs
    launch = [sys.executable, "-m", "psparse.launch", "--out", str(out), "--quiet",
              "--hostfile", str(hostfile), "--rsh", f"bash {NSRSH}", "--server-host", addrs[0],
              "--bind", addrs[0], "--port", "5555", "--master-addr", addrs[1], *args]
    before = hosts.link_counters()
    t = time.perf_counter()
    print(f"[cluster] {model} {rate} {name} seed {seed} ...", flush=True)
    hosts.set_cpu_quota(None)
    done = threading.Event()
    watcher = threading.Thread(target=quota_when_training, args=(out, hosts, quota, done),
                               daemon=True)
    watcher.start()
    sampler = threading.Thread(target=sample_cpu, args=(out, done), daemon=True)
    sampler.start()
    # the launcher (and the psparse server it forks) runs on h0, in h0's namespace and CPU share
    try:
        r = subprocess.run(hosts.launch_on(0, launch, ROOT), cwd=ROOT)
    finally:
        done.set()
        sampler.join()
        hosts.set_cpu_quota(quota)
    after = hosts.link_counters()
    (out / "links.json").write_text(json.dumps(
        {**{h: {"rx_bytes": after[h][0] - before[h][0], "tx_bytes": after[h][1] - before[h][1]}
            for h in after}, "cpu_share": quota / 10000, "pinned": identity["pinned"]},
        indent=1))
    cache.finish()
    print(f"[cluster] {model} {rate} {name} seed {seed} exit {r.returncode} in "
          f"{time.perf_counter() - t:.0f} s", flush=True)
    return out


STEP_PROBE = r"""
import os, sys, time, torch, torch.distributed as dist
rank, n, size, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo", rank=rank, world_size=n)
x = torch.zeros(size)
for _ in range(20):
    dist.all_reduce(x)
dist.barrier()
t = time.perf_counter()
for _ in range(reps):
    dist.all_reduce(x)
if rank == 0:
    print((time.perf_counter() - t) / reps)
dist.destroy_process_group()
"""


def probe_allreduce(hosts: EmulatedCluster, entries: int, reps: int = 100) -> float:
    """Seconds per gloo allreduce of `entries` float32 among the 8 worker hosts, each in its
    namespace and CPU share (a separate measurement, not from the sweep's runs): with one
    entry, 2 (N - 1) dependent ring steps of nothing but wake-up, syscalls and latency."""
    procs = []
    for r in range(WORKERS):
        env = (f"MASTER_ADDR={hosts.addrs[1]} MASTER_PORT=29533 OMP_NUM_THREADS=1 "
               f"{shlex.quote(sys.executable)} -c {shlex.quote(STEP_PROBE)} "
               f"{r} {WORKERS} {entries} {reps}")
        procs.append(subprocess.Popen(hosts.on(r + 1, env), stdout=subprocess.PIPE,
                                      text=True, cwd=ROOT))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    return float(outs[0].strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(MODELS), help="models: lenet,resnet20")
    p.add_argument("--rates", default=None, help="rates (default: each model's two)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"runs (default all: {','.join(RUNS)})")
    p.add_argument("--reuse-any", action="store_true",
                   help="reuse finished runs made by other code (default: only by this code)")
    p.add_argument("--data-dir", default=None, help="passed to psparse-launch")
    p.add_argument("--cpus", type=float, default=HOST_CPUS,
                   help="cores shared by the 9 hosts, 1/9 each (default %(default)s of this "
                        "machine's; leave the rest to everything else, capped in a cgroup)")
    p.add_argument("--seeds", default="0",
                   help="comma-separated seeds to run (default 0; the main table is seed 0's, "
                        "runs with more seeds also get a table over seeds)")
    p.add_argument("--no-pin", action="store_true",
                   help="do not pin each host to one CPU (the first sweeps' setting)")
    p.add_argument("--table-only", action="store_true", help="no runs: tables from runs/")
    p.add_argument("--probe-steps", action="store_true",
                   help="only measure the per-step cost of a tiny gloo allreduce on the "
                        "cluster's CPU shares (results/cluster-step-probe.json)")
    args = p.parse_args(argv)
    if args.probe_steps:
        rate = (args.rates or "80mbit").split(",")[0]
        with emulated_cluster(rate, args.cpus, not args.no_pin) as hosts:
            per = probe_allreduce(hosts, 1)
        result = {"rate": rate, "allreduce_1_entry_s": per,
                  "per_ring_step_s": per / (2 * (WORKERS - 1)), "workers": WORKERS}
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "cluster-step-probe.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result))
        return 0
    prov = provenance()
    code_id = prov["code_id"]
    names = args.runs.split(",")
    seeds = [int(x) for x in args.seeds.split(",")]
    for model in args.only.split(","):
        rates = args.rates.split(",") if args.rates else MODELS[model]["rates"]
        for rate in rates:
            if args.table_only:
                continue
            with emulated_cluster(rate, args.cpus, not args.no_pin) as hosts:
                for seed in seeds:
                    for name in names:
                        run_one(model, rate, name, hosts, code_id, args.reuse_any,
                                args.data_dir, seed)
        report(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
