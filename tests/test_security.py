"""CurveZMQ: encrypted traffic, only authorised worker keys accepted; loopback by default."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import zmq.auth
from conftest import python_module, read_jsonl, run_launch, start_launch
from test_server import Client

from psparse.wire import keyranges, protocol
from psparse.wire.transport import Channel, TransportTimeout


def make_keys(path, workers):
    r = subprocess.run(python_module("psparse.wire.keys", str(path), "--workers", str(workers)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return path


def test_keys_layout(tmp_path):
    keys = make_keys(tmp_path / "keys", 2)
    for name in ("server.key", "server.key_secret", "worker-0.key_secret", "worker-1.key",
                 "authorized/worker-0.key", "authorized/worker-1.key"):
        assert (keys / name).is_file(), name
    assert (keys / "worker-1.key_secret").stat().st_mode & 0o077 == 0  # secrets are private


def test_unauthorised_clients_are_refused_while_authorised_ones_work(tmp_path, server_factory):
    keys = make_keys(tmp_path / "keys", 1)
    server = server_factory(1, extra=("--curve-keys", str(keys)))
    refused([server.port], tmp_path / "strangers", keys)
    # the authorised worker registers and trains
    worker = Client(server.port, 0, 1, 1)
    worker.ch.close()
    worker.ch = Channel.client("127.0.0.1", server.port, curve_keys=keys, key_name="worker-0")
    worker.register()
    assert worker.recv().type == "ready"
    worker.push(0, [1, 2], [1.0, 2.0])
    assert worker.recv().indices.tolist() == [1, 2]
    worker.finish(0)
    assert server.wait()[0] == 0
    summary = json.loads((server.out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["rejected_messages"] == 0


def test_training_run_with_curve_keys(tmp_path):
    keys = make_keys(tmp_path / "keys", 2)
    r = run_launch("--out", str(tmp_path / "run"), "--quiet",
                   "--workers", "2", "--model", "mlp", "--dataset", "digits",
                   "--iterations", "20", "--curve-keys", str(keys), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "ok"


def test_user_script_run_with_curve_keys(tmp_path):
    """psparse.connect picks up the launcher's --curve-keys: encrypted, authorised workers."""
    keys = make_keys(tmp_path / "keys", 2)
    script = str(Path(__file__).resolve().parent / "user_train.py")
    r = run_launch("--out", str(tmp_path / "run"), "--quiet",
                   "--workers", "2", "--curve-keys", str(keys), script,
                   "--iterations", "10", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "ok"
    # a CurveZMQ server admits no plain client: the workers registered, so they used the keys
    assert json.loads((tmp_path / "run" / "config.json").read_text())["curve_keys"] == str(keys)


def refused(ports: list[int], strangers_dir: Path, keys: Path) -> None:
    """At every port, a client with a key the run never authorised and a plaintext one:
    whatever they send reaches nothing and nothing comes back (all sent first, then one wait)."""
    strangers_dir.mkdir()
    zmq.auth.create_certificates(str(strangers_dir), "stranger")
    shutil.copy(keys / "server.key", strangers_dir)  # the server's public key is no secret
    strangers = [c for port in ports for c in (
        Channel.client("127.0.0.1", port, curve_keys=strangers_dir, key_name="stranger"),
        Channel.client("127.0.0.1", port))]
    reg = dict(rank=0, world_size=2, checksum="c0", run=dict(
        numel=1000, iterations=1, two_phase=False, steps=[[0, 10, 10, 0]], config={}))
    for s in strangers:
        try:
            s.send(protocol.encode("register", **reg))
        except TransportTimeout:  # the handshake failed and ZeroMQ dropped the pipe
            pass
    for n, s in enumerate(strangers):
        assert s.recv(1.0 if n == 0 else 0.1) is None
        s.close(0)


def test_a_sharded_run_with_curve_keys_admits_only_its_workers(tmp_path):
    """--servers 2 --curve-keys: every shard is a CURVE server with the run's authorised keys.
    Strangers probing both shards mid-run reach neither; the run's results are those of the
    same run in plaintext (timing and bytes aside: CurveZMQ's framing is below the count).
    The curve run's links are paced (--bandwidth: sleeps, not CPU) so that 300 iterations
    outlast the probes."""
    keys = make_keys(tmp_path / "keys", 2)
    run = ["--quiet", "--workers", "2", "--servers", "2", "--model", "mlp", "--dataset",
           "digits", "--iterations", "300", "--seed", "3", "--policy", "vote"]
    plain = run_launch("--out", str(tmp_path / "plain"), *run, timeout=300)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    out = tmp_path / "curve"
    proc = start_launch("--out", str(out), *run, "--bandwidth", "600kbit",
                        "--curve-keys", str(keys))
    try:
        for i in range(2):
            shard = keyranges.shard_dir(out, i)
            deadline = time.monotonic() + 60
            while not ((shard / "metrics.jsonl").is_file() and (shard / "server.port").is_file()):
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
                time.sleep(0.02)
        refused([int((keyranges.shard_dir(out, i) / "server.port").read_text())
                 for i in range(2)], tmp_path / "strangers", keys)
        # the probes met a live run (not one that had ended, which answers nothing either)
        assert (out / "shard-1" / "metrics.jsonl").read_bytes().count(b"\n") < 300
        output = proc.communicate(timeout=300)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    for i in range(2):
        summary = json.loads((keyranges.shard_dir(out, i) / "summary.json").read_text())
        assert summary["status"] == "ok" and summary["rejected_messages"] == 0
    skip = ("round_s", "time_s", "upload_bytes", "broadcast_bytes", "shards")
    rows = [[{k: v for k, v in r.items() if k not in skip} for r in read_jsonl(d / "metrics.jsonl")]
            for d in (out, tmp_path / "plain")]
    assert len(rows[0]) == 300 and rows[0] == rows[1]


def test_non_loopback_bind_without_keys_warns(tmp_path):
    proc = subprocess.Popen(python_module("psparse.server", "--bind", "0.0.0.0", "--port", "0",
                                          "--workers", "1", "--register-timeout", "1", "--out",
                                          str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.communicate(timeout=60)[0]
    assert "warning: binding 0.0.0.0" in out and "--curve-keys" in out
