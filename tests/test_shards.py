"""Key-range server shards (--servers S, psparse-server --shard I/S): real server and worker
processes on loopback. The same run gives the same results with 1 and 3 shards, timing and
bytes aside; the per-shard bytes add up to the totals; a sharded run resumes from its
checkpoints; bad values and features that do not work with shards yet are refused clearly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from conftest import python_module, read_jsonl, run_launch, start_launch

from psparse.config import RunConfig
from psparse.launch import cluster
from psparse.wire import keyranges, protocol

RUN = ["--workers", "3", "--model", "mlp", "--dataset", "digits", "--iterations", "40",
       "--eval-every", "10", "--seed", "1", "--quiet"]
# what may differ between shard counts: timing, the bytes on the wire (one header per shard),
# and the per-shard breakdown itself
NOT_COMPARED = ("round_s", "time_s", "upload_bytes", "broadcast_bytes", "shards")
FAKE_RSH = Path(__file__).resolve().parent / "fake_rsh.sh"


def launch(out: Path, *args, timeout=300) -> subprocess.CompletedProcess:
    return run_launch("--out", str(out), *args, timeout=timeout)


def comparable(rows):
    return [{k: v for k, v in r.items() if k not in NOT_COMPARED} for r in rows]


def check_shard_bytes(run: Path, shards: int) -> None:
    """Per-shard bytes (merged metrics.jsonl's "shards", the shards' own files, summary) sum to
    the totals, and the servers' counts equal what the workers counted."""
    merged = read_jsonl(run / "metrics.jsonl")
    own = [read_jsonl(keyranges.shard_dir(run, i) / "metrics.jsonl") for i in range(shards)]
    for t, rec in enumerate(merged):
        assert len(rec["shards"]) == shards
        for key in ("upload_bytes", "broadcast_bytes", "union"):
            assert rec[key] == sum(s[key] for s in rec["shards"]), (t, key)
            assert [s[key] for s in rec["shards"]] == [o[t][key] for o in own], (t, key)
    ranks = [json.loads((run / f"rank-{r}.json").read_text()) for r in range(3)]
    assert sum(r["push_bytes"] for r in ranks) == sum(m["upload_bytes"] for m in merged)
    assert sum(r["aggregate_bytes"] for r in ranks) == sum(m["broadcast_bytes"] for m in merged)
    summary = json.loads((run / "summary.json").read_text())
    assert [s["shard"] for s in summary["shards"]] == list(range(shards))
    assert summary["upload_mb"] == pytest.approx(sum(s["upload_mb"] for s in summary["shards"]))
    assert summary["upload_mb"] == pytest.approx(sum(m["upload_bytes"] for m in merged) / 1e6,
                                                 abs=1e-3)
    ranges = [s["key_range"] for s in summary["shards"]]
    assert ranges[0][0] == 0 and ranges[-1][1] == summary["numel"]
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, in order


@pytest.mark.parametrize("policy", ["topk", "core", "vote", "cltk", "exdyna"])
def test_results_are_identical_with_1_and_3_server_shards(tmp_path, policy):
    """Three shards cut the 2,410 parameters unevenly (803, 803 and 804 keys) and give a middle
    shard that touches neither end; two shards run in tests/test_identical_runs.py and in
    the resume and hostfile tests below."""
    runs = {}
    for shards in (1, 3):
        runs[shards] = tmp_path / f"s{shards}"
        r = launch(runs[shards], *RUN, "--policy", policy, "--servers", str(shards))
        assert r.returncode == 0, r.stdout + r.stderr
    one = runs[1]
    for shards in (3,):
        run = runs[shards]
        assert comparable(read_jsonl(run / "metrics.jsonl")) == \
            comparable(read_jsonl(one / "metrics.jsonl")), shards
        assert comparable(read_jsonl(run / "eval.jsonl")) == \
            comparable(read_jsonl(one / "eval.jsonl")), shards
        for r in range(3):  # bit-identical final weights and policy state
            a = json.loads((run / f"rank-{r}.json").read_text())
            b = json.loads((one / f"rank-{r}.json").read_text())
            assert (a["checksum"], a["policy_state"]) == (b["checksum"], b["policy_state"])
        sa = json.loads((run / "summary.json").read_text())
        sb = json.loads((one / "summary.json").read_text())
        for key in ("status", "numel", "k", "iterations", "union_over_k_mean",
                    "union_over_k_max", "pushed_k_mean", "final_loss", "test_acc", "dense_mb"):
            assert sa[key] == pytest.approx(sb[key]), key
        check_shard_bytes(run, shards)
        if policy in ("vote", "cltk"):  # two-phase: the proposal counts add up too
            assert all(m["proposed"] is not None for m in read_jsonl(run / "metrics.jsonl"))


