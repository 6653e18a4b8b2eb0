"""psparse-launch: one server and N workers on this host, with live progress and clean failure.

Writes RUN_DIR/config.json (the resolved configuration every process reads), starts the server
(or ``--servers S`` key-range shards, psparse/keyranges.py) and N worker processes (the same ``main`` functions as ``psparse-server`` / ``psparse-worker``)
with their output in RUN_DIR/logs/, prints a progress line while the run goes, and a summary table
at the end. If any process fails, the others are stopped (SIGTERM, then SIGKILL) and the launcher
exits non-zero: no orphans, no hang.

Processes are forked from the launcher after it has imported torch once: a fresh interpreter
spends ~6 CPU-seconds importing torch (and torch.optim's lazy import of torch._dynamo), which for
8 workers on 2 cores is ~25 s of start-up; forked children share the parent's imported modules.
The compiled CPU kernels (psparse/jit.py) are compiled or loaded from numba's cache before the
fork for the same reason.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import cluster, jit, keyranges, plugin
from .config import ConfigError, RunConfig
from .options import add_config_arguments, resolve_config
from .policies import Layout, PolicyError, build_policy
from .provenance import provenance
from .rundir import EVAL_FILE, METRICS_FILE, PORT_FILE, SUMMARY_FILE, JsonlTail
from .server.records import merge_records, merge_run_dir

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the launcher dies, even if it is killed with SIGKILL."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the workers' own timeouts still end them


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ForkedProcess:
    """A child running ``target()`` (its exit code) in a fork of this process; Popen-like."""

    def __init__(self, target, log_path: Path):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # child: never returns
            _run_child(target, log_path)
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_child(target, log_path: Path) -> None:
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        _die_with_parent()
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        code = target()
    except SystemExit as exc:  # argparse errors and explicit exits
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - report anything, then exit non-zero
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


class Launch:
    def __init__(self, cfg: RunConfig, out: Path, quiet: bool = False, grace_s: float = 5.0,
                 resume: bool = False, cluster: dict | None = None,
                 baseline: str | None = None, powersgd_rank: int = 4,
                 master_addr: str | None = None):
        self.cfg, self.out, self.quiet, self.grace_s = cfg, out, quiet, grace_s
        # "ddp" or "powersgd": torch DDP instead of psparse (psparse.ddp); the rendezvous is
        # rank 0's host (master_addr) in cluster modes
        self.baseline, self.powersgd_rank, self.master_addr = baseline, powersgd_rank, \
            master_addr
        self.resume = resume
        self.script: list[str] | None = None  # [TRAIN.PY, ARGS...]: the user's loop
        # None: all on this host. Else {"mode": "hostfile"|"slurm", "hosts", "server_host",
        # "port", "bind", "rsh", "gpus_per_node"}
        self.cluster = cluster
        self.procs: dict[str, ForkedProcess] = {}
        self.shards = cfg.servers  # key-range server shards (one server process each)
        self._tail = JsonlTail()  # the new records of the run's files, for the progress line
        self._last = {"metrics": None, "eval": None}
        self._pending: dict[int, list] = {}  # iteration -> its shards' records so far
        self._bytes = [0, 0]
        self._unions: list[int] = []

    def _spawn(self, name: str, args: list[str]) -> ForkedProcess:
        """A forked child running module ``args[0]``'s main(args[1:])."""
        def target():
            return importlib.import_module(args[0]).main(args[1:])
        return self._fork(name, target)

    def _spawn_script(self, name: str, env: dict[str, str]) -> ForkedProcess:
        """A forked child running the user's script, its environment extended by ``env``."""
        def target():
            os.environ.update(env)
            return run_script(self.script)
        return self._fork(name, target)

    def _fork(self, name: str, target) -> ForkedProcess:
        proc = ForkedProcess(target, self.out / "logs" / f"{name}.log")
        self.procs[name] = proc
        return proc

    def run(self) -> int:
        cfg = self.cfg
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        stale = (PORT_FILE, SUMMARY_FILE) if self.resume else \
            (PORT_FILE, SUMMARY_FILE, METRICS_FILE, EVAL_FILE)
        for name in stale:
            (self.out / name).unlink(missing_ok=True)
            for index in range(self.shards if self.shards > 1 else 0):
                (keyranges.shard_dir(self.out, index) / name).unlink(missing_ok=True)
        config_path = self.out / "config.json"
        if not self.resume:  # the options, and which code (and baseline) made the run
            record = {**json.loads(cfg.to_json()), "provenance": provenance()}
            if self.baseline:
                record["baseline"] = self.baseline
                if self.baseline == "powersgd":
                    record["powersgd_rank"] = self.powersgd_rank
            config_path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        again = ["--resume"] if self.resume else []
        if not self.cluster:
            # Import once here so that every forked worker starts with torch loaded (see
            # above); in cluster modes nothing is forked that needs it.
            importlib.import_module("psparse.worker")
            importlib.import_module("torch._dynamo")
            # Likewise the compiled CPU kernels: compiled (first run on this machine) or loaded
            # from numba's cache once, here, instead of in every child (psparse/jit.py).
            jit.warm_up()
        what = f"script {shlex.join(self.script)}" if self.script else f"{cfg.model}/{cfg.dataset}"
        self._print(f"psparse: {cfg.workers} workers, {what}, density {cfg.density:g}, run dir "
                    f"{self.out}")
        try:
            if self.baseline and self.cluster:
                self._start_baseline_cluster()
                return self._monitor()
            if self.baseline:
                port = _free_port()
                for r in range(cfg.workers):
                    self._spawn(f"rank-{r}", ["psparse.ddp", "--config", str(config_path),
                                              "--rank", str(r), "--port", str(port),
                                              "--out", str(self.out), *self._baseline_flags()])
                return self._monitor()
            if self.cluster:
                self._start_cluster(config_path, again)
                return self._monitor()
            for index in range(self.shards):
                self._spawn(self.server_name(index), [
                    "psparse.server", "--config", str(config_path), "--port", "0", "--out",
                    str(self.out), *self._shard_flag(index), *again])
            server = ",".join(f"127.0.0.1:{port}" for port in self._wait_for_ports())
            for r in range(cfg.workers):
                if self.script:
                    self._spawn_script(f"rank-{r}", self.script_env(
                        r, r, server, {"PSPARSE_CONFIG": str(config_path.resolve()),
                                       "PSPARSE_CONFIG_JSON": ""}))
                    continue
                self._spawn(f"rank-{r}", ["psparse.worker", "--config", str(config_path),
                                          "--rank", str(r), "--connect", server,
                                          "--out", str(self.out), *again])
            return self._monitor()
        except KeyboardInterrupt:
            self._print("\ninterrupted: stopping all processes")
            self.stop_all()
            return 130
        except RuntimeError as exc:
            self._print(f"psparse-launch: error: {exc}")
            self.stop_all()
            return 1

    def _start_cluster(self, config_path: Path, again: list[str]) -> None:
        """Server here (S key-range shards: at ports PORT .. PORT + S - 1, here or, with
        --server-hosts, shard I on the I-th host through --rsh), workers through ssh
        (hostfile) or one srun (SLURM)."""
        c, cfg = self.cluster, self.cfg
        out = str(self.out.resolve())
        placed = c.get("server_hosts")  # None: every shard here
        for index in range(self.shards):
            port = c["port"] + index
            if placed:
                argv = cluster.server_argv(cfg, c["bind"], port, out,
                                           (index, self.shards)) + again
                self._spawn_piped(self.server_name(index), cluster.remote_command(
                    c["rsh"], placed[index], argv, os.getcwd(), cluster.forwarded_env()),
                    prefix=f"{self.server_name(index)}| ")
                continue
            self._spawn(self.server_name(index), [
                "psparse.server", "--config", str(config_path), "--bind", c["bind"], "--port",
                str(port), "--out", str(self.out), *self._shard_flag(index), *again])
        if not placed:  # a remote shard's port file is on its host: the workers just connect
            self._wait_for_ports()
        server = ",".join(f"{placed[index] if placed else c['server_host']}:{c['port'] + index}"
                          for index in range(self.shards))
        # a script's workers get the configuration inline: no shared filesystem is assumed
        inline = {"PSPARSE_CONFIG_JSON": json.dumps(json.loads(config_path.read_text()),
                                                    separators=(",", ":")),
                  "PSPARSE_CONFIG": ""}  # a path inherited from this shell would win
        if c["mode"] == "slurm":
            if self.script:  # srun passes the environment on; each task's rank: SLURM_PROCID
                os.environ.update({k: v for k, v in self.script_env(0, 0, server, inline).items()
                                   if k not in ("RANK", "LOCAL_RANK")})
                # torchrun's names from SLURM's, per task, before the script starts
                argv = cluster.srun_prefix(cfg) + [
                    "sh", "-c", 'RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID exec "$@"',
                    "psparse-task", sys.executable, *self.script]
            else:
                argv = cluster.srun_command(cfg, server, out) + again
            self._spawn_piped("workers", argv, prefix="rank ")
            return
        for rank, host, local in cluster.place(c["hosts"], cfg.workers):
            env = {**cluster.forwarded_env(), "LOCAL_RANK": str(local)}
            if c["gpus_per_node"] and "CUDA_VISIBLE_DEVICES" not in env:
                env["CUDA_VISIBLE_DEVICES"] = str(local % c["gpus_per_node"])
            if self.script:
                env.update(self.script_env(rank, local, server, inline))
                argv = [sys.executable, *self.script]
            else:
                argv = cluster.worker_argv(cfg, server, out, rank) + again
            self._spawn_piped(f"rank-{rank}", cluster.remote_command(
                c["rsh"], host, argv, os.getcwd(), env), prefix=f"rank {rank}| ")

    def _baseline_flags(self) -> list[str]:
        return ["--baseline", self.baseline, "--powersgd-rank", str(self.powersgd_rank)]

    def _start_baseline_cluster(self) -> None:
        """DDP ranks through --rsh on the hostfile's hosts; rank 0 hosts the rendezvous
        (torch's TCPStore) at --master-addr (default: its host's name), port --port."""
        c, cfg = self.cluster, self.cfg
        if c["mode"] != "hostfile":
            raise RuntimeError("--baseline with --slurm is not supported; use --hostfile")
        placed = cluster.place(c["hosts"], cfg.workers)
        master = self.master_addr or placed[0][1]
        out = str(self.out.resolve())
        for rank, host, local in placed:
            env = {**cluster.forwarded_env(), "LOCAL_RANK": str(local)}
            argv = [sys.executable, "-m", "psparse.ddp", *cluster.config_flags(cfg), "--rank",
                    str(rank), "--port", str(c["port"]), "--master-addr", master, "--out", out,
                    *self._baseline_flags()]
            self._spawn_piped(f"rank-{rank}", cluster.remote_command(
                c["rsh"], host, argv, os.getcwd(), env), prefix=f"rank {rank}| ")

    def script_env(self, rank: int, local: int, server: str, config: dict) -> dict[str, str]:
        """What a user script's psparse.connect() reads (torchrun's names where they exist)."""
        return {"RANK": str(rank), "WORLD_SIZE": str(self.cfg.workers), "LOCAL_RANK": str(local),
                "PSPARSE_SERVER": server, "PSPARSE_OUT": str(self.out.resolve()),
                "PSPARSE_TOKEN": os.environ["PSPARSE_TOKEN"],
                "PSPARSE_RESUME": "1" if self.resume else "0", **config}

    def _spawn_piped(self, name: str, argv: list[str], prefix: str) -> subprocess.Popen:
        """A local client process (ssh, srun) whose output goes to the log and, prefixed, here."""
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        log = open(self.out / "logs" / f"{name}.log", "wb")

        def pump():
            with log:
                for line in proc.stdout:
                    log.write(line)
                    log.flush()
                    if not self.quiet:
                        sys.stdout.write(prefix + line.decode(errors="replace"))
                        sys.stdout.flush()

        threading.Thread(target=pump, daemon=True).start()
        self.procs[name] = proc
        return proc

    def server_name(self, index: int) -> str:
        """The process (and log) name of server shard ``index``: "server" for a single one."""
        return "server" if self.shards == 1 else f"server-{index}"

    def _shard_flag(self, index: int) -> list[str]:
        return [] if self.shards == 1 else ["--shard", f"{index}/{self.shards}"]

    def _server_dir(self, index: int) -> Path:
        return self.out if self.shards == 1 else keyranges.shard_dir(self.out, index)

    def _wait_for_ports(self) -> list[int]:
        """Each server shard's port, once it listens (from its server.port file)."""
        deadline = time.monotonic() + self.cfg.timeout
        ports = []
        for index in range(self.shards):
            name = self.server_name(index)
            port_file = self._server_dir(index) / PORT_FILE
            while not port_file.is_file():
                if self.procs[name].poll() is not None:
                    raise RuntimeError(f"{name} exited before listening:\n" + self._tail(name))
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start listening within "
                                       f"{self.cfg.timeout:g} s")
                time.sleep(0.05)
            ports.append(int(port_file.read_text()))
        return ports

    @staticmethod
    def is_server(name: str) -> bool:
        return name == "server" or name.startswith("server-")

    def _monitor(self) -> int:
        last_print, shown = 0.0, None
        first_failure = None  # (name, code) of the process that failed first: the root cause
        interval = 1.0 if sys.stdout.isatty() else 10.0  # a log file gets a line every 10 s
        while True:
            finished = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            failed = {n: c for n, c in finished.items() if c != 0}
            self._read_progress()
            if failed and all(self.is_server(n) for n in failed):
                # The server ends the run at once when a worker's connection closes, so it can
                # exit before the launcher has reaped that worker: the worker is the cause.
                failed = self._worker_failures_within(1.0) or failed
            if failed and first_failure is None:
                first_failure = sorted(failed.items())[0]
                servers = [p for n, p in self.procs.items() if self.is_server(n)]
                if not any(self.is_server(n) for n in failed):
                    # a worker failed: give the servers a moment to record its cause in
                    # summary.json and end the run themselves before they are stopped
                    deadline = time.monotonic() + self.grace_s
                    for server in servers:
                        try:
                            server.wait(max(0.0, deadline - time.monotonic()))
                        except subprocess.TimeoutExpired:
                            pass
            if failed:
                name, code = first_failure
                self._print(f"\npsparse-launch: {name} exited with code {code}; stopping the "
                            f"others\n{self._tail(name)}")
                self.stop_all()
                self._merge_shards()
                return code if code > 0 else 1
            if len(finished) == len(self.procs):
                self._merge_shards()
                self._progress(final=True)
                self._print_summary()
                return 0
            if time.monotonic() - last_print >= interval and self._last["metrics"] is not shown:
                self._progress()
                shown = self._last["metrics"]
                last_print = time.monotonic()
            time.sleep(0.1)

    def _worker_failures_within(self, seconds: float) -> dict[str, int]:
        """Workers that exit non-zero on their own within ``seconds`` (name -> code)."""
        deadline = time.monotonic() + seconds
        while True:
            failed = {n: p.returncode for n, p in self.procs.items()
                      if not self.is_server(n) and p.poll() is not None and p.returncode != 0}
            if failed or time.monotonic() >= deadline:
                return failed
            time.sleep(0.02)

    def stop_all(self) -> None:
        alive = [p for p in self.procs.values() if p.poll() is None]
        for p in alive:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for p in alive:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _merge_shards(self) -> None:
        """A sharded run's metrics.jsonl, eval.jsonl and summary.json from the shards' own
        (each shard also does it when it finishes; this covers a run that failed)."""
        if self.shards > 1 and not self.baseline:
            merge_run_dir(self.out, self.shards)

    # -------------------------------------------------------------------------------- progress
    def _read_lines(self, path: Path) -> list[dict]:
        return self._tail.new(path)

    def _metrics_records(self) -> list[dict]:
        """New per-iteration records: the run's, or for S shards each iteration's merged record
        once every shard has written its own."""
        if self.shards == 1 or self.baseline:
            return self._read_lines(self.out / METRICS_FILE)
        for index in range(self.shards):
            for rec in self._read_lines(keyranges.shard_dir(self.out, index) / METRICS_FILE):
                self._pending.setdefault(rec["iter"], []).append(rec)
        done = sorted(it for it, recs in self._pending.items() if len(recs) == self.shards)
        return [merge_records(self._pending.pop(it)) for it in done]  # the server's rule

    def _read_progress(self) -> None:
        for rec in self._metrics_records():
            self._last["metrics"] = rec
            if "allreduce_bytes" in rec:  # the DDP baseline: a ring moves half each way
                self._bytes[0] += rec["allreduce_bytes"] / 2
                self._bytes[1] += rec["allreduce_bytes"] / 2
                continue
            self._bytes[0] += rec["upload_bytes"]
            self._bytes[1] += rec["broadcast_bytes"]
            self._unions.append(rec["union"] / max(1, rec["budget"]))
        for rec in self._read_lines(self._server_dir(0) / EVAL_FILE):
            self._last["eval"] = rec

    def _progress(self, final: bool = False) -> None:
        m, e = self._last["metrics"], self._last["eval"]
        if m is None or self.quiet:
            return
        it = m["iter"] + 1
        rate = it / m["time_s"] if m["time_s"] > 0 else 0.0
        acc = f"{100 * e['test_acc']:.2f}%" if e else "-"
        loss = f"{m['loss']:.4f}" if m.get("loss") is not None else "-"
        union = f"{self._unions[-1]:.2f}" if self._unions else "-"
        line = (f"iter {it:>6} | loss {loss} | test acc {acc} | union/k "
                f"{union} | up {self._bytes[0] / 1e6:.2f} MB | down "
                f"{self._bytes[1] / 1e6:.2f} MB | {rate:.1f} it/s")
        tty = sys.stdout.isatty()
        print(("\r" + line) if tty else line, end="\n" if final or not tty else "", flush=True)

    def _print_summary(self) -> None:
        path = self.out / SUMMARY_FILE
        if not path.is_file() or self.quiet:
            return
        s = json.loads(path.read_text())
        acc = f"{100 * s['test_acc']:.2f} %" if s.get("test_acc") is not None else "-"
        total = s["upload_mb"] + s["broadcast_mb"]
        ratio = s["dense_mb"] / total if total else float("inf")
        rows = [
            ("iterations", f"{s['iterations']}  "
                           f"({s.get('train_iterations_per_s') or s['iterations_per_s']} it/s "
                           f"in training; {s['wall_s']:.1f} s in all)"),
            ("test accuracy", acc),
            ("union/k", f"mean {s['union_over_k_mean']}  max {s['union_over_k_max']}  "
                        f"(k = {s['k']}, numel = {s['numel']})" if not s.get("baseline")
             else f"- ({s['baseline']}: dense ring allreduce)"),
        ]
        if s.get("pushed_k_mean") is not None:
            rows.append(("pushed k", f"mean {s['pushed_k_mean']}  (entries per worker per "
                                     f"iteration; the budget is k)"))
        if s.get("baseline"):
            rows.append(("ring allreduce", f"{total:.2f} MB  (all workers, both directions)"))
        else:
            rows += [
                ("upload (all workers)", f"{s['upload_mb']:.2f} MB"),
                ("broadcast (server)", f"{s['broadcast_mb']:.2f} MB"),
                ("dense exchange", f"{s['dense_mb']:.2f} MB  ({ratio:.1f}x more than sparse)"),
            ]
        for shard in s.get("shards", []):  # --servers S: each key range's share of the bytes
            lo, hi = shard["key_range"]
            rows.append((f"server shard {shard['shard']}",
                         f"keys [{lo}, {hi}): up {shard['upload_mb']:.2f} MB, broadcast "
                         f"{shard['broadcast_mb']:.2f} MB"))
        width = max(len(r[0]) for r in rows)
        print("\n" + "\n".join(f"{name:<{width}}  {value}" for name, value in rows))
        print(f"\nfiles: {self.out}/{{config.json, metrics.jsonl, eval.jsonl, summary.json, "
              "logs/" + (", shard-I/" if s.get("shards") else "") + "}")

    def _tail(self, name: str, lines: int = 15) -> str:
        path = self.out / "logs" / f"{name}.log"
        try:
            text = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "\n".join(f"  {name}| {line}" for line in text)

    def _print(self, msg: str) -> None:
        print(msg, flush=True)


