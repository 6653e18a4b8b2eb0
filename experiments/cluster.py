"""psparse against DDP and DDP + PowerSGD on an emulated cluster with one shaped link per host.

    python -m experiments.cluster                 # make exp-cluster: every model and rate
    python -m experiments.cluster --only lenet --rates 25mbit --runs topk,ddp

For each model and link rate, ``launch/netns.sh cluster`` builds 9 hosts (h0: the server's
host, h1..h8: one worker each), each a network namespace with one veth link to a bridge, shaped
in both directions with tc tbf at the rate, and a CPU share of --cpus / 9 cores (default 1.5 of
this machine's 2: 1/6 core per host; cgroup cpu quota: the hosts compute side by side, as
separate machines would, not one after another; the other 0.5 core is left to everything else,
which should be capped there, see experiments/README.md section 6). Every run is ``psparse-launch --hostfile`` started inside h0 with
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
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from psparse.costmodel import WIRE_OVERHEAD, Setting, powersgd_sizes, predict
from psparse.provenance import provenance
from psparse.transport import parse_rate

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
NETNS = ROOT / "launch" / "netns.sh"
NSRSH = ROOT / "launch" / "nsrsh.sh"
CLUSTER = "psx"  # namespaces psx-h0 .. psx-h8, psx-sw
WORKERS = 8

PSPARSE_RUNS = {
    "topk": ["--density", "0.01", "--policy", "topk"],
    "core": ["--density", "0.01", "--policy", "core"],
    "vote": ["--density", "0.01", "--policy", "vote", "--policy-arg", "keep=1.5"],
    "topk-limit2k": ["--density", "0.01", "--policy", "topk", "--server-limit", "2k"],
}
PEER_RUNS = {
    "ddp": ["--baseline", "ddp", "--density", "1"],
    "powersgd-r1": ["--baseline", "powersgd", "--powersgd-rank", "1", "--density", "1"],
    "powersgd-r4": ["--baseline", "powersgd", "--powersgd-rank", "4", "--density", "1"],
}
RUNS = {**PSPARSE_RUNS, **PEER_RUNS}

# Sized for ~90 minutes of this 2-core machine (experiments/README.md, section 6), on hosts of
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


def sh(*cmd: str, check: bool = True) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=check).stdout


def cluster_up(rate: str, hosts: int, cpus: float = HOST_CPUS, pin: bool = True) -> list[str]:
    sh("bash", str(NETNS), "down", CLUSTER, check=False)
    return subprocess.run(["bash", str(NETNS), "cluster", CLUSTER, str(hosts), rate],
                          capture_output=True, text=True, check=True,
                          env={**os.environ, "PSNET_CPUS": str(cpus),
                               "PSNET_PIN": "1" if pin else "0"}).stdout.split()


def cluster_down() -> None:
    sh("bash", str(NETNS), "down", CLUSTER, check=False)


def cpu_quota(hosts: int, quota_us: int | None) -> None:
    """Set every host's CPU share (cgroup cpu quota per 10 ms period); None: unlimited."""
    for i in range(hosts):
        path = Path(f"/sys/fs/cgroup/cpu/psparse-{CLUSTER}-h{i}/cpu.cfs_quota_us")
        if path.parent.is_dir():
            path.write_text(str(quota_us if quota_us is not None else -1))


def quota_when_training(out: Path, hosts: int, quota_us: int, done: threading.Event) -> None:
    """Start-up (8 torch imports, data loading) runs unthrottled: at 2/9 of a core each it
    takes minutes and is not part of any measured time. The CPU shares apply from the moment
    training starts: the psparse server has every worker registered, or DDP's rank 0 wrote its
    first iteration."""
    log = out / "logs" / "server.log"
    while not done.is_set():
        if (log.is_file() and "workers registered" in log.read_text(errors="replace")) or \
                ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size):
            cpu_quota(hosts, quota_us)
            return
        time.sleep(0.05)