@pytest.mark.long
def test_a_sharded_run_resumes_from_its_checkpoints(tmp_path):
    run = ["--workers", "3", "--model", "mlp", "--dataset", "digits", "--iterations", "400",
           "--eval-every", "50", "--checkpoint-every", "100", "--seed", "4", "--quiet",
           "--servers", "2", "--policy", "vote", "--server-limit", "1.5k"]
    whole = launch(tmp_path / "whole", *run)
    assert whole.returncode == 0, whole.stdout + whole.stderr

    cut = tmp_path / "cut"
    proc = start_launch("--out", str(cut), *run)
    deadline = time.monotonic() + 120
    while not (all((keyranges.shard_dir(cut, i) / "checkpoint" / "server-200.pt").is_file()
                   for i in range(2))
               # complete lines only: the shard may be writing the next one right now
               and (keyranges.shard_dir(cut, 0) / "metrics.jsonl").read_bytes().count(b"\n")
               >= 230):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)  # stop everything mid-run
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert len(read_jsonl(keyranges.shard_dir(cut, 0) / "metrics.jsonl")) < 400

    resumed = launch(cut, "--resume", str(cut), "--quiet")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    for i in range(2):
        assert "resumed at iteration 200" in (cut / "logs" / f"server-{i}.log").read_text()
    for name in ("metrics.jsonl", "eval.jsonl"):
        assert comparable(read_jsonl(cut / name)) == \
            comparable(read_jsonl(tmp_path / "whole" / name)), name
    for r in range(3):
        a = json.loads((cut / f"rank-{r}.json").read_text())
        b = json.loads((tmp_path / "whole" / f"rank-{r}.json").read_text())
        assert a["checksum"] == b["checksum"] and a["push_bytes"] == b["push_bytes"]
    sa = json.loads((cut / "summary.json").read_text())
    sb = json.loads((tmp_path / "whole" / "summary.json").read_text())
    for key in ("union_over_k_mean", "upload_mb", "broadcast_mb", "test_acc", "server_limit",
                "shards"):
        assert sa[key] == sb[key], key


def _start_shard(out: Path, index: int, count: int, workers: int = 2, *extra):
    proc = subprocess.Popen(python_module(
        "psparse.server", "--workers", str(workers), "--port", "0", "--out", str(out),
        "--shard", f"{index}/{count}", "--timeout", "20", *extra),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    port_file = keyranges.shard_dir(out, index) / "server.port"
    deadline = time.monotonic() + 30
    while not port_file.is_file():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.02)
    return proc, int(port_file.read_text())