def check_policy(cfg: RunConfig) -> None:
    """Build the policy as rank 0 will: on the real model's layout and k (no data loaded).
    A script's or a factory's model is not known here: then a 100,000-entry stand-in checks the
    policy's name and parameters."""
    import torch

    from .data import IN_SHAPES
    from .models import build_model, check_factory
    from .sparsify import density_to_k

    if not cfg.script and ":" in cfg.model:
        check_factory(cfg.model, cfg.model_kwargs())  # takes the --model-arg keywords?
    if cfg.script or ":" in cfg.model or ":" in cfg.dataset:
        layout = Layout([100_000], cfg.granularity)
    else:
        with torch.device("meta"):  # sizes only: no memory, no initialisation
            model = build_model(cfg.model, IN_SHAPES[cfg.dataset], 10, cfg.model_kwargs())
        layout = Layout([p.numel() for p in model.parameters() if p.requires_grad],
                        cfg.granularity)
    build_policy(cfg.policy, cfg.policy_args, layout, density_to_k(cfg.density, layout.numel),
                 world_size=cfg.workers, seed=cfg.seed)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="psparse-launch",
        description="Train with a psparse parameter server and N workers on this host. "
                    "Example: psparse-launch --workers 8 --density 0.01 --epochs 2 --out runs/x")
    p.add_argument("--out", type=Path, default=None,
                   help="run directory (default: runs/<model>-<dataset>-<time>)")
    p.add_argument("--quiet", action="store_true", help="no progress line or summary table")
    g = p.add_argument_group("cluster (default: server and workers on this host)")
    g.add_argument("--hostfile", type=Path, default=None,
                   help="lines 'host slots=K': workers fill the slots in order, started with "
                        "--rsh; the server runs here")
    g.add_argument("--slurm", action="store_true",
                   help="inside a SLURM allocation: the server here, workers through one srun "
                        "(--workers defaults to SLURM_NTASKS)")
    g.add_argument("--server-host", default=None,
                   help="address the workers use to reach this host's server (default: this "
                        "host's name)")
    g.add_argument("--port", type=int, default=5555,
                   help="server port in cluster modes (shard I of --servers S: this + I)")
    g.add_argument("--server-hosts", default=None, metavar="HOST,HOST,...",
                   help="with --servers S in cluster modes: start shard I on the I-th host "
                        "through --rsh (S names, in shard order; each writes RUN_DIR/shard-I/ "
                        "on its host) instead of all shards here")
    g.add_argument("--bind", default="0.0.0.0",
                   help="server bind address in cluster modes (default 0.0.0.0)")
    g.add_argument("--rsh", default="ssh -o BatchMode=yes",
                   help="remote shell for --hostfile (default 'ssh -o BatchMode=yes')")
    g.add_argument("--gpus-per-node", type=int, default=None,
                   help="with --hostfile: CUDA_VISIBLE_DEVICES = local rank mod this, unless "
                        "already set")
    p.add_argument("--baseline", choices=["ddp", "powersgd"], default=None,
                   help="train the same run with torch DistributedDataParallel (dense ring "
                        "allreduce, gloo on CPU / NCCL on GPU) instead of psparse, for "
                        "comparison; powersgd: DDP with the PowerSGD comm hook (error feedback, "
                        "warm start)")
    p.add_argument("--powersgd-rank", type=int, default=4, metavar="R",
                   help="with --baseline powersgd: the rank of PowerSGD's low-rank "
                        "approximation (default 4)")
    g.add_argument("--master-addr", default=None,
                   help="with --baseline and --hostfile: the address of rank 0's host, where "
                        "the DDP ranks meet (port --port; default: that host's name)")
    p.add_argument("--run-token", default=None, metavar="SECRET",
                   help="the run's admission secret, given to the server and every worker in "
                        "PSPARSE_TOKEN (default: $PSPARSE_TOKEN, else a fresh random one per "
                        "run)")
    p.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                   help="continue RUN_DIR (its config.json) from the newest checkpoint that the "
                        "server and all workers saved (see --checkpoint-every)")
    add_config_arguments(p)
    p.add_argument("script", nargs="?", default=None, metavar="TRAIN.PY",
                   help="your own training script (it calls psparse.connect), started once per "
                        "worker with RANK, WORLD_SIZE, LOCAL_RANK, PSPARSE_SERVER, PSPARSE_OUT, "
                        "PSPARSE_TOKEN and PSPARSE_CONFIG set (torchrun's convention); without "
                        "it the built-in loop trains --model on --dataset")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="arguments passed on to TRAIN.PY")
    return p


