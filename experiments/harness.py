"""What every experiment driver shares: reading a run directory, the run cache, the emulated
cluster, and the tables' formatting.

* ``RunDir``: one run directory's files as records (config, metrics, evaluations, summary,
  rank files), every JSON-lines file through ``psparse.rundir.read_jsonl``;
* ``RunCache``: whether a run directory holds a finished run made with given arguments
  (``started.json`` / ``command.json``), so that a sweep redoes only what changed;
* ``EmulatedCluster``: ``launch/netns.sh cluster``, its hosts, and commands run on them;
* ``md_table``, ``mean_sd``, ``mean_of``, ``by_run`` and ``made_by``: the markdown tables of
  experiments/results and benchmarks/.

Used by experiments/run.py, cluster.py, scaling.py, low_density.py, gpu_sweep.py, figures.py and
benchmarks/bench_scale.py. Paths are passed in, not read from here: the tests point a driver's
ROOT at a temporary folder.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import numpy as np

from psparse.rundir import CONFIG_FILE, EVAL_FILE, METRICS_FILE, SUMMARY_FILE, rank_file, read_jsonl

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
NETNS = ROOT / "launch" / "netns.sh"
NSRSH = ROOT / "launch" / "nsrsh.sh"


# ---------------------------------------------------------------------------- run directory

class RunDir:
    """The files of one run directory (psparse/rundir.py names them), read as records. A
    JSON-lines file a run has not written (yet) reads as no records and a JSON file as None: a
    run still going, stopped or failed early is read as far as it got."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def json(self, name: str) -> dict | None:
        """A JSON file of the run directory; None when it is not there."""
        path = self.path / name
        return json.loads(path.read_text()) if path.is_file() else None

    def config(self) -> dict:
        return self.json(CONFIG_FILE) or {}

    def summary(self) -> dict | None:
        return self.json(SUMMARY_FILE)

    def metrics(self) -> list[dict]:
        """One record per iteration; complete lines only (a running run may be writing one)."""
        return read_jsonl(self.path / METRICS_FILE)

    def evals(self) -> list[dict]:
        return read_jsonl(self.path / EVAL_FILE)

    def jsonl(self, name: str) -> list[dict]:
        """Any other JSON-lines file of the run (cpu-samples.jsonl)."""
        return read_jsonl(self.path / name)

    def ranks(self, workers: int) -> list[dict]:
        """rank-R.json of workers 0 .. workers - 1."""
        return [json.loads((self.path / rank_file(r)).read_text()) for r in range(workers)]

    def code_id(self) -> str | None:
        """Which code made the run (config.json's provenance; None for runs made before it was
        recorded, or without a config yet)."""
        return self.config().get("provenance", {}).get("code_id")


# ---------------------------------------------------------------------------- run cache

class RunCache:
    """Whether ``run_dir`` holds a finished run of ``identity`` (a JSON value: the run's
    arguments with its seed, and whatever else its results depend on), so that a sweep called
    again redoes only the runs whose identity changed.

    ``started.json`` holds the identity of the run last started there (written before the
    launcher starts), ``command.json`` that of the run last ended there, whether it succeeded or
    failed (a caller that wants failed runs redone does not call ``finish`` for them). Which code
    made a run is in its config.json; ``finished(code_id)`` also asks for that code, a driver
    that mixes runs of several codes in one table (it names them: ``made_by``) does not."""

    STARTED = "started.json"
    ENDED = "command.json"

    def __init__(self, run_dir: Path, identity):
        self.dir = RunDir(run_dir)
        self.identity = identity

    def _holds(self, name: str) -> bool:
        return self.dir.json(name) == self.identity

    def finished(self, code_id: str | None = None) -> bool:
        """A run of this identity ended here and wrote its summary (and, with ``code_id``, was
        made by that code)."""
        if not ((self.dir.path / SUMMARY_FILE).is_file() and self._holds(self.ENDED)):
            return False
        return code_id is None or self.dir.code_id() == code_id

    def started(self) -> bool:
        """A run of this identity was started here (and may have been stopped part-way)."""
        return self._holds(self.STARTED)

    def start(self, fresh: bool = False) -> None:
        """Mark the run started: no longer finished until ``finish``; ``fresh`` empties the
        directory first (a run that is never resumed leaves no stale files behind)."""
        if fresh:
            shutil.rmtree(self.dir.path, ignore_errors=True)
        self.dir.path.mkdir(parents=True, exist_ok=True)
        (self.dir.path / self.ENDED).unlink(missing_ok=True)
        (self.dir.path / self.STARTED).write_text(json.dumps(self.identity))

    def finish(self) -> None:
        """Mark the run ended (a launcher that failed early may not have made the directory)."""
        self.dir.path.mkdir(parents=True, exist_ok=True)
        (self.dir.path / self.ENDED).write_text(json.dumps(self.identity))


# ---------------------------------------------------------------------------- emulated cluster

