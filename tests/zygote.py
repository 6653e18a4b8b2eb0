"""A warm start for the launches the tests make (``python -m psparse.launch ...``).

Each launch spends about 5 CPU-seconds importing torch, ``torch._dynamo`` and numba before it
does any work (docs/notes/bench-test-suite.md), and the suite makes a few hundred of them. The
zygote is one process per pytest process that imports those three once and forks a child for
each launch: the child takes the launch's environment, working directory and arguments, runs
``psparse.launch`` as ``python -m`` would, and exits with its code. psparse itself is imported
fresh in every child (its modules read the environment when they load), so a child differs from
a fresh interpreter only in the third-party modules already in memory. A launch whose
environment changes what those modules read when they load (the float-kernel caps, thread
counts) is not sent to the zygote: ``run`` starts a real interpreter for it.

Everything else stays real: the launcher forks its servers and workers as it always does, they
talk over real sockets, and the child is a process of its own (its own session, so a timeout
stops it and everything it started).

Set ``PSPARSE_TEST_ZYGOTE=0`` to launch every run in a fresh interpreter instead.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# variables that the pre-imported modules read when they load: a launch that sets one of them
# differently from the zygote's own environment gets a fresh interpreter
READ_AT_IMPORT = ("ONEDNN_", "DNNL_", "ATEN_CPU_CAPABILITY", "MKL_", "OMP_", "KMP_", "NUMBA_",
                  "TORCH_", "PYTORCH_", "LD_", "CUDA_")


def _read_at_import(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_IMPORT)}


# ---------------------------------------------------------------------------------- the zygote
def serve(listener: socket.socket) -> None:
    """Answer launch requests one at a time, until the client closes the listening socket's
    peer end (the pytest process exits)."""
    import numba  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            request = json.loads(_read_line(conn))
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                _child(request)  # never returns
            try:
                conn.sendall(f"{pid}\n".encode())
            except OSError:  # the client is gone (a timeout): the child is its to stop
                pass
            _, status = os.waitpid(pid, 0)
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass


def _child(request: dict) -> None:
    code = 1
    try:
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # sys.path as ``python -m`` builds it: the working directory, then PYTHONPATH (not the
        # zygote's own folder, tests/, whose modules a launch must not find by accident)
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:1] = [request["cwd"], *extra]
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(target, fd)
            os.close(target)
        sys.argv = ["psparse-launch", *request["args"]]
        from psparse.launch.cli import main
        code = main(request["args"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code or 0)


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("the zygote's peer closed the connection")
        data += chunk
    return data.decode()


# ---------------------------------------------------------------------------------- the client
class Zygote:
    """The client end: ``run(args, ...)`` as ``subprocess.run(python -m psparse.launch ARGS)``."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="psparse-zygote-"))
        self.address = str(self.folder / "socket")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.address)
        listener.listen(1)
        self.env_at_import = _read_at_import(dict(os.environ))
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(listener.fileno())], pass_fds=[listener.fileno()],
            stdin=subprocess.DEVNULL)
        listener.close()

    def run(self, args: list[str], *, env: dict | None = None, cwd=None,
            timeout: float | None = None) -> subprocess.CompletedProcess:
        env = dict(os.environ if env is None else env)
        argv = [sys.executable, "-m", "psparse.launch", *args]
        if _read_at_import(env) != self.env_at_import or self.proc.poll() is not None:
            return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd,
                                  timeout=timeout)
        with tempfile.TemporaryDirectory(dir=self.folder) as tmp:
            stdout, stderr = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"args": list(args), "env": env, "cwd": str(Path(cwd or os.getcwd())),
                       "stdout": str(stdout), "stderr": str(stderr)}
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(self.address)
                conn.sendall((json.dumps(request) + "\n").encode())
                reader = conn.makefile("r")
                pid = int(reader.readline())
                conn.settimeout(timeout)
                try:
                    code = int(reader.readline())
                except TimeoutError:
                    _kill_session(pid)
                    raise subprocess.TimeoutExpired(argv, timeout, stdout.read_text(),
                                                    stderr.read_text()) from None
            return subprocess.CompletedProcess(argv, code, stdout.read_text(errors="replace"),
                                               stderr.read_text(errors="replace"))

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        for leftover in self.folder.glob("*"):
            leftover.unlink(missing_ok=True)
        self.folder.rmdir()


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    time.sleep(0.1)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