def link_counters(hosts: int) -> dict[str, list[int]]:
    """host -> [rx bytes, tx bytes] of its eth0 (what its link carried, headers included)."""
    out = {}
    for i in range(hosts):
        info = json.loads(sh("ip", "-n", f"{CLUSTER}-h{i}", "-s", "-j", "link", "show",
                             "eth0"))[0]["stats64"]
        out[f"h{i}"] = [info["rx"]["bytes"], info["tx"]["bytes"]]
    return out


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
    return {pid: ["launcher" if m == "psparse.launch" and ppid not in launchers else
                  "server" if m == "psparse.launch" else "worker", cpu]
            for pid, (m, ppid, cpu) in found.items()}


def sample_cpu(out: Path, done: threading.Event, period: float = 0.25) -> None:
    """CPU time of every process of the run, with the iteration count, to cpu-samples.jsonl
    (for the cost model's CPU terms: the server's CPU per round, the workers' per iteration)."""
    with open(out / "cpu-samples.jsonl", "w") as f:
        while not done.is_set():
            metrics = out / "metrics.jsonl"
            iters = metrics.read_bytes().count(b"\n") if metrics.is_file() else 0
            f.write(json.dumps({"t": time.time(), "iters": iters, "procs": _proc_cpu(out)})
                    + "\n")
            f.flush()
            done.wait(period)


def cpu_per_iteration(samples: list[dict], iterations: int, eval_every: int) -> dict | None:
    """Server and worker CPU milliseconds per iteration from cpu-samples.jsonl, over stretches
    between evaluations (an evaluation stops the round on rank 0, not part of an iteration)."""
    server = worker = 0.0
    its, per_worker = 0, {}
    for lo in range(1, iterations, eval_every):
        hi = min(lo + eval_every - 3, iterations - 2)
        inside = [x for x in samples if lo <= x["iters"] <= hi]
        if len(inside) < 2 or inside[-1]["iters"] == inside[0]["iters"]:
            continue
        a, b = inside[0]["procs"], inside[-1]["procs"]
        for pid, (role, cpu) in b.items():
            if pid in a:
                d = cpu - a[pid][1]
                if role == "server":
                    server += d
                elif role == "worker":
                    per_worker[pid] = per_worker.get(pid, 0.0) + d
        its += inside[-1]["iters"] - inside[0]["iters"]
    if not its:
        return None
    worker = [1e3 * v / its for v in per_worker.values()]
    return {"iterations": its, "server_ms": 1e3 * server / its,
            "worker_ms_mean": statistics.mean(worker) if worker else None,
            "worker_ms_max": max(worker) if worker else None}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] \
        if path.is_file() else []


def reusable(out: Path, identity: dict, code_id: str | None, reuse_any: bool) -> bool:
    """A finished run with these arguments, made by this code (or any code with reuse_any)."""
    if not ((out / "summary.json").is_file() and (out / "command.json").is_file()
            and json.loads((out / "command.json").read_text()) == identity):
        return False
    made_by = json.loads((out / "config.json").read_text()).get("provenance", {})
    if reuse_any or (code_id is not None and made_by.get("code_id") == code_id):
        return True
    print(f"[cluster] {out}: the finished run was made by other code "
          f"({made_by.get('code_id')}, now {code_id}); running it again (--reuse-any keeps it)",
          flush=True)
    return False


def run_dir(model: str, rate: str, name: str, seed: int) -> Path:
    return ROOT / "runs" / "cluster" / f"{model}-{rate}" / f"{name}-s{seed}"


