"""The launcher's watch over a run: start the processes, name the first failure, stop the rest.

The launcher's watch over a run's processes: start them from their specs, wait for the
servers to listen, notice the first failure (its cause, not its echoes), stop everything
cleanly (SIGTERM, then SIGKILL after a grace), and report the progress as the run goes.

In an ``--elastic`` run a worker that fails once training is under way is the server's to
lose: when the servers serve another round without it (or are still serving a grace after it,
or ended well) the run goes on without it (its name is in ``lost``), and only the servers' end
or another failure ends it."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .plan import Spec, StartFailure
from .processes import ForkedProcess, piped, run_script


def is_server(name: str) -> bool:
    return name == "server" or name.startswith("server-")


class Supervisor:
    def __init__(self, out: Path, quiet: bool = False, grace_s: float = 5.0, say=None,
                 elastic_from: int | None = None):
        self.out, self.quiet, self.grace_s = out, quiet, grace_s
        # an elastic run's first iteration: a worker lost after it started is not the end
        self.elastic_from = elastic_from
        self.lost: set[str] = set()  # workers an elastic run went on without
        self.say = say or (lambda msg: print(msg, flush=True))
        self.procs: dict = {}  # name -> ForkedProcess or Popen
        self.kinds: dict[str, str] = {}  # name -> its spec's kind (fork, script, command)
        self.failure: tuple[str, int] | None = None  # (name, exit code) of the first failure
        self.error: str | None = None  # the launcher's own error (e.g. a server never listened)
        self.start_failed = False  # that error is a StartFailure: the run could not start
        self.noticed_at: float | None = None  # time.time() when the failure was seen
        self.stopped_at: float | None = None  # time.time() when the others had been stopped

    def start(self, spec: Spec):
        log = self.out / "logs" / f"{spec.name}.log"
        self.kinds[spec.name] = spec.kind
        if spec.kind == "command":
            try:
                proc = piped(spec.argv, log, spec.prefix, self.quiet, spec.env)
            except OSError as exc:  # e.g. no such --rsh program
                raise StartFailure(f"{spec.name} could not start: {spec.argv[0]}: "
                                   f"{exc.strerror or exc}") from None
        elif spec.kind == "script":
            def target(spec=spec):
                os.environ.update(spec.env)
                return run_script(spec.argv)
            proc = ForkedProcess(target, log)
        else:  # fork: the module's main
            def target(spec=spec):
                return importlib.import_module(spec.argv[0]).main(spec.argv[1:])
            proc = ForkedProcess(target, log)
        self.procs[spec.name] = proc
        return proc

    def wait_for_ports(self, port_files: list[tuple[str, Path]], timeout: float) -> list[int]:
        """Each server's port, once it listens (from its server.port file)."""
        deadline = time.monotonic() + timeout
        ports = []
        for name, port_file in port_files:
            while not port_file.is_file():
                code = self.procs[name].poll()
                if code is not None:  # on its own (it says why), or killed (not its fault)
                    self.failure, self.noticed_at = (name, code), time.time()
                    said = "".join(f"; {line}" for line in self.last_lines(name))
                    failure = StartFailure if code > 0 else RuntimeError
                    raise failure(f"{name} could not start: it exited with code {code} before "
                                  f"listening{said}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start listening within {timeout:g} s")
                time.sleep(0.05)
            ports.append(int(port_file.read_text()))
        return ports

    def monitor(self, progress, on_end=lambda: None) -> int:
        """Until every process has exited (0, with the final progress and summary) or one has
        failed (its exit code, the others stopped). ``on_end()`` runs in both cases, before
        the summary (a sharded run's files merged)."""
        last_print, shown = 0.0, None
        first_failure = None  # (name, code) of the process that failed first: the root cause
        interval = 1.0 if sys.stdout.isatty() else 10.0  # a log file gets a line every 10 s
        while True:
            finished = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            failed = {n: c for n, c in finished.items() if c != 0 and n not in self.lost}
            progress.read()
            failed = self._drop_already_lost(failed, progress)
            if failed and all(is_server(n) for n in failed):
                # The server ends the run at once when a worker's connection closes, so it can
                # exit before the launcher has reaped that worker: the worker is the cause.
                failed = self._worker_failures_within(1.0) or failed
            if failed and first_failure is None:
                first_failure = sorted(failed.items())[0]
                self.noticed_at = time.time()
                if not any(is_server(n) for n in failed):
                    self._await_servers(progress)
                if self._goes_on_without(failed, progress):
                    first_failure = self.noticed_at = None
                    continue
            if failed:
                name, code = self.failure = first_failure
                self.say(f"\npsparse-launch: {name} exited with code {code}; stopping the "
                         f"others\n{self.tail(name)}")
                self.stop_all()
                self.stopped_at = time.time()
                on_end()
                return code if code > 0 else 1
            if len(finished) == len(self.procs):
                on_end()
                progress.line(final=True)
                progress.summary()
                return 0
            if time.monotonic() - last_print >= interval and progress.latest is not shown:
                progress.line()
                shown = progress.latest
                last_print = time.monotonic()
            time.sleep(0.1)

    def _await_servers(self, progress) -> None:
        """A worker failed: give the servers a moment (the grace) to record its cause in
        summary.json and end the run themselves before they are stopped, or, in an elastic
        run, to serve a round without it."""
        deadline = time.monotonic() + self.grace_s
        servers = [p for n, p in self.procs.items() if is_server(n)]
        seen = None if progress.latest is None else progress.latest["iter"]
        while time.monotonic() < deadline and any(p.poll() is None for p in servers):
            if self.elastic_from is not None:
                progress.read()
                if progress.latest is not None and progress.latest["iter"] != seen:
                    return  # a round after the failure: the run went on
            time.sleep(0.02)

    def _goes_on_without(self, failed: dict[str, int], progress) -> bool:
        """An elastic run loses the failed workers and goes on: training was under way (a
        round of this start recorded) and the servers went on, to the end (exit 0) or still
        serving the workers left."""
        progress.read()
        if self.elastic_from is None or any(is_server(n) for n in failed) \
                or progress.latest is None or progress.latest["iter"] < self.elastic_from:
            return False
        servers = [p.poll() for n, p in self.procs.items() if is_server(n)]
        workers_left = any(p.poll() is None for n, p in self.procs.items() if not is_server(n))
        if not (all(code == 0 for code in servers)
                or all(code in (None, 0) for code in servers) and workers_left):
            return False
        self._lose(failed)
        return True

    def _drop_already_lost(self, failed: dict[str, int], progress) -> dict[str, int]:
        """``failed`` less the workers an elastic run had already gone on without: the servers'
        newest round names the live ranks and theirs is not among them. A worker's exit can be
        reaped late, in the same poll as a server that failed long after it; by name the worker
        would come first and be taken for the cause."""
        live = None if progress.latest is None else progress.latest.get("live")
        if self.elastic_from is None or live is None:
            return failed
        gone = {n: c for n, c in failed.items()
                if n.startswith("rank-") and int(n[5:]) not in live}
        self._lose(gone)
        return {n: c for n, c in failed.items() if n not in gone}

    def _lose(self, failed: dict[str, int]) -> None:
        self.lost.update(failed)
        for name, code in sorted(failed.items()):
            self.say(f"\npsparse-launch: {name} exited with code {code}; --elastic: the run "
                     f"goes on without it\n{self.tail(name)}")

    def _worker_failures_within(self, seconds: float) -> dict[str, int]:
        """Workers that exit non-zero on their own within ``seconds`` (name -> code), but those
        an elastic run already went on without."""
        deadline = time.monotonic() + seconds
        while True:
            failed = {n: p.returncode for n, p in self.procs.items() if not is_server(n)
                      and n not in self.lost and p.poll() is not None and p.returncode != 0}
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

    def last_lines(self, name: str, lines: int = 1) -> list[str]:
        """The last non-empty lines of ``name``'s log."""
        try:
            text = (self.out / "logs" / f"{name}.log").read_text(errors="replace")
        except OSError:
            return []
        return [ln.strip() for ln in text.splitlines() if ln.strip()][-lines:]

    def tail(self, name: str, lines: int = 15) -> str:
        path = self.out / "logs" / f"{name}.log"
        try:
            text = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "\n".join(f"  {name}| {line}" for line in text)