@pytest.mark.long
def test_shards_started_by_hand_write_the_merged_run_files(tmp_path):
    """psparse-server --shard I/S by hand, psparse-worker --connect with every shard's address:
    the last shard to finish writes the run's merged metrics.jsonl and summary.json."""
    servers = [_start_shard(tmp_path, i, 2) for i in range(2)]
    try:
        connect = ",".join(f"127.0.0.1:{port}" for _, port in servers)
        workers = [subprocess.Popen(python_module(
            "psparse.training.loop", "--rank", str(r), "--workers", "2", "--model", "mlp",
            "--dataset", "digits", "--iterations", "10", "--connect", connect, "--out",
            str(tmp_path)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(2)]
        outs = [w.communicate(timeout=120)[0] for w in workers]
        assert [w.returncode for w in workers] == [0, 0], outs
        assert [p.wait(timeout=30) for p, _ in servers] == [0, 0]
    finally:
        for p, _ in servers:
            if p.poll() is None:
                p.kill()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "ok" and len(summary["shards"]) == 2
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 10
    # psparse-report shows the per-shard bytes, merging the shards' files itself if needed
    (tmp_path / "summary.json").unlink()
    (tmp_path / "metrics.jsonl").unlink()
    r = subprocess.run(python_module("psparse.analysis.report", str(tmp_path), "--no-plots",
                                     "--out", str(tmp_path / "report")),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "per server shard" in r.stdout and "#1 [" in r.stdout
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    rows = json.loads((tmp_path / "report" / "report.json").read_text())
    assert [x["shard"] for x in rows[0]["shards"]] == [0, 1]


def test_a_shard_refuses_registers_meant_for_another_or_for_no_shard(tmp_path):
    proc, port = _start_shard(tmp_path, 1, 2, workers=1)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        def answer(**fields):
            sock.send_multipart(protocol.encode("register", rank=0, world_size=1, **fields))
            while True:  # skip the server's heartbeats
                assert sock.poll(10_000), "no answer from the server"
                header = msgpack.unpackb(sock.recv_multipart()[0])
                if header["type"] != "heartbeat":
                    return header

        reply = answer()
        assert reply["type"] == "error" and "must carry shard [1, 2]" in reply["message"]
        reply = answer(shard=[0, 2])
        assert reply["type"] == "error" and "this server is shard 1 of 2" in reply["message"]
        reply = answer(shard=[2, 2])
        assert reply["type"] == "error" and "0 <= I < S" in reply["message"]
    finally:
        sock.close()
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("args, message", [
    (["--shard", "2/2"], "the shard index I must be in 0..1"),
    (["--shard", "0/0"], "the number of shards S must be at least 1"),
    (["--shard", "two"], "expected I/S"),
])
def test_bad_shard_values_are_refused_by_the_server(tmp_path, args, message):
    r = subprocess.run(python_module("psparse.server", "--workers", "2", "--port", "0",
                                     "--out", str(tmp_path), *args),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr


@pytest.mark.parametrize("args, message", [
    (["--servers", "0"], "servers must be >= 1"),
    (["--servers", "3", "--server-hosts", "workers", "--hostfile", "HOSTS"],
     "places one shard on each of the 2 worker hosts, but --servers is 3"),
    (["--server-hosts", "workers", "--hostfile", "HOSTS", "--shard-edges", "10"],
     "--shard-edges needs --servers S with S >= 2"),  # (its count of edges needs S given)
    (["--servers", "2", "--baseline", "ddp"], "--servers does not apply"),
    (["--servers", "3", "--shard-edges", "100"], "expected 2 strictly increasing keys"),
    (["--servers", "3", "--shard-edges", "900,100"], "expected 2 strictly increasing keys"),
    (["--shard-edges", "100"], "--shard-edges needs --servers S with S >= 2"),
])
def test_bad_servers_values_are_refused_by_the_launcher(tmp_path, args, message):
    (tmp_path / "hosts").write_text("localhost slots=2\n127.0.0.1 slots=2\n")
    args = [str(tmp_path / "hosts") if a == "HOSTS" else a for a in args]
    r = launch(tmp_path / "run", *RUN, *args, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()  # nothing started


def test_a_worker_needs_every_shards_address(tmp_path):
    r = subprocess.run(python_module("psparse.training.loop", "--rank", "0", "--workers", "1",
                                     "--model", "mlp", "--dataset", "digits", "--servers", "2",
                                     "--connect", "127.0.0.1:1"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "2 server shards (--servers) but this worker was given 1 server address" in r.stderr


@pytest.mark.parametrize("placed", [pytest.param(None, marks=pytest.mark.long),
                                    pytest.param("localhost,127.0.0.1", marks=pytest.mark.long), "workers"],
                         ids=["shards-here", "server-hosts", "beside-workers"])
def test_hostfile_launch_with_two_server_shards(tmp_path, placed):
    """--hostfile through the fake remote shell: the shards listen at PORT and PORT + 1, here
    or (--server-hosts) started through the remote shell on the named hosts, or on each
    worker host (--server-hosts workers, which sets --servers to their number); the workers
    get both addresses on their command line."""
    (tmp_path / "hosts").write_text("localhost slots=2\n127.0.0.1 slots=1\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "FAKE_RSH_LOG": str(tmp_path / "rsh.log")}
    where = ["--server-hosts", placed] if placed else []
    servers = [] if placed == "workers" else ["--servers", "2"]
    r = subprocess.run(python_module(
        "psparse.launch", "--out", str(tmp_path / "run"), "--hostfile", str(tmp_path / "hosts"),
        "--rsh", f"bash {FAKE_RSH}", "--server-host", "127.0.0.1", "--bind", "127.0.0.1",
        "--port", str(port), "--workers", "3", "--model", "mlp", "--dataset", "digits",
        "--iterations", "20", "--timeout", "20", *servers, *where),
        capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = [line.split("\t") for line in (tmp_path / "rsh.log").read_text().splitlines()]
    servers = [c for c in calls if "psparse.server" in c[1]]
    workers = [c for c in calls if "psparse.training.loop" in c[1]]
    assert len(workers) == 3
    if placed:
        assert [(h, f"--shard {i}/2" in c) for i, (h, c) in enumerate(servers)] == \
            [("localhost", True), ("127.0.0.1", True)]
        assert all(f"--port {port + i}" in c for i, (_, c) in enumerate(servers))
        connect = f"localhost:{port},127.0.0.1:{port + 1}"
    else:
        assert not servers
        connect = f"127.0.0.1:{port},127.0.0.1:{port + 1}"
    assert all(connect in c for _, c in workers)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and len(summary["shards"]) == 2
    assert "broadcast (server)" in r.stdout and "server shard 1" in r.stdout  # summary table


def test_server_hosts_needs_a_cluster_mode_and_one_host_per_shard(tmp_path):
    r = launch(tmp_path / "run", *RUN, "--servers", "2", "--server-hosts", "a,b", timeout=60)
    assert r.returncode == 2 and "use it with --hostfile or --slurm" in r.stderr, r.stderr
    (tmp_path / "hosts").write_text("localhost slots=3\n")
    r = launch(tmp_path / "run", *RUN, "--servers", "2", "--server-hosts", "a",
               "--hostfile", str(tmp_path / "hosts"), timeout=60)
    assert r.returncode == 2 and "names 1 host(s) for 2 server shard(s)" in r.stderr, r.stderr


@pytest.mark.long
def test_a_user_script_runs_with_server_shards(tmp_path):
    """psparse.connect reads every shard's address from PSPARSE_SERVER; same weights as one
    server."""
    script = str(Path(__file__).resolve().parent / "user_train.py")
    checksums = []
    for shards in (1, 2):
        r = launch(tmp_path / f"s{shards}", "--workers", "2", "--policy", "vote", "--servers",
                   str(shards), "--quiet", script, "--iterations", "15")
        assert r.returncode == 0, r.stdout + r.stderr
        checksums.append(json.loads((tmp_path / f"s{shards}" / "rank-0.json").read_text())
                         ["checksum"])
    assert checksums[0] == checksums[1]


def test_slurm_workers_get_every_shards_address():
    cfg = RunConfig(workers=4, servers=2).validate()
    cmd = cluster.srun_command(cfg, "node-a:5555,node-a:5556", "/runs/x")
    assert cmd[cmd.index("--connect") + 1] == "node-a:5555,node-a:5556"
    assert cmd[cmd.index("--servers") + 1] == "2"


def test_key_ranges_split_and_cover_the_vector():
    edges = keyranges.bounds(10, 4)
    assert edges.tolist() == [0, 2, 5, 7, 10]  # [i * numel // S]: sizes within one entry
    indices = np.array([0, 1, 4, 5, 9])
    parts = [indices[s].tolist() for s in keyranges.split_sorted(indices, edges)]
    assert parts == [[0, 1], [4], [5], [9]]
    with pytest.raises(ValueError, match="every shard needs at least one"):
        keyranges.bounds(3, 4)


def test_balanced_edges_split_the_load_into_equal_parts():
    load = np.array([8, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1])  # 16: half of it on the first key
    assert keyranges.balanced_edges(load, 2) == [1]  # [0, 1) holds 8, [1, 12) the other 8
    # the heavy key alone, then the other 8 over three shards (3, 2, 3: the closest to 8/3)
    assert keyranges.balanced_edges(load, 4) == [1, 7, 9]
    assert keyranges.balanced_edges(np.ones(12), 4) == [3, 6, 9]
    assert keyranges.balanced_edges(np.zeros(6), 3) == [2, 4]  # no load: equal sizes
    assert keyranges.balanced_edges(np.array([0, 0, 0, 9]), 3) == [2, 3]  # never empty
    assert keyranges.bounds(12, 4, [1, 8, 10]).tolist() == [0, 1, 8, 10, 12]
    with pytest.raises(ValueError, match="do not split a model of 12 entries into 3"):
        keyranges.bounds(12, 3, [5, 12])
    assert keyranges.bounds(12, 1, []).tolist() == [0, 12]  # a run's shard_edges [0, numel]
    with pytest.raises(ValueError, match="into 2 non-empty key ranges"):
        keyranges.bounds(12, 2, [])  # a run's [0, numel] at a shard of 2: a clear refusal


def test_shard_edges_from_recorded_selections_balance_the_shards_and_change_no_result(tmp_path):
    """psparse-locality --shards 3 proposes --shard-edges from a one-server run's recorded
    pushes; on 3 shards with them the run equals the one-server run (the shards hold the ranges
    named) and its busiest shard carries less of the bytes than with equal ranges."""
    run = [*RUN, "--policy", "topk"]
    one = tmp_path / "one"
    r = launch(one, *run, "--record-selections")
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(python_module("psparse.analysis.locality", str(one), "--shards", "3"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--shard-edges" in r.stdout, r.stdout + r.stderr
    split = json.loads((one / "locality.json").read_text())["shard_split"]
    edges = split["shard_edges"]
    assert split["busiest_share_balanced"] < split["busiest_share_equal"]
    busiest = {}
    for name, extra in (("equal", []), ("balanced", ["--shard-edges", ",".join(map(str, edges))])):
        r = launch(tmp_path / name, *run, "--servers", "3", *extra)
        assert r.returncode == 0, r.stdout + r.stderr
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        loads = [s["upload_mb"] + s["broadcast_mb"] for s in summary["shards"]]
        busiest[name] = max(loads) / sum(loads)
        assert comparable(read_jsonl(tmp_path / name / "metrics.jsonl")) == \
            comparable(read_jsonl(one / "metrics.jsonl")), name
    assert [s["key_range"] for s in summary["shards"]] == \
        [[0, edges[0]], [edges[0], edges[1]], [edges[1], summary["numel"]]]
    assert busiest["balanced"] < busiest["equal"], busiest


@pytest.mark.long
def test_a_client_written_from_the_spec_joins_a_sharded_run(tmp_path):
    """docs/protocol.md, Server shards: a client built on tests/test_conformance.py's SpecWorker
    (pyzmq, msgpack, numpy; nothing from psparse) registers with both shards naming each, splits
    its pushes and proposals by key range in shard-relative indices, keeps the group's indices
    from both shards' candidates, beside a real psparse-worker."""
    from test_conformance import SpecWorker

    class ShardWorker(SpecWorker):
        def __init__(self, *args, shard, **kw):
            super().__init__(*args, **kw)
            self.shard = shard

        def send(self, header, *frames):
            if header["type"] == "register":
                header = {**header, "shard": list(self.shard)}
            super().send(header, *frames)

        def check(self, frames):
            h = msgpack.unpackb(frames[0], raw=False)
            if h.get("type") == "candidates":  # header, indices, scores
                assert len(frames) == 3 and set(h) <= {"v", "type", "iter", "count",
                                                       "index_dtype", "value_dtype",
                                                       "index_format"}, h
                return h
            return super().check(frames)

    for policy in ("topk", "vote"):
        out = tmp_path / policy
        servers = [_start_shard(out, i, 2) for i in range(2)]
        connect = ",".join(f"127.0.0.1:{port}" for _, port in servers)
        real = subprocess.Popen(python_module(
            "psparse.training.loop", "--rank", "1", "--workers", "2", "--model", "mlp", "--dataset",
            "digits", "--iterations", "12", "--density", "0.05", "--policy", policy,
            "--connect", connect, "--out", str(out), "--servers", "2", "--timeout", "20"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        shards = [ShardWorker(f"tcp://127.0.0.1:{port}", rank=0, world=2, token=None,
                              shard=(i, 2)) for i, (_, port) in enumerate(servers)]
        try:
            readies = [w.join() for w in shards]
            numel = readies[0]["run"]["numel"]
            edges = [i * numel // 2 for i in range(3)]  # shard I: [I*numel//S, (I+1)*numel//S)
            for i, w in enumerate(shards):
                w.numel = edges[i + 1] - edges[i]  # a shard's indices are relative to its range
            acc = np.random.default_rng(0).normal(0, 1e-3, numel).astype(np.float32)
            for t in range(shards[0].iterations):
                _, push_max, propose_max = shards[0].step(t)
                if shards[0].two_phase:
                    prop = np.sort(np.argsort(-np.abs(acc), kind="stable")[:propose_max])
                    for i, w in enumerate(shards):
                        part = prop[(prop >= edges[i]) & (prop < edges[i + 1])]
                        w.send_indexed("propose", t, part - edges[i], acc[part])
                    keys, scores = [], []
                    for i, w in enumerate(shards):
                        h, frames = w.recv({"candidates"})
                        keys.append(w.decode_indices(h, frames[1]) + edges[i])
                        scores.append(np.frombuffer(frames[2], "<f4"))
                    keys, scores = np.concatenate(keys), np.concatenate(scores)
                    # the push_max of largest score, ties to the lower key (stable sort)
                    top = np.sort(keys[np.argsort(-scores, kind="stable")[:push_max]])
                else:
                    top = np.sort(np.argsort(-np.abs(acc), kind="stable")[:push_max])
                for i, w in enumerate(shards):
                    part = top[(top >= edges[i]) & (top < edges[i + 1])]
                    w.send_indexed("push", t, part - edges[i], acc[part])
                acc[top] = 0.0
                for w in shards:
                    h, _ = w.recv({"aggregate"})
                    assert h["iter"] == t and h["workers"] == 2
            assert all(w.finish()["ok"] for w in shards)
            assert real.wait(timeout=60) == 0, real.communicate()[0]
            assert [p.wait(timeout=30) for p, _ in servers] == [0, 0]
        finally:
            for w in shards:
                w.close()
            for p in [real, *(p for p, _ in servers)]:
                if p.poll() is None:
                    p.kill()
        summary = json.loads((out / "summary.json").read_text())
        # SpecWorker sends one heartbeat with a wrong token on purpose, to each shard
        assert summary["status"] == "ok" and summary["rejected_messages"] == 2, summary
        merged = read_jsonl(out / "metrics.jsonl")
        assert len(merged) == 12 and all(m["workers"] == 2 for m in merged)
        if policy == "vote":  # both workers kept the same group: the union is exactly k
            assert all(m["union"] == m["budget"] for m in merged), merged


def test_merged_aggregate_is_dense_when_a_shard_went_dense():
    """A shard that sent its part dense covers its whole range: the worker then takes the
    merged aggregate as dense, as from one server that went dense."""
    from psparse.worker.frames import merge_aggregates

    edges = keyranges.bounds(10, 2)
    sparse = protocol.Message("aggregate", {"iter": 0, "workers": 2, "count": 1},
                              np.array([3]), np.array([0.5], np.float32))
    dense = protocol.Message("aggregate", {"iter": 0, "workers": 2, "count": 5, "dense": True},
                             None, np.arange(5, dtype=np.float32))
    merged = merge_aggregates([sparse, dense], edges)
    assert merged.get("dense") and merged["count"] == 10
    assert merged.values.tolist() == [0, 0, 0, 0.5, 0, 0, 1, 2, 3, 4]
    both = merge_aggregates([sparse, protocol.Message(
        "aggregate", {"iter": 0, "workers": 2, "count": 2}, np.array([0, 4]),
        np.array([1.0, 2.0], np.float32))], edges)
    assert not both.get("dense") and both.indices.tolist() == [3, 5, 9]