def run_one(model: str, rate: str, name: str, addrs: list[str], code_id: str,
            reuse_any: bool, data_dir: str | None, seed: int = 0) -> Path:
    out = run_dir(model, rate, name, seed)
    args = MODELS[model]["base"] + RUNS[name] + ["--seed", str(seed)]
    if data_dir:
        args += ["--data-dir", data_dir]
    # the hosts' CPU: share and pinning (netns.sh pins each host to one CPU; PSNET_PIN=0 not)
    cpuset = Path(f"/sys/fs/cgroup/cpuset/psparse-{CLUSTER}-h1/cpuset.cpus")
    identity = {"args": args, "rate": rate,
                "cpu_share": int(Path(f"/sys/fs/cgroup/cpu/psparse-{CLUSTER}-h0/"
                                      "cpu.cfs_quota_us").read_text()) / 10000,
                "pinned": cpuset.is_file() and bool(cpuset.read_text().strip())}
    if reusable(out, identity, code_id, reuse_any):
        return out
    out.mkdir(parents=True, exist_ok=True)
    hostfile = out / "hostfile"
    hostfile.write_text("".join(f"{CLUSTER}-h{i} slots=1\n" for i in range(1, WORKERS + 1)))
    launch = [sys.executable, "-m", "psparse.launch", "--out", str(out), "--quiet",
              "--hostfile", str(hostfile), "--rsh", f"bash {NSRSH}", "--server-host", addrs[0],
              "--bind", addrs[0], "--port", "5555", "--master-addr", addrs[1], *args]
    before = link_counters(WORKERS + 1)
    t = time.perf_counter()
    print(f"[cluster] {model} {rate} {name} seed {seed} ...", flush=True)
    for stale in ("metrics.jsonl", "logs/server.log"):
        (out / stale).unlink(missing_ok=True)
    quota = int(Path(f"/sys/fs/cgroup/cpu/psparse-{CLUSTER}-h0/cpu.cfs_quota_us").read_text())
    cpu_quota(WORKERS + 1, None)
    done = threading.Event()
    watcher = threading.Thread(target=quota_when_training,
                               args=(out, WORKERS + 1, quota, done), daemon=True)
    watcher.start()
    sampler = threading.Thread(target=sample_cpu, args=(out, done), daemon=True)
    sampler.start()
    # the launcher (and the psparse server it forks) runs on h0, in h0's namespace and CPU share
    try:
        r = subprocess.run(["bash", str(NSRSH), f"{CLUSTER}-h0",
                            f"cd {shlex.quote(str(ROOT))} && exec {shlex.join(launch)}"],
                           cwd=ROOT)
    finally:
        done.set()
        sampler.join()
        cpu_quota(WORKERS + 1, quota)
    after = link_counters(WORKERS + 1)
    (out / "links.json").write_text(json.dumps(
        {**{h: {"rx_bytes": after[h][0] - before[h][0], "tx_bytes": after[h][1] - before[h][1]}
            for h in after}, "cpu_share": quota / 10000, "pinned": identity["pinned"]},
        indent=1))
    (out / "command.json").write_text(json.dumps(identity))
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


def probe_allreduce(addrs: list[str], entries: int, reps: int = 100) -> float:
    """Seconds per gloo allreduce of `entries` float32 among the 8 worker hosts, each in its
    namespace and CPU share (a separate measurement, not from the sweep's runs): with one
    entry, 2 (N - 1) dependent ring steps of nothing but wake-up, syscalls and latency."""
    procs = []
    for r in range(WORKERS):
        env = (f"MASTER_ADDR={addrs[1]} MASTER_PORT=29533 OMP_NUM_THREADS=1 "
               f"{shlex.quote(sys.executable)} -c {shlex.quote(STEP_PROBE)} "
               f"{r} {WORKERS} {entries} {reps}")
        procs.append(subprocess.Popen(["bash", str(NSRSH), f"{CLUSTER}-h{r + 1}", env],
                                      stdout=subprocess.PIPE, text=True, cwd=ROOT))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    return float(outs[0].strip().splitlines()[-1])


def numel_and_shapes(model: str) -> tuple[int, list[tuple[int, ...]]]:
    from psparse.data import IN_SHAPES
    from psparse.models import build_model

    dataset = "mnist" if model == "lenet" else "cifar10"
    net = build_model(model, IN_SHAPES[dataset], 10)
    shapes = [tuple(p.shape) for p in net.parameters() if p.requires_grad]
    return sum(p.numel() for p in net.parameters() if p.requires_grad), shapes


