"""The launcher's child processes: forked ones (torch already imported) and piped ones (ssh, srun).

The launcher's processes: children forked from it (torch already imported: a fresh
interpreter spends ~6 CPU-seconds importing torch, which for 8 workers on 2 cores is ~25 s of
start-up) and local client processes (ssh, srun) whose output is piped. Every child dies with
the launcher, even a launcher killed with SIGKILL."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child: get SIGTERM when the launcher dies, even if it is killed with SIGKILL."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the workers' own timeouts still end them


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_taken(bind: str, port: int) -> str | None:
    """Why a server could not listen on bind:port (e.g. "Address already in use"), or None.
    With SO_REUSEADDR, as ZeroMQ binds: a port that the previous attempt's closed sockets
    leave in TIME_WAIT is free, one that a socket listens on is not."""
    with socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


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
        die_with_parent()
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


def piped(argv: list[str], log_path: Path, prefix: str, quiet: bool,
          env: dict | None = None) -> subprocess.Popen:
    """A local client process (ssh, srun) whose output goes to the log and, prefixed, here."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
                            env={**os.environ, **env} if env else None)
    log = open(log_path, "wb")

    def pump():
        with log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if not quiet:
                    sys.stdout.write(prefix + line.decode(errors="replace"))
                    sys.stdout.flush()

    threading.Thread(target=pump, daemon=True).start()
    return proc


def run_script(argv: list[str]) -> int:
    """Run a user script as ``python TRAIN.PY ARGS`` would, in this (forked) process: its
    folder first on sys.path, ``__name__ == "__main__"``; its exit code."""
    import runpy

    script = Path(argv[0])
    sys.argv = [str(script), *argv[1:]]
    sys.path.insert(0, str(script.resolve().parent))
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)  # sys.exit("message"), as python prints it
            code = 1
    except BaseException as exc:
        _sessions_left_open(exc)  # its cause, not "connection closed", reaches summary.json
        raise
    problem = _sessions_left_open(None if code == 0 else f"the script exited with code {code}")
    if problem:
        print(f"psparse: error: {problem}", file=sys.stderr, flush=True)
        return code or 1
    return code


def _sessions_left_open(cause):
    """psparse.worker.lifecycle.end_of_script for a script that used psparse (the fork exits with
    os._exit, which skips the atexit hook that does it otherwise)."""
    lifecycle = sys.modules.get("psparse.worker.lifecycle")
    return lifecycle.end_of_script(cause) if lifecycle is not None else None


def writer_of(log: Path) -> int | None:
    """The pid of a live local process whose standard output is ``log`` (a forked child writes
    to logs/<name>.log): how a test or benchmark finds rank R's process of a run to stop it."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "fd" / "1") == str(log):
                    return int(entry.name)
            except OSError:
                continue
    return None