def run_script(argv: list[str]) -> int:
    """Run a user script as ``python TRAIN.PY ARGS`` would, in this (forked) process: its
    folder first on sys.path, ``__name__ == "__main__"``; its exit code."""
    import runpy

    script = Path(argv[0])
    sys.argv = [str(script), *argv[1:]]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)  # sys.exit("message"), as python prints it
        return 1
    return 0


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.resume is not None:
        if not (args.resume / "config.json").is_file():
            p.error(f"--resume {args.resume}: no config.json there (not a psparse run)")
        args.config, args.out = args.resume / "config.json", args.resume
    if args.script is not None:  # (--resume takes the script from config.json)
        if not Path(args.script).is_file():
            p.error(f"training script {args.script} not found")
        if args.baseline:
            p.error("--baseline trains the built-in loop; it does not take a script")
    try:
        cfg = resolve_config(args)
    except ConfigError as exc:
        p.error(str(exc))
    if args.script is not None:
        cfg.script = shlex.join([args.script, *args.script_args])
    try:  # fail here, before any process starts, on an unknown policy, parameter or factory
        for spec, what in ((cfg.model, "model factory"), (cfg.dataset, "dataset factory")):
            if plugin.is_spec(spec) and not cfg.script:
                plugin.load(spec, what)
        check_policy(cfg)
    except (PolicyError, ValueError) as exc:
        p.error(str(exc))
    # The run's admission secret: only processes that hold it can register (docs/protocol.md).
    # Forked workers inherit it; --hostfile forwards PSPARSE_* variables, srun the environment.
    os.environ["PSPARSE_TOKEN"] = args.run_token or os.environ.get("PSPARSE_TOKEN") \
        or secrets.token_hex(32)
    if cfg.threads is None:
        cfg.threads = max(1, (os.cpu_count() or 1) // cfg.workers)
    name = Path(args.script).stem if args.script else f"{cfg.model}-{cfg.dataset}"
    out = args.out or Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    cluster_mode = None
    if args.hostfile or args.slurm:
        if args.hostfile and args.slurm:
            p.error("--hostfile and --slurm exclude each other")
        try:
            if args.server_hosts is not None:
                server_hosts = [h.strip() for h in args.server_hosts.split(",")]
                if len(server_hosts) != cfg.servers or not all(server_hosts):
                    raise ValueError(f"--server-hosts names {len(server_hosts)} host(s) for "
                                     f"{cfg.servers} server shard(s) (--servers): give one "
                                     "host per shard, comma-separated, in shard order")
            if args.slurm:
                hosts = [cluster.Host(h, 1) for h in cluster.slurm_nodes()]
                if args.workers is None:
                    cfg.workers = cluster.slurm_workers()
            else:
                hosts = cluster.parse_hostfile(args.hostfile.read_text(), str(args.hostfile))
                cluster.place(hosts, cfg.workers)  # enough slots?
        except (OSError, ValueError) as exc:
            p.error(str(exc))
        cluster_mode = {"mode": "slurm" if args.slurm else "hostfile", "hosts": hosts,
                        "server_host": args.server_host or socket.gethostname(),
                        "port": args.port, "bind": args.bind, "rsh": shlex.split(args.rsh),
                        "gpus_per_node": args.gpus_per_node,
                        "server_hosts": server_hosts if args.server_hosts else None}
    elif args.server_hosts is not None:
        p.error("--server-hosts places server shards in cluster modes: use it with --hostfile "
                "or --slurm")
    if args.baseline and (args.slurm or args.resume):
        p.error("--baseline runs on this host or with --hostfile, without --resume")
    if args.baseline and cfg.servers > 1:
        p.error("--baseline trains with torch DDP, which has no parameter server: --servers "
                "does not apply")
    if args.baseline and (cfg.overlap or cfg.bucket_mb is not None):
        p.error("--baseline trains with torch DDP, which buckets and overlaps on its own: "
                "--overlap and --bucket-mb do not apply")
    if args.powersgd_rank < 1:
        p.error("--powersgd-rank must be at least 1")
    launch = Launch(cfg, out, quiet=args.quiet, resume=args.resume is not None,
                    cluster=cluster_mode, baseline=args.baseline,
                    powersgd_rank=args.powersgd_rank, master_addr=args.master_addr)
    if cfg.script:
        launch.script = shlex.split(cfg.script)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    return launch.run()


if __name__ == "__main__":
    sys.exit(main())