def measure(out: Path, name: str, rate: str, targets: list[float], shapes) -> dict:
    """One table row: time split, link bytes, time to each target accuracy (the first is the
    headline), accuracy, model prediction."""
    summary = json.loads((out / "summary.json").read_text()) \
        if (out / "summary.json").is_file() else {"status": "no summary"}
    row = {"run": name, "rate": rate, "dir": str(out.relative_to(ROOT))}
    if summary.get("status") != "ok":
        row["failed"] = summary.get("error") or summary["status"]
        return row
    config = json.loads((out / "config.json").read_text())
    metrics, evals = _jsonl(out / "metrics.jsonl"), _jsonl(out / "eval.jsonl")
    iters = len(metrics)
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(WORKERS)]
    # rank 0 also evaluates (in its compute time): the others show the training iteration
    others = ranks[1:]
    split = {k: 1e3 * statistics.mean(r[k] for r in others) / iters
             for k in ("compute_s", "select_s", "wait_s")}
    if config.get("baseline"):
        # DDP and PowerSGD: rank 0's median iteration (metrics.jsonl has its split). The other
        # ranks' totals hold rank 0's evaluation stalls when the model has BatchNorm
        # (ResNet-20): DDP broadcasts its buffers at every forward, so ranks 1-7 wait in
        # forward, which the split counts as compute (1.6 s mean against a 1.0 s median).
        split = {k: 1e3 * statistics.median(m[k] for m in metrics[2:])
                 for k in ("compute_s", "select_s", "wait_s")}
    steps = [b["time_s"] - a["time_s"] for a, b in zip(metrics, metrics[1:])]
    median_ms = 1e3 * statistics.median(steps)
    # rank 0's evaluations stop every round (4-6 s each on a 2/9-core host, longer in DDP,
    # whose waiting ranks poll): the training time at each evaluation, those stalls taken out
    stalls, train_times = 0.0, []
    for e in evals:
        i = min(e["iter"], iters - 1)
        train_times.append(metrics[i]["time_s"] - stalls)
        if i + 1 < iters:
            stalls += max(0.0, steps[i] - statistics.median(steps))
    links = json.loads((out / "links.json").read_text())
    worker_links = [links[f"h{i}"] for i in range(1, WORKERS + 1)]
    row.update(
        code_id=config.get("provenance", {}).get("code_id"), iterations=iters,
        ms_per_iteration=1e3 * summary["wall_s"] / iters, median_ms=median_ms,
        compute_ms=split["compute_s"], select_ms=split["select_s"], wait_ms=split["wait_s"],
        server_link_mb={k: links["h0"][k] / 1e6 for k in ("rx_bytes", "tx_bytes")},
        worker_link_mb={k: statistics.mean(w[k] for w in worker_links) / 1e6
                        for k in ("rx_bytes", "tx_bytes")},
        test_acc=summary["test_acc"], best_acc=max(e["test_acc"] for e in evals),
        target_acc=targets[0],
        to_target={f"{t:g}": {
            "time_to_target_s": next((e["time_s"] for e in evals if e["test_acc"] >= t), None),
            "train_time_to_target_s": next((x for x, e in zip(train_times, evals)
                                            if e["test_acc"] >= t), None)} for t in targets},
        evals=[[e["time_s"], e["test_acc"]] for e in evals])
    # psparse-model: the run's own compute (and selection) time, the scheme's bytes at the rate;
    # "link only" (the model before issue 15's check) against the model with the exchange's CPU
    # on the hosts' CPU shares and the slowest host's compute
    share = links.get("cpu_share", (os.cpu_count() or 1) / (WORKERS + 1))
    # a two-phase policy (vote) counts its proposal round trip as selection time: that is
    # exchange, which the model predicts (its bytes and server CPU are in the round's), so only
    # compute is given (the local proposal's top-k, ~3 ms, goes with it)
    local = ("compute_s",) if any(m.get("proposed") is not None for m in metrics) \
        else ("compute_s", "select_s")
    compute = sum(split[k] for k in local) / 1e3
    slowest = max(sum(r[k] for k in local) for r in others) / iters
    if config.get("baseline"):  # no per-rank iterations: rank 0's median split (above)
        slowest = compute
    s = Setting(numel=summary["numel"], k=summary["k"], workers=WORKERS, union=1.0,
                compute_s=compute)
    samples = _jsonl(out / "cpu-samples.jsonl")
    cpu = cpu_per_iteration(samples, iters, config.get("eval_every") or iters) \
        if samples else None
    baseline = config.get("baseline")
    if baseline == "powersgd":
        s.powersgd_entries = sum(powersgd_sizes(shapes, config["powersgd_rank"]))
        scheme = "PowerSGD"
    elif baseline == "ddp":
        scheme = "dense ring allreduce"
    else:
        s.up_bytes = statistics.mean(m["upload_bytes"] for m in metrics)
        s.down_bytes = statistics.mean(m["broadcast_bytes"] for m in metrics)
        s.k = statistics.mean(m["budget"] for m in metrics)
        s.union = statistics.mean(m["broadcast_entries"] for m in metrics)
        scheme = "sparse PS"
    pred = predict(s, parse_rate(rate), wire_overhead=WIRE_OVERHEAD)
    row.update(scheme=scheme, link_only_ms=1e3 * pred[scheme],
               link_only_error=pred[scheme] / (median_ms / 1e3) - 1)
    if cpu is not None:
        s.compute_s = slowest
        s.cpu_share = share
        s.server_cpu_s = cpu["server_ms"] / 1e3
        # a worker's exchange CPU: its CPU per iteration less what its compute and selection
        # used (throttled to the share throughout, as the CPU counters show)
        s.worker_comm_cpu_s = max(0.0, cpu["worker_ms_mean"] / 1e3 - share * compute)
        # the per-step latency on the CPU shares, from the tiny-allreduce probe (--probe-steps)
        probe = RESULTS / "cluster-step-probe.json"
        step = json.loads(probe.read_text())["per_ring_step_s"] if probe.is_file() else 0.0
        pred = predict(s, parse_rate(rate), latency_s=step, wire_overhead=WIRE_OVERHEAD)
        row.update(cpu_share=share, step_latency_ms=1e3 * step, server_cpu_ms=cpu["server_ms"],
                   worker_cpu_ms=cpu["worker_ms_mean"],
                   worker_comm_cpu_ms=1e3 * s.worker_comm_cpu_s,
                   slowest_compute_ms=1e3 * slowest, predicted_ms=1e3 * pred[scheme],
                   model_error=pred[scheme] / (median_ms / 1e3) - 1)
    row.update(row["to_target"][f"{targets[0]:g}"])
    return row


