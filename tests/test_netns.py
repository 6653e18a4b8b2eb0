"""Server and workers on two network namespaces joined by a shaped veth pair (a real network
path, not loopback). Needs root and iproute2; skipped with the reason otherwise."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_restarts import assert_identical, restarted_once, wait_until_saved

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
        workers = [subprocess.Popen(in_ns(f"{name}-wrk", "psparse.training.loop", "--rank", str(r),
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


BULK = """
import socket, sys, time
mode, addr, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "recv":
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, 7777))
    s.listen(1)
    print("listening", flush=True)
    c, _ = s.accept()
    n, t0 = 0, None
    while True:
        b = c.recv(1 << 16)
        if not b:
            break
        if t0 is None:
            t0 = time.perf_counter()
        n += len(b)
    print(n, time.perf_counter() - t0, flush=True)
else:
    c = socket.create_connection((addr, 7777))
    c.sendall(b"x" * size)
    c.close()
"""


def bulk_mbit(rsh: list[str], src: str, dst: str, dst_addr: str, tmp_path) -> float:
    """Payload Mbit/s of one TCP bulk transfer from host src to host dst."""
    script = tmp_path / "bulk.py"
    script.write_text(BULK)
    recv = subprocess.Popen([*rsh, dst, f"{sys.executable} {script} recv {dst_addr} 0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert recv.stdout.readline().strip() == "listening"
        size = 3_000_000
        subprocess.run([*rsh, src, f"{sys.executable} {script} send {dst_addr} {size}"],
                       check=True, timeout=60)
        n, seconds = recv.communicate(timeout=60)[0].split()
    finally:
        if recv.poll() is None:
            recv.kill()
    assert int(n) == size
    return int(n) * 8 / float(seconds) / 1e6


@contextlib.contextmanager
def emulated_cluster(prefix: str, hosts: int, rate: str):
    """``launch/netns.sh cluster`` for the test's duration, removed after (the test is skipped,
    saying why, where namespaces cannot be made): its name, its hosts' addresses (h0's first)
    and the --rsh into its hosts."""
    reason = _netns_unavailable()
    if reason:
        print(f"skipped: {reason}")
        pytest.skip(reason)
    name = f"{prefix}{os.getpid() % 10000}"
    netns = ["bash", str(SCRIPT)]
    up = subprocess.run([*netns, "cluster", name, str(hosts), rate], capture_output=True,
                        text=True)
    try:
        assert up.returncode == 0, up.stderr
        yield name, up.stdout.split(), ["bash", str(SCRIPT.parent / "nsrsh.sh")]
    finally:
        subprocess.run([*netns, "down", name], check=False)


@pytest.mark.long
def test_emulated_cluster_trains_through_the_hostfile_launcher_and_shapes_every_link(tmp_path):
    """launch/netns.sh cluster: 3 hosts (server + 2 workers), each with its own 20 Mbit/s link
    and CPU share; psparse-launch --hostfile runs inside the server's host with the workers
    started through launch/nsrsh.sh; a bulk transfer in each direction of a link runs at the
    shaped rate (payload within 10%); `down` leaves nothing behind."""
    with emulated_cluster("pt", 3, "20mbit") as (name, addrs, rsh):
        assert len(addrs) == 3
        quota = Path(f"/sys/fs/cgroup/cpu/psparse-{name}-h1/cpu.cfs_quota_us")
        if quota.parent.is_dir():  # 2/3 of this machine's cores per host, per 10 ms
            assert int(quota.read_text()) == (os.cpu_count() or 1) * 10000 // 3
            # a worker started from inside h0 (where the launcher runs: `ip netns exec`
            # remounted /sys there) still lands in its own host's share, not h0's
            nested = subprocess.run(
                [*rsh, f"{name}-h0", shlex.join([*rsh, f"{name}-h2", "cat /proc/self/cgroup"])],
                capture_output=True, text=True, timeout=30)
            joined = dict(line.split(":", 2)[1:] for line in nested.stdout.splitlines())
            assert joined.get("cpu,cpuacct", joined.get("cpu", "")).endswith(
                f"/psparse-{name}-h2"), nested
            # and on its own CPU (a host's share of one core: see netns.sh on the slice)
            cpus = Path(f"/sys/fs/cgroup/cpuset/psparse-{name}-h2/cpuset.cpus")
            if cpus.parent.is_dir():
                assert cpus.read_text().strip() == str(2 % (os.cpu_count() or 1))
                assert joined["cpuset"].endswith(f"/psparse-{name}-h2"), nested
        # a host named by its address (--server-hosts names shard hosts so) is that host
        by_addr = subprocess.run([*rsh, addrs[2], "ip -4 -o addr show eth0"],
                                 capture_output=True, text=True, timeout=30)
        assert f" {addrs[2]}/" in by_addr.stdout, by_addr
        hostfile = tmp_path / "hosts"
        hostfile.write_text(f"{name}-h1 slots=1\n{name}-h2 slots=1\n")
        out = tmp_path / "run"
        launch = [sys.executable, "-m", "psparse.launch", "--out", str(out), "--quiet",
                  "--hostfile", str(hostfile), "--rsh", shlex.join(rsh), "--server-host",
                  addrs[0], "--bind", addrs[0], "--port", "5555", "--workers", "2", "--model",
                  "mlp", "--dataset", "digits", "--iterations", "20", "--threads", "1"]
        r = subprocess.run([*rsh, f"{name}-h0", f"cd {shlex.quote(os.getcwd())} && "
                            f"exec {shlex.join(launch)}"], capture_output=True, text=True,
                           timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        summary = json.loads((out / "summary.json").read_text())
        assert summary["status"] == "ok" and summary["iterations"] == 20
        config = json.loads((out / "config.json").read_text())
        assert set(config["provenance"]) >= {"git_commit", "git_dirty", "psparse_version"}
        # the workers really ran on the other hosts: their links carried the exchange
        for host in (f"{name}-h1", f"{name}-h2"):
            stats = json.loads(subprocess.run(["ip", "-n", host, "-s", "-j", "link", "show",
                                               "eth0"], capture_output=True, text=True,
                                              check=True).stdout)[0]["stats64"]
            assert stats["tx"]["bytes"] > 4000 and stats["rx"]["bytes"] > 4000
        # shaping: upload of h1 into the server host, and the server host's download to h2
        for src, dst, addr in ((f"{name}-h1", f"{name}-h0", addrs[0]),
                               (f"{name}-h0", f"{name}-h2", addrs[2])):
            mbit = bulk_mbit(rsh, src, dst, addr, tmp_path)
            assert abs(mbit - 20) / 20 < 0.10, f"{src} -> {dst}: {mbit:.2f} Mbit/s"
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{name}-" not in left
    assert not Path(f"/sys/fs/cgroup/cpu/psparse-{name}-h0").exists()
    assert not Path(f"/sys/fs/cgroup/cpuset/psparse-{name}-h0").exists()


@pytest.mark.long
def test_a_host_whose_link_is_down_longer_than_the_timeout_restarts_the_run(tmp_path):
    """launch/netns.sh cluster (server host h0, workers on h1 and h2): h1's switch port goes
    down for 8 s, longer than --timeout 5, then comes back. The server loses rank 0, the run
    fails, and --max-restarts starts it again (after a 5 s back-off: the link is back by
    then) from the newest checkpoint; it ends as a run over the same hosts that nothing
    disturbed."""
    with emulated_cluster("pf", 3, "50mbit") as (name, addrs, rsh):
        server_ip = addrs[0]
        (tmp_path / "hosts").write_text(f"{name}-h1 slots=1\n{name}-h2 slots=1\n")

        def launch(out: Path, *extra: str) -> subprocess.Popen:
            argv = [sys.executable, "-m", "psparse.launch", "--out", str(out), "--quiet",
                    "--hostfile", str(tmp_path / "hosts"), "--rsh", shlex.join(rsh),
                    "--server-host", server_ip, "--bind", server_ip, "--port", "5555",
                    "--workers", "2", "--model", "mlp", "--dataset", "digits", "--iterations",
                    "600", "--eval-every", "100", "--checkpoint-every", "100", "--seed", "4",
                    "--timeout", "5", "--threads", "1", *extra]
            return subprocess.Popen([*rsh, f"{name}-h0", f"cd {shlex.quote(os.getcwd())} && "
                                     f"exec {shlex.join(argv)}"], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)

        clean = launch(tmp_path / "clean")
        output = clean.communicate(timeout=300)[0]
        assert clean.returncode == 0, output
        out = tmp_path / "run"
        run = launch(out, "--max-restarts", "2", "--restart-backoff", "5")
        saved = [out / "checkpoint" / f"{who}-100.pt" for who in ("server", "rank-0", "rank-1")]
        wait_until_saved(run, saved)
        port = ["ip", "-n", f"{name}-sw", "link", "set", "p1"]  # h1's port on the switch
        subprocess.run([*port, "down"], check=True)
        time.sleep(8)
        subprocess.run([*port, "up"], check=True)
        output = run.communicate(timeout=300)[0]
        assert run.returncode == 0, output
    failed, resumed = restarted_once(out, output)
    assert "rank 0 stopped answering" in failed["error"] and resumed["resumed_from"] >= 100
    assert_identical(out, tmp_path / "clean", 2)