class EmulatedCluster:
    """``launch/netns.sh cluster NAME HOSTS RATE`` (root): HOSTS network namespaces NAME-h0 ..
    (h0 first), each with one link to a bridge shaped at RATE both ways, a CPU share of
    ``cpus`` / HOSTS cores and, with ``pin`` (netns.sh's default), one CPU each. Built by
    ``up`` (or ``with``), taken down by ``down``; ``addrs`` are the hosts' addresses."""

    def __init__(self, name: str, hosts: int, rate: str, cpus: float | str | None = None,
                 pin: bool | None = None):
        self.name, self.hosts, self.rate = name, hosts, rate
        self.cpus, self.pin = cpus, pin
        self.addrs: list[str] = []

    def up(self) -> list[str]:
        self.down()  # a cluster left over by a run that was killed
        env = dict(os.environ)
        if self.cpus is not None:
            env["PSNET_CPUS"] = str(self.cpus)
        if self.pin is not None:
            env["PSNET_PIN"] = "1" if self.pin else "0"
        self.addrs = subprocess.run(["bash", str(NETNS), "cluster", self.name, str(self.hosts),
                                     self.rate], capture_output=True, text=True, check=True,
                                    env=env).stdout.split()
        return self.addrs

    def down(self) -> None:
        subprocess.run(["bash", str(NETNS), "down", self.name], capture_output=True)

    def __enter__(self) -> EmulatedCluster:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def host(self, i: int) -> str:
        """Host i's namespace (and cgroup) name."""
        return f"{self.name}-h{i}"

    def on(self, i: int, command: str) -> list[str]:
        """The command line that runs the shell ``command`` on host i (its namespace and CPU
        share): launch/nsrsh.sh, the remote shell of psparse-launch --hostfile."""
        return ["bash", str(NSRSH), self.host(i), command]

    def launch_on(self, i: int, launch: list[str], root: Path = ROOT) -> list[str]:
        """psparse-launch (``launch``: its argv) started on host i, in the checkout ``root``."""
        return self.on(i, f"cd {shlex.quote(str(root))} && exec {shlex.join(launch)}")

    def rsh_by_address(self, path: Path) -> Path:
        """A remote shell for hosts named by their addresses (as --server-hosts names them):
        it enters the namespace that holds the address (netns.sh numbers them from .1)."""
        path.write_text("#!/bin/bash\nhost=$1; shift\n"
                        f"exec bash {NSRSH} {self.name}-h$(( ${{host##*.}} - 1 )) \"$@\"\n")
        return path

    def cpu_quota_us(self, i: int = 0) -> int:
        """Host i's CPU share: its cgroup's CPU quota per 10 ms period (µs)."""
        return int(self._cgroup("cpu", i, "cpu.cfs_quota_us").read_text())

    def set_cpu_quota(self, quota_us: int | None) -> None:
        """Every host's CPU share (µs per 10 ms period); None: unlimited."""
        for i in range(self.hosts):
            path = self._cgroup("cpu", i, "cpu.cfs_quota_us")
            if path.parent.is_dir():
                path.write_text(str(quota_us if quota_us is not None else -1))

    def pinned(self) -> bool:
        """Whether netns.sh pinned the hosts to CPUs (host 1's cpuset)."""
        cpuset = self._cgroup("cpuset", 1, "cpuset.cpus")
        return cpuset.is_file() and bool(cpuset.read_text().strip())

    def _cgroup(self, controller: str, i: int, name: str) -> Path:
        return Path(f"/sys/fs/cgroup/{controller}/psparse-{self.host(i)}/{name}")

    def link_counters(self) -> dict[str, list[int]]:
        """host -> [rx bytes, tx bytes] of its eth0 (what its link carried, headers included)."""
        out = {}
        for i in range(self.hosts):
            info = json.loads(subprocess.run(
                ["ip", "-n", self.host(i), "-s", "-j", "link", "show", "eth0"],
                capture_output=True, text=True, check=True).stdout)[0]["stats64"]
            out[f"h{i}"] = [info["rx"]["bytes"], info["tx"]["bytes"]]
        return out


# ---------------------------------------------------------------------------- tables

def int_option(args: list[str], flag: str, default: int) -> int:
    """The int a run's launcher arguments give ``flag`` (``default`` where they do not)."""
    return int(args[args.index(flag) + 1]) if flag in args else default


def md_table(header: list[str], rows: list[list]) -> str:
    """A markdown table; an empty cell is written as one space between its bars."""
    def line(cells):
        return "|" + "".join(f" {c} |" if str(c) != "" else " |" for c in cells)
    return "\n".join([line(header), "|" + "---|" * len(header)] + [line(r) for r in rows])


def mean_sd(values, fmt: str = ".2f", count: bool = False) -> str:
    """The mean ± the sample standard deviation (ddof 1: the seeds are a sample of all seeds)
    of ``values``; one value alone, without ±; with ``count``, how many in brackets; none: -."""
    values = list(values)
    if not values:
        return "-"
    text = f"{np.mean(values):{fmt}}"
    if len(values) > 1:
        text += f" ± {np.std(values, ddof=1):{fmt}}"
    return text + (f" ({len(values)})" if count else "")


def mean_of(rows: list[dict], key: str) -> float:
    """The mean of one figure over rows (a run's seeds)."""
    return np.mean([r[key] for r in rows])


def by_run(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows grouped by run name (a run's seeds together), in the order the runs first appear."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["run"], []).append(r)
    return out


def made_by(rows: list[dict]) -> str:
    """Which code made a table's runs (config.json's provenance), one line."""
    codes: dict[str, list[str]] = {}
    for r in rows:
        codes.setdefault(r.get("code") or "not recorded", []).append(f"{r['run']}-s{r['seed']}")
    if len(codes) == 1:
        return f"Made by one code version: {next(iter(codes))}."
    return (f"Made by {len(codes)} code versions: " +
            "; ".join(f"{code} ({', '.join(runs)})" for code, runs in codes.items()) + ".")