def table(model: str, rows: list[dict], commit: str) -> str:
    target, second = MODELS[model]["targets"][:2]
    lines = [f"Commit `{commit}`. Wall times from the first iteration (start-up excluded); ms per "
             "iteration: mean over the run (evaluations included: rank 0's evaluation stops "
             "every round) and median iteration; the split is the mean per iteration over ranks "
             "1-7 for psparse (rank 0 also evaluates; a two-phase policy's proposal round "
             "counts as select) and rank 0's median iteration for DDP and PowerSGD (their other "
             "ranks wait for rank 0's evaluations inside forward when the model has BatchNorm; "
             "select: the comm hook's synchronous part). Link MB: what the host's eth0 "
             "received / sent over the run, headers included. CPU: CPU ms per iteration between evaluations, the PS server's and a "
             "worker's for its exchange (its CPU less its compute's). Models against the "
             "median iteration: link only (compute + bytes / rate) and with the CPU terms "
             "(psparse/costmodel.py).", "",
             f"| rate | run | ms/it mean | ms/it median | compute | select | wait | server link "
             f"MB in/out | worker link MB in/out | s to {100 * target:g}% | s to {100 * target:g}% "
             f"net of evaluations | s to {100 * second:g}% net | final acc % | "
             "server CPU ms | worker exch. CPU ms | model link only | error | model with CPU "
             "| error |", "|" + "---|" * 19]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['rate']} | {r['run']} | failed: {str(r['failed'])[:80]} |"
                         + " |" * 15)
            continue
        tt = f"{r['time_to_target_s']:.1f} | {r['train_time_to_target_s']:.1f}" \
            if r["time_to_target_s"] is not None else "not reached | not reached"
        t2 = r["to_target"][f"{second:g}"]["train_time_to_target_s"]
        tt += f" | {t2:.1f}" if t2 is not None else " | not reached"
        cpu = (f"{r['server_cpu_ms']:.1f} | {r['worker_comm_cpu_ms']:.1f} | "
               f"{r['link_only_ms']:.1f} | {r['link_only_error']:+.1%} | "
               f"{r['predicted_ms']:.1f} | {r['model_error']:+.1%}") if "model_error" in r \
            else f"- | - | {r['link_only_ms']:.1f} | {r['link_only_error']:+.1%} | - | -"
        lines.append(
            f"| {r['rate']} | {r['run']} | {r['ms_per_iteration']:.1f} | {r['median_ms']:.1f} | "
            f"{r['compute_ms']:.1f} | {r['select_ms']:.1f} | {r['wait_ms']:.1f} | "
            f"{r['server_link_mb']['rx_bytes']:.1f} / {r['server_link_mb']['tx_bytes']:.1f} | "
            f"{r['worker_link_mb']['rx_bytes']:.1f} / {r['worker_link_mb']['tx_bytes']:.1f} | "
            f"{tt} | {100 * r['test_acc']:.2f} | {cpu} |")
    return "\n".join(lines)


