"""Rounds in buckets of layers (--bucket-mb) and overlapped with backward (--overlap): real
server and worker processes on loopback. The same run gives identical results in one part, in
buckets, and overlapped; buckets leave during backward, in backward order; the server
aggregates and broadcasts each part as soon as every rank pushed it (a raw ZeroMQ client that
follows docs/protocol.md, Parts); a resumed overlapped run ends as an uninterrupted one; what
overlap does not work with is refused, naming the option."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq
from conftest import read_jsonl, run_launch, start_launch

from psparse.config import ConfigError, RunConfig
from psparse.ops.codec.codec import KeyCache
from psparse.wire import protocol
from psparse.worker import buckets
from psparse.worker.session import Session

# mlp on digits: layers of 2048, 32, 320 and 10 entries; 0.001 MB buckets (250 entries)
# make each layer its own bucket: 4 parts
RUN = ["--workers", "3", "--model", "mlp", "--dataset", "digits", "--iterations", "30",
       "--eval-every", "10", "--seed", "2", "--granularity", "layer", "--density", "0.05",
       "--check-every", "3", "--quiet"]
BUCKETS = ["--bucket-mb", "0.001"]
NOT_COMPARED = ("round_s", "time_s", "upload_bytes", "broadcast_bytes")


def launch(out, *args, timeout=300):
    done = run_launch("--out", str(out), *args, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def results(run):
    metrics = [{k: v for k, v in r.items() if k not in NOT_COMPARED}
               for r in read_jsonl(run / "metrics.jsonl")]
    evals = [{k: v for k, v in r.items() if k != "time_s"} for r in read_jsonl(run / "eval.jsonl")]
    ranks = [json.loads((run / f"rank-{r}.json").read_text()) for r in range(3)]
    return metrics, evals, [(r["checksum"], r["policy_state"]) for r in ranks]


EXTRA = ["--policy", "core", "--memory", "dgc", "--momentum", "0.5"]  # shared policy state


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same run in one part, in buckets, and overlapped (with checkpoints every 10)."""
    root = tmp_path_factory.mktemp("overlap")
    return {"plain": launch(root / "plain", *RUN, *EXTRA),
            "buckets": launch(root / "buckets", *RUN, *EXTRA, *BUCKETS),
            "overlap": launch(root / "overlap", *RUN, *EXTRA, *BUCKETS, "--overlap",
                              "--checkpoint-every", "10")}


def test_buckets_and_overlap_give_identical_results_and_push_during_backward(runs):
    plain = results(runs["plain"])
    assert results(runs["buckets"]) == plain
    assert results(runs["overlap"]) == plain
    assert len(plain[0]) == 30 and plain[1]

    info = json.loads((runs["buckets"] / "rank-1.json").read_text())["overlap"]
    assert info["parts"] == [0, 2048, 2080, 2400, 2410] and not info["enabled"]
    assert info["pushes_in_backward"] == 0
    assert info["last_round"] == ["exchange", "push 3", "push 2", "push 1", "push 0",
                                  "aggregate"]
    for r in range(3):
        info = json.loads((runs["overlap"] / f"rank-{r}.json").read_text())["overlap"]
        # parts 3, 2, 1 left from autograd hooks in every iteration, part 0 from exchange()
        assert info["pushes_in_backward"] == 3 * 30
        # backward produced the buckets last layer first, and each left as soon as it was
        # ready, before backward produced the first layer's gradient
        assert info["last_round"] == ["ready 3", "push 3", "ready 2", "push 2", "ready 1",
                                      "push 1", "ready 0", "exchange", "push 0", "aggregate"]


