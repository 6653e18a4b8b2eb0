"""Server and workers on two network namespaces joined by a shaped veth pair (a real network
path, not loopback). Needs root and iproute2; skipped with the reason otherwise."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "launch" / "netns.sh"


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "iproute2 (ip, tc) not installed"
    probe = subprocess.run(["ip", "netns", "add", f"psprobe{os.getpid()}"], capture_output=True,
                           text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"psprobe{os.getpid()}"], check=False)
    return None


@pytest.fixture
def namespaces():
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    name = f"ps{os.getpid() % 100000}"
    up = subprocess.run(["bash", str(SCRIPT), "up", name, "50mbit"], capture_output=True,
                        text=True)
    assert up.returncode == 0, up.stderr
    server_ip, worker_ip = up.stdout.split()
    yield name, server_ip, worker_ip
    subprocess.run(["bash", str(SCRIPT), "down", name], check=False)


def in_ns(ns: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", ns, sys.executable, "-m", *cmd]


def test_training_across_two_namespaces_over_a_shaped_link(namespaces, tmp_path):
    name, server_ip, worker_ip = namespaces
    # the worker namespace has no loopback route to the server: only the veth pair
    server = subprocess.Popen(in_ns(f"{name}-srv", "psparse.server", "--bind", server_ip,
                                    "--port", "0", "--workers", "2", "--out", str(tmp_path),
                                    "--timeout", "60"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers = []
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "server.port").is_file():
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        port = (tmp_path / "server.port").read_text().strip()
        workers = [subprocess.Popen(in_ns(f"{name}-wrk", "psparse.worker", "--rank", str(r),
                                          "--workers", "2", "--model", "mlp", "--dataset",
                                          "digits", "--iterations", "30", "--connect",
                                          f"{server_ip}:{port}", "--out", str(tmp_path)),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                   for r in range(2)]
        outs = [w.communicate(timeout=180)[0] for w in workers]
        assert [w.returncode for w in workers] == [0, 0], outs
        server_out = server.communicate(timeout=60)[0]
        assert server.returncode == 0, server_out
    finally:
        for p in (server, *workers):
            if p.poll() is None:
                p.kill()
    assert "warning: binding" in server_out  # a non-loopback bind is flagged
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["iterations"] == 30
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