def ratios(rows: list[dict], target: float, key: str = "train_time_to_target_s") -> list[str]:
    """Per rate: time to target of psparse's best policy over DDP's and PowerSGD's best."""
    notes = []
    at = lambda r: r["to_target"][f"{target:g}"][key]  # noqa: E731
    for rate in dict.fromkeys(r["rate"] for r in rows):
        ok = [r for r in rows if r["rate"] == rate and "failed" not in r and at(r) is not None]
        best = lambda names: min((r for r in ok if r["run"] in names),  # noqa: E731
                                 key=at, default=None)
        ps, ddp = best(PSPARSE_RUNS), best(["ddp"])
        psgd = best([n for n in PEER_RUNS if n.startswith("powersgd")])
        label = (f"to {100 * target:g}%, "
                 + ("net of evaluations" if key == "train_time_to_target_s" else "wall"))
        if ps is None:
            notes.append(f"{rate} ({label}): no psparse run reached the target")
            continue
        parts = [f"{rate} ({label}): best psparse `{ps['run']}` {at(ps):.1f} s"]
        for name, ref in (("DDP", ddp), ("PowerSGD", psgd)):
            parts.append(f"/ {name} ({ref['run']}, {at(ref):.1f} s) = {at(ps) / at(ref):.2f}"
                         if ref else f"/ {name}: target not reached")
        notes.append(" ".join(parts))
    return notes


