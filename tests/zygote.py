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
stops it and everything it started) that a test can signal by its pid as it would a Popen's.

Set ``PSPARSE_TEST_ZYGOTE=0`` to launch every run in a fresh interpreter instead.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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
    """Answer launch requests: fork a child for each, tell the client its pid, and once it
    exits its exit code (a thread per child, so that launches can run side by side)."""
    import numba  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        request = json.loads(_read_line(conn))
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            _child(request)  # never returns
        threading.Thread(target=_report, args=(conn, pid), daemon=True).start()


def _report(conn: socket.socket, pid: int) -> None:
    with conn:
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
    """The client end: ``start(args, ...)`` as ``subprocess.Popen(python -m psparse.launch
    ARGS)``, ``run(args, ...)`` as ``subprocess.run`` of it."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="psparse-zygote-"))
        self.address = str(self.folder / "socket")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.address)
        listener.listen(8)
        self.env_at_import = _read_at_import(dict(os.environ))
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(listener.fileno())], pass_fds=[listener.fileno()],
            stdin=subprocess.DEVNULL)
        listener.close()

    def start(self, args: list[str], *, env: dict | None = None, cwd=None,
              merge_stderr: bool = True):
        """The launch as a ``LaunchProcess`` (or a ``subprocess.Popen`` where the zygote cannot
        take it), its output captured: stderr into stdout when ``merge_stderr``."""
        env = dict(os.environ if env is None else env)
        argv = [sys.executable, "-m", "psparse.launch", *args]
        if _read_at_import(env) != self.env_at_import or self.proc.poll() is not None:
            # its own session too, so that a timeout stops it and what it started
            return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, cwd=cwd,
                                    stderr=subprocess.STDOUT if merge_stderr else
                                    subprocess.PIPE, start_new_session=True)
        return LaunchProcess(self, argv, env, cwd, merge_stderr)

    def run(self, args: list[str], *, env: dict | None = None, cwd=None,
            timeout: float | None = None) -> subprocess.CompletedProcess:
        proc = self.start(args, env=env, cwd=cwd, merge_stderr=False)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(proc.pid)
            proc.communicate()  # (a Popen's pipes drained)
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


class LaunchProcess:
    """A launch the zygote forked, with the part of ``subprocess.Popen``'s interface the tests
    use: ``pid``, ``args``, ``returncode``, ``poll``, ``wait``, ``communicate`` (stdout, and
    stderr unless merged; text), ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, zygote: Zygote, argv: list[str], env: dict, cwd, merge_stderr: bool):
        self.args, self.returncode = argv, None
        self.folder = Path(tempfile.mkdtemp(dir=zygote.folder))
        self.stdout_path = self.folder / "stdout"
        self.stderr_path = self.stdout_path if merge_stderr else self.folder / "stderr"
        request = {"args": argv[3:], "env": env, "cwd": str(Path(cwd or os.getcwd())),
                   "stdout": str(self.stdout_path), "stderr": str(self.stderr_path)}
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.connect(zygote.address)
        self.conn.sendall((json.dumps(request) + "\n").encode())
        self.received = b""  # the zygote's lines: the pid, then the exit code
        self.pid = int(self._line(None))
        self.merged = merge_stderr

    def _line(self, timeout: float | None) -> str | None:
        """The zygote's next line; None when none came within ``timeout`` (0: at once)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.received:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.conn], [], [], left)[0]:
                return None
            chunk = self.conn.recv(4096)
            if not chunk:
                raise ConnectionError("the zygote closed the connection before the launch ended")
            self.received += chunk
        line, self.received = self.received.split(b"\n", 1)
        return line.decode()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(line)
            self.conn.close()
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._line(0)
            if line is not None:
                self.returncode = int(line)
                self.conn.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            exc.output = self._read(self.stdout_path)
            raise
        out = self._read(self.stdout_path)
        err = None if self.merged else self._read(self.stderr_path)
        shutil.rmtree(self.folder, ignore_errors=True)
        return out, err

    @staticmethod
    def _read(path: Path) -> str:
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not to a pid the zygote has reaped (and may be reused)
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    time.sleep(0.1)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