def test_an_overlapped_run_resumes_as_an_uninterrupted_one(runs, tmp_path):
    """Checkpoints are written at a round's first bucket (the state before any gradient is
    folded in); resuming from one continues exactly (policy state and key caches included)."""
    cut = tmp_path / "cut"
    shutil.copytree(runs["overlap"], cut)
    # the run as if stopped after iteration 20's checkpoint: drop what came after it
    for f in (cut / "checkpoint").iterdir():
        if not f.name.endswith("-20.pt"):
            f.unlink()
    for name in ("metrics.jsonl", "eval.jsonl"):
        rows = [r for r in read_jsonl(cut / name) if r["iter"] < 20]
        (cut / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    for r in range(3):
        (cut / f"rank-{r}.json").unlink()
    done = run_launch("--resume", str(cut), "--quiet", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed at iteration 20" in (cut / "logs" / "server.log").read_text()
    assert results(cut) == results(runs["overlap"])


# ----------------------------------------------------------------------- the wire (Parts)
def send(sock, header, *frames):
    sock.send_multipart([msgpack.packb({"v": 2, **header}), *frames])


def recv(sock, timeout_s=20.0):
    while True:
        assert sock.poll(int(timeout_s * 1000)), "server silent"
        frames = sock.recv_multipart()
        header = msgpack.unpackb(frames[0], raw=False)
        if header["type"] != "heartbeat":
            return header, frames


CACHES: dict = {}  # (socket, part) -> the index sets both ends hold (key caching is per part)


def cache(sock, part):
    return CACHES.setdefault((id(sock), part), KeyCache())


def push(sock, it, rank, part, indices, values, **extra):
    idx = np.asarray(indices, dtype="<i4")
    cache(sock, part).remember(idx, sent=True)
    send(sock, {"type": "push", "iter": it, "rank": rank, "part": part, "count": idx.size,
                "index_dtype": "int32", "value_dtype": "float32", **extra},
         idx.tobytes(), np.asarray(values, dtype="<f4").tobytes())


def test_the_server_answers_each_part_as_soon_as_every_rank_pushed_it(server_factory):
    """A client written from docs/protocol.md (raw ZeroMQ and msgpack): parts [0, 6) and
    [6, 10) of a 10-entry model, 2 ranks, push cap 3 per iteration in all."""
    server = server_factory(2)
    ctx = zmq.Context()
    socks = []
    run = {"numel": 10, "iterations": 1, "two_phase": False, "steps": [[0, 3, 3, 0]],
           "config": {}, "parts": [0, 6, 10]}
    try:
        for rank in range(2):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{server.port}")
            send(s, {"type": "register", "rank": rank, "world_size": 2, "run": run})
            socks.append(s)
        for s in socks:
            assert recv(s)[0]["type"] == "ready"
        a, b = socks
        # part 1 first (as backward makes it), part-relative indices: 1 stands for key 7
        push(a, 0, 0, 1, [1], [2.0])
        push(b, 0, 1, 1, [1, 3], [4.0, 6.0])
        for s in socks:  # part 1 is complete: its aggregate comes before part 0 is pushed
            h, frames = recv(s)
            assert (h["type"], h["part"], h["workers"]) == ("aggregate", 1, 2)
            # the server picks the smallest encoding: rank 1's is the set it pushed, as a key
            msg = protocol.decode(frames, numel=4, cache=cache(s, 1))
            assert (msg.indices.tolist(), msg.values.tolist()) == ([1, 3], [3.0, 3.0])
        # refused, each with an error, changing nothing: no part, a second part 1, a part the
        # run does not have, more entries than the iteration's cap over both parts
        push_without_part = {"type": "push", "iter": 0, "rank": 0, "count": 0,
                             "index_dtype": "int32", "value_dtype": "float32"}
        send(a, push_without_part, b"", b"")
        push(a, 0, 0, 1, [0], [1.0])
        push(a, 0, 0, 2, [0], [1.0])
        push(a, 0, 0, 0, [0, 1, 5], [1.0, 1.0, 1.0])  # 1 + 3 > 3
        for words in ("must carry 'part'", "already sent part 1", "part 2", "in all"):
            h, _ = recv(a)
            assert h["type"] == "error" and words in h["message"], h
        push(a, 0, 0, 0, [5], [1.0], loss=1.0)
        push(b, 0, 1, 0, [0], [3.0], loss=3.0)
        for s in socks:
            h, frames = recv(s)
            assert (h["type"], h["part"]) == ("aggregate", 0)
            msg = protocol.decode(frames, numel=6, cache=cache(s, 0))
            assert (msg.indices.tolist(), msg.values.tolist()) == ([0, 5], [1.5, 0.5])
        for rank, s in enumerate(socks):
            send(s, {"type": "metrics", "iter": 0, "rank": rank, "report": {"final": True}})
        for s in socks:
            assert recv(s)[0] == {"v": 2, "type": "shutdown", "ok": True,
                                  "reason": "training complete"}
        code, _ = server.wait()
        assert code == 0
        [record] = server.metrics()
        assert (record["k"], record["union"], record["loss"]) == ([2, 3], 4, 2.0)
        summary = json.loads((server.out / "summary.json").read_text())
        assert summary["rejected_messages"] == 4
    finally:
        for s in socks:
            s.close()
        ctx.term()


# ------------------------------------------------------------------------------ refusals
def test_buckets_are_contiguous_layer_ranges_in_reverse_order():
    lenet = [150, 6, 2400, 16, 48000, 120, 10080, 84, 840, 10]
    plan = buckets.plan(lenet, 0.1)  # 25,000 entries
    assert plan == [(0, 4), (4, 5), (5, 10)]  # a layer above the size is a bucket alone
    assert buckets.boundaries(lenet, plan) == [0, 2572, 50572, 61706]
    assert buckets.plan(lenet, 100) == [(0, 10)]


@pytest.mark.parametrize("options, words", [
    ({}, "--granularity layer"),
    ({"granularity": "layer", "policy": "vote"}, "two-phase"),
    ({"granularity": "layer", "memory": "scalecom"}, "scalecom"),
    ({"granularity": "layer", "clip_norm": 1.0}, "--clip-norm"),
    ({"granularity": "layer", "servers": 2}, "--servers"),
    ({"granularity": "layer", "server_limit": "2k"}, "--server-limit"),
    ({"granularity": "layer", "elastic": True}, "--elastic"),
    ({"granularity": "layer", "density": 1.0}, "density below 1"),
    ({"granularity": "layer", "bucket_mb": 0.0}, "bucket-mb must be > 0"),
])
def test_what_overlap_does_not_work_with_is_refused(options, words):
    with pytest.raises(ConfigError, match=words.replace("-", r"\-")):
        RunConfig(overlap=True, **options).validate()


@pytest.mark.parametrize("policy, words", [("randomk", "overrides select"),
                                           ("threshold", "overrides select")])
def test_policies_that_select_the_whole_vector_are_refused(policy, words):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    cfg = RunConfig(workers=1, granularity="layer", overlap=True, policy=policy).validate()
    with pytest.raises(ConfigError, match=words):
        Session(model, None, cfg, rank=0, server=("127.0.0.1", 9), iterations=2)


def test_the_ddp_baseline_refuses_overlap(tmp_path):
    done = run_launch("--out", str(tmp_path / "x"),
                      "--baseline", "ddp", "--granularity", "layer",
                      "--overlap", timeout=60)
    assert done.returncode == 2 and "--overlap and --bucket-mb do not apply" in done.stderr


@pytest.mark.long
def test_a_user_script_through_connect_overlaps_without_changing_its_loop(tmp_path):
    """tests/user_train.py (BatchNorm CNN, Adam, zero_grad to None): the session installs the
    hooks on the model it was given; the same weights as without overlap."""
    script = str(Path(__file__).resolve().parent / "user_train.py")
    common = ["--workers", "2", "--granularity", "layer", "--density", "0.05", "--quiet"]
    plain, over = tmp_path / "plain", tmp_path / "over"
    procs = [start_launch("--out", str(out), *common, *extra,
                          script, "--iterations", "10")
             for out, extra in ((plain, []), (over, ["--overlap", "--bucket-mb", "0.0005"]))]
    for proc in procs:  # both at once: two short runs, mostly start-up
        output = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, output
    for r in range(2):
        assert np.array_equal(np.load(over / f"params-{r}.npy"), np.load(plain / f"params-{r}.npy"))
    info = json.loads((over / "rank-0.json").read_text())["overlap"]
    # conv+bn, fc.weight, fc.bias, aux.weight, aux.bias; aux gets gradients on even iterations
    # only: on odd ones its buckets (3 and 4) are never ready in backward, exchange() pushes them
    assert info["layers"] == [[0, 4], [4, 5], [5, 6], [6, 7], [7, 8]]
    assert info["pushes_in_backward"] == 5 * 4 + 5 * 2
    assert info["last_round"] == ["ready 2", "push 2", "ready 1", "push 1", "ready 0",
                                  "exchange", "push 4", "push 3", "push 0", "aggregate"]
    assert [{k: v for k, v in r.items() if k not in NOT_COMPARED}
            for r in read_jsonl(over / "metrics.jsonl")] == \
        [{k: v for k, v in r.items() if k not in NOT_COMPARED}
         for r in read_jsonl(plain / "metrics.jsonl")]


@pytest.mark.parametrize("server_args, two_phase, words", [
    (["--server-limit", "2k"], False, "--server-limit"),
    ([], True, "two-phase"),
])
def test_a_server_refuses_parts_with_what_they_do_not_combine_with(server_factory, server_args,
                                                                  two_phase, words):
    server = server_factory(1, extra=server_args)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{server.port}")
        send(sock, {"type": "register", "rank": 0, "world_size": 1, "run": {
            "numel": 10, "iterations": 1, "two_phase": two_phase, "steps": [[0, 3, 3, 3]],
            "config": {}, "parts": [0, 6, 10]}})
        header, _ = recv(sock)
        assert header["type"] == "shutdown" and not header["ok"] and words in header["reason"]
        assert server.wait()[0] == 1
    finally:
        sock.close()
        ctx.term()
