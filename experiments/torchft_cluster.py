"""Issue 55: torchft's own DiLoCo and LocalSGD timed on the emulated cluster, beside psparse's
allreduce peers of the same algorithms (``--baseline ddp --local-steps 16``).

    python -m experiments.torchft_cluster                     # 25 and 5 Mbit/s (root, ~5 min)
    python -m experiments.torchft_cluster --rates 80mbit --algorithms localsgd

experiments/local_steps.py times DiLoCo and local SGD as psparse's peers implement them over
torch.distributed (their arithmetic is torchft's: its ``torchft`` stage compares the two
evaluation by evaluation). A user of torchft runs more per synchronisation: every one asks the
lighthouse for a quorum, reconfigures gloo when the quorum changes, and commits. This stage
measures what that costs on the same cluster (at dac5361: nothing beyond the spread; torchft's
synchronisation took 0.77-0.96x the peers', docs/notes/local-steps.md): the lighthouse on h0 and one replica group per worker host
(experiments/diloco_peer.py ``--rank R``: LeNet-5, SGD lr 0.05 momentum 0.9, batch 32, H 16,
no evaluation), 19 synchronisations as psparse's peers are timed, the hosts at their CPU share
once every rank has started. The steady synchronisation is the mean wall time from one
synchronisation's end to the next (H local steps and one exchange) over syncs 4 to 19 and the
ranks, as psparse's steady iteration is the mean after its first 3.

torchft comes from ``.torchft/`` (``make torchft``; $PSPARSE_TORCHFT overrides). Results:
experiments/results/local-steps-torchft-timing.json (the local-steps page shows it).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from experiments.cluster import WORKERS, emulated_cluster
from experiments.harness import RESULTS, ROOT
from experiments.time_to_accuracy import this_machine
from psparse.provenance import provenance

SYNC_EVERY, SYNCS, SKIP = 16, 19, 3  # H, synchronisations timed, the first ones left out
ALGORITHMS = {"diloco": "diloco-h16", "localsgd": "localsgd-h16"}  # -> psparse's peer run
RATES = ("25mbit", "5mbit")
JSON = "local-steps-torchft-timing.json"
PORT = 29510


def run_dir(rate: str, algorithm: str) -> Path:
    return ROOT / "runs" / "cluster" / f"lenet-{rate}" / f"torchft-{algorithm}-h{SYNC_EVERY}-s0"


def time_one(hosts, rate: str, algorithm: str, site: str) -> dict:
    """One torchft run on the cluster; its steady synchronisation and each rank's figures."""
    out = run_dir(rate, algorithm)
    subprocess.run(["rm", "-rf", str(out)], check=True)
    out.mkdir(parents=True)
    peer = [sys.executable, str(ROOT / "experiments" / "diloco_peer.py"), "--workers",
            str(WORKERS), "--algorithm", algorithm, "--optimizer", "sgd", "--lr", "0.05",
            "--sync-every", str(SYNC_EVERY), "--steps", str(SYNC_EVERY * SYNCS), "--no-eval",
            "--out", str(out)]

    def on(i: int, args: list[str], log: str) -> subprocess.Popen:
        env = f"PYTHONPATH={shlex.quote(site)}:{shlex.quote(str(ROOT))}"
        command = f"cd {shlex.quote(str(ROOT))} && {env} exec {shlex.join(args)}"
        return subprocess.Popen(hosts.on(i, command), stdout=open(out / log, "w"),
                                stderr=subprocess.STDOUT)

    print(f"[torchft] {rate} {algorithm} ...", flush=True)
    hosts.set_cpu_quota(None)  # start-up unthrottled, as psparse's cluster runs
    lighthouse = on(0, [*peer, "--serve-lighthouse", f"0.0.0.0:{PORT}"], "lighthouse.log")
    ranks = [on(r + 1, [*peer, "--rank", str(r), "--lighthouse",
                        f"http://{hosts.addrs[0]}:{PORT}", "--hostname", hosts.addrs[r + 1]],
                f"rank-{r}.log") for r in range(WORKERS)]
    quota = hosts.cpu_quota_us()
    deadline = time.monotonic() + 1200
    # the hosts' shares once every rank has started training (its first quorum is at step H)
    while not all("training starts" in (out / f"rank-{r}.log").read_text(errors="replace")
                  for r in range(WORKERS)):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in ranks):
            break
        time.sleep(0.2)
    hosts.set_cpu_quota(quota)
    codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in ranks]
    lighthouse.wait(60)
    if any(codes) or lighthouse.returncode:
        raise SystemExit(f"torchft {algorithm} at {rate} failed (ranks' exit codes {codes}, "
                         f"lighthouse {lighthouse.returncode}); see {out}/*.log")
    results = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(WORKERS)]
    periods = [b["at_s"] - a["at_s"] for r in results
               for a, b in zip(r["syncs"][SKIP:], r["syncs"][SKIP + 1:])]
    return {"steady_ms": 1e3 * statistics.fmean(periods),
            "sync_ms_median": 1e3 * statistics.median(s["sync_s"] for r in results
                                                       for s in r["syncs"][SKIP:]),
            "local_step_ms": 1e3 * statistics.fmean(r["local_step_s"] for r in results),
            "commits": [r["commits"] for r in results], "syncs": SYNCS,
            "code": provenance()["code_id"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.torchft_cluster",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default=",".join(RATES), help="link rates (default %(default)s)")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS),
                    help="diloco, localsgd (default both)")
    args = ap.parse_args(argv)
    site = os.environ.get("PSPARSE_TORCHFT", str(ROOT / ".torchft"))
    if not (Path(site) / "torchft").is_dir():
        ap.error(f"torchft is not in {site}: run make torchft (or set PSPARSE_TORCHFT)")
    path = RESULTS / JSON
    result = json.loads(path.read_text()) if path.is_file() else {"timing": {}}
    for rate in args.rates.split(","):
        with emulated_cluster(rate) as hosts:
            for algorithm in args.algorithms.split(","):
                timing = time_one(hosts, rate, algorithm, site)
                result["timing"].setdefault(rate, {})[algorithm] = timing
                print(f"[torchft] {rate} {algorithm}: {timing['steady_ms']:.0f} ms a "
                      f"synchronisation", flush=True)
    result.update({"machine": this_machine(), "psparse_peer": ALGORITHMS,
                   "workload": f"LeNet-5/MNIST, {WORKERS} workers, SGD lr 0.05 momentum 0.9, "
                               f"batch 32, H {SYNC_EVERY}, {SYNCS} synchronisations"})
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