def _mean_sd(values: list[float], fmt: str = ".1f") -> str:
    """mean ± sample SD (ddof 1) over the seeds, and how many; one value: just it."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:{fmt}} (1)"
    return f"{statistics.mean(values):{fmt}} ± {statistics.stdev(values):{fmt}} ({len(values)})"


def seed_summary(model: str, by_seed: dict[tuple[str, str], list[dict]]) -> str:
    """Runs made with several seeds: mean ± sample SD of the median iteration, the time to
    each target net of evaluations, the final accuracy; and, per seed, the time to target of
    each psparse run over DDP's and PowerSGD's with the same seed."""
    multi = {key: [r for r in rows if "failed" not in r] for key, rows in by_seed.items()
             if len(rows) > 1}
    if not multi:
        return ""
    targets = MODELS[model]["targets"]
    net = lambda r, t: r["to_target"][f"{t:g}"]["train_time_to_target_s"]  # noqa: E731
    lines = ["", "Over seeds (mean ± sample SD (runs)); times to target net of evaluations, "
             "over the runs that reached it:", "",
             "| rate | run | ms/it median | " + " | ".join(f"s to {100 * t:g}%" for t in targets)
             + " | final acc % |", "|" + "---|" * (4 + len(targets))]
    for (rate, name), rows in multi.items():
        cells = [_mean_sd([r["median_ms"] for r in rows])]
        for t in targets:
            got = [net(r, t) for r in rows if net(r, t) is not None]
            cells.append(_mean_sd(got) + (f", {len(rows) - len(got)} not reached"
                                          if len(got) < len(rows) else ""))
        cells.append(_mean_sd([100 * r["test_acc"] for r in rows], ".2f"))
        lines.append(f"| {rate} | {name} | " + " | ".join(cells) + " |")
    lines += ["", "Time to target, psparse run ÷ peer, per seed (same seed), mean ± sample SD:",
              ""]
    for t in targets:
        for rate in dict.fromkeys(rate for rate, _ in multi):
            for name in PSPARSE_RUNS:
                for peer in ("ddp", "powersgd-r1", "powersgd-r4"):
                    mine, theirs = multi.get((rate, name), []), multi.get((rate, peer), [])
                    peer_of = {r["seed"]: r for r in theirs}
                    q = [net(r, t) / net(peer_of[r["seed"]], t) for r in mine
                         if r["seed"] in peer_of and net(r, t) is not None
                         and net(peer_of[r["seed"]], t) is not None]
                    if len(q) > 1:
                        lines.append(f"- {rate}, to {100 * t:g}%: `{name}` ÷ `{peer}` = "
                                     f"{_mean_sd(q, '.2f')}")
    return "\n".join(lines) + "\n"


def figure(model: str, rate: str, rows: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, r in enumerate(x for x in rows if x["rate"] == rate and "failed" not in x):
        t, acc = zip(*r["evals"])
        ax.plot(t, [100 * a for a in acc], marker="o", ms=3, color=f"C{i}",
                ls="--" if r["run"] in PEER_RUNS else "-", label=r["run"])
    for t in MODELS[model]["targets"]:
        ax.axhline(100 * t, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("wall time since the first iteration (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"{model}, 8 workers, every host link {rate} (tbf)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = RESULTS / f"cluster-{model}-{rate}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


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
        addrs = cluster_up(rate, WORKERS + 1, args.cpus, not args.no_pin)
        try:
            per = probe_allreduce(addrs, 1)
        finally:
            cluster_down()
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
        _, shapes = numel_and_shapes(model)
        rates = args.rates.split(",") if args.rates else MODELS[model]["rates"]
        for rate in rates:
            if args.table_only:
                continue
            addrs = cluster_up(rate, WORKERS + 1, args.cpus, not args.no_pin)
            try:
                for seed in seeds:
                    for name in names:
                        run_one(model, rate, name, addrs, code_id, args.reuse_any,
                                args.data_dir, seed)
            finally:
                cluster_down()
        # the full table is seed 0's; runs made with more seeds get a summary over seeds
        rows, by_seed = [], {}
        for rate in MODELS[model]["rates"]:
            for name in RUNS:
                for seed in range(10):
                    out = run_dir(model, rate, name, seed)
                    if (out / "links.json").is_file():
                        row = measure(out, name, rate, MODELS[model]["targets"], shapes)
                        row["seed"] = seed
                        by_seed.setdefault((rate, name), []).append(row)
                        if seed == 0:
                            rows.append(row)
        if not rows:
            continue
        RESULTS.mkdir(parents=True, exist_ok=True)
        commits = sorted({r.get("code_id") or "?" for r in rows if "failed" not in r})
        text = table(model, rows, ", ".join(commits))
        notes = [n for t in MODELS[model]["targets"]
                 for n in ratios(rows, t) + ratios(rows, t, "time_to_target_s")]
        for key, label in (("link_only_error", "link only"), ("model_error", "with CPU")):
            errs = [r for r in rows if key in r]
            if errs:
                worst = max(errs, key=lambda r: abs(r[key]))
                notes.append(f"largest model error ({label}): {worst[key]:+.1%} "
                             f"({worst['rate']} {worst['run']})")
        text += "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
        text += seed_summary(model, by_seed)
        (RESULTS / f"cluster-{model}.md").write_text(text)
        (RESULTS / f"cluster-{model}.json").write_text(json.dumps(rows, indent=1))
        print(text)
        for rate in dict.fromkeys(r["rate"] for r in rows):
            print(f"wrote {figure(model, rate, rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
