"""Shared fixtures: where the real data sets are, and real server processes on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def data_dir() -> Path:
    """../shared/data when present (developers, CI), else $PSPARSE_DATA / ./data (make data)."""
    for d in (REPO.parent / "shared" / "data", Path(os.environ.get("PSPARSE_DATA", "")),
              REPO / "data"):
        if str(d) and (d / "mnist").is_dir():
            return d
    pytest.fail("MNIST not found: run `make data` (tests need the real data set)")


_zygote = None


def zygote():
    """This pytest process's warm zygote (tests/zygote.py: torch, numba imported once), or None
    with PSPARSE_TEST_ZYGOTE=0 (every launch a fresh interpreter)."""
    global _zygote
    if os.environ.get("PSPARSE_TEST_ZYGOTE", "1") == "0":
        return None
    if _zygote is None:
        from zygote import Zygote
        _zygote = Zygote()
    return _zygote


def run_launch(*args: str, env: dict | None = None, cwd=None,
               timeout: float | None = 300) -> subprocess.CompletedProcess:
    """``python -m psparse.launch ARGS`` to its end, its output captured, as ``subprocess.run``
    would, through the zygote."""
    z = zygote()
    if z is None:
        return subprocess.run(python_module("psparse.launch", *args), capture_output=True,
                              text=True, env=env, cwd=cwd, timeout=timeout)
    return z.run(list(args), env=env, cwd=cwd, timeout=timeout)


def start_launch(*args: str, env: dict | None = None, cwd=None):
    """``python -m psparse.launch ARGS`` started, as ``subprocess.Popen`` with stdout piped,
    stderr into it and text would, through the zygote: ``pid``, ``poll``, ``wait``,
    ``communicate``, ``send_signal``, ``kill`` work as a Popen's."""
    z = zygote()
    if z is None:
        return subprocess.Popen(python_module("psparse.launch", *args), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    return z.start(list(args), env=env, cwd=cwd)


def pytest_sessionfinish(session):
    if _zygote is not None:
        _zygote.close()


def float_kernels_line() -> str:
    """The float kernels this run's processes take (bf16 autocast's differ on CPUs with AMX /
    AVX512-BF16): a floor that fails is read against them."""
    from psparse.provenance import float_kernels
    k = float_kernels()
    return (f"float kernels: ONEDNN_MAX_CPU_ISA={k['onednn_max_cpu_isa']}, torch capability "
            f"{k['torch_capability']}, oneDNN {k['onednn_isa']}")


def pytest_terminal_summary(terminalreporter):
    """At the end of every run, -q included (the header is not printed under -q)."""
    terminalreporter.write_line(float_kernels_line())


@pytest.fixture(scope="session")
def data_root() -> Path:
    return data_dir()


def python_module(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


class ServerProcess:
    """A real psparse-server process on a free loopback port."""

    def __init__(self, out: Path, workers: int, timeout: float = 20.0, extra=()):
        self.out = out
        self.proc = subprocess.Popen(
            python_module("psparse.server", "--workers", str(workers), "--port", "0", "--out",
                          str(out), "--timeout", str(timeout), *extra),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 30
        port_file = out / "server.port"
        while not port_file.is_file():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {self.proc.communicate()[0]}")
            time.sleep(0.02)
        self.port = int(port_file.read_text())

    def wait(self, timeout: float = 30) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()

    def metrics(self) -> list[dict]:
        return read_jsonl(self.out / "metrics.jsonl")


def read_jsonl(path: Path) -> list[dict]:
    """The whole records of a JSON-lines file: a test may read one a live run is writing, whose
    last line can be half written (psparse.rundir.read_jsonl drops it the same way)."""
    text = path.read_text()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()
            if line.strip()]


@pytest.fixture
def server_factory(tmp_path):
    started: list[ServerProcess] = []

    def start(workers: int, **kw) -> ServerProcess:
        s = ServerProcess(tmp_path / f"server{len(started)}", workers, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()


def descendants(pid: int) -> list[int]:
    """All live descendant pids of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # comm may hold spaces/parens: the fields after the last ')' are fixed
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="session", autouse=True)
def compiled_kernels():
    """Compile (or load) every CPU kernel once, before any test starts a process: the servers
    and workers the tests start then load them from numba's cache (psparse/ops/jit.py) instead of
    each compiling them (tens of seconds on a machine whose cache is empty)."""
    from psparse.ops import jit
    jit.warm_up()
