"""psparse-report and psparse-model on real runs; link pacing."""

from __future__ import annotations

import json
import subprocess
import time

import numpy as np
import pytest
from conftest import python_module, run_launch

from psparse.analysis.costmodel import Setting, predict, setting_from_run
from psparse.wire.transport import Pacer, parse_rate


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    dirs = []
    for policy in ("topk", "core"):
        out = root / policy
        r = run_launch("--out", str(out), "--quiet",
                       "--workers", "3", "--model", "mlp", "--dataset",
                       "digits", "--iterations", "40", "--eval-every", "10",
                       "--policy", policy, timeout=300)
        assert r.returncode == 0, r.stderr
        dirs.append(out)
    return dirs


def test_report_table_and_plots(two_runs, tmp_path):
    out = tmp_path / "report"
    r = subprocess.run(python_module("psparse.analysis.report", *map(str, two_runs), "--out",
                                     str(out)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "topk (topk)" in r.stdout and "core (core)" in r.stdout and "union/k" in r.stdout
    rows = json.loads((out / "report.json").read_text())
    assert [round(x["union_k_mean"], 6) for x in rows] == [
        round(np.mean([m["union"] / m["budget"] for m in map(
            json.loads, (d / "metrics.jsonl").read_text().splitlines())]), 6)
        for d in two_runs]
    for name in ("send_cost.png", "union_k.png", "accuracy_iterations.png",
                 "accuracy_time.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 15_000, name


def test_report_refuses_a_directory_that_is_not_a_run(tmp_path):
    r = subprocess.run(python_module("psparse.analysis.report", str(tmp_path)), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "no summary.json" in r.stderr


def test_model_formulas():
    s = Setting(numel=1000, k=10, workers=4, union=20, compute_s=0.5)
    p = predict(s, 8e6)  # 1 MB/s
    e, h = 8, 110
    assert p["sparse PS"] == pytest.approx(0.5 + (4 * (10 * e + h) + 4 * (20 * e + h)) / 1e6)
    assert p["sparse allgather"] == pytest.approx(0.5 + 3 * (10 * e + h) / 1e6)
    assert p["dense PS"] == pytest.approx(0.5 + 2 * 4 * (4000 + h) / 1e6)
    assert p["dense ring allreduce"] == pytest.approx(0.5 + 2 * 3 / 4 * 4000 / 1e6)
    slow = predict(s, 8e6, latency_s=0.01)
    assert slow["dense ring allreduce"] - p["dense ring allreduce"] == pytest.approx(0.06)
    # DDP's fp16/bf16 compression hooks: the same ring in 2-byte values
    half = predict(Setting(numel=1000, k=10, workers=4, union=20, compute_s=0.5,
                           ring_value_bytes=2), 8e6)
    assert half["dense ring allreduce"] == pytest.approx(0.5 + 2 * 3 / 4 * 2000 / 1e6)
    # a worker's CPU in a PS round (its S pushes encoded, S aggregates decoded) at half a
    # core: beside a shard it adds to the shard's CPU on the shared host (here more than the
    # link: the CPU sets the round, the link's 1/2N of a message overlaps); on a host of its
    # own it overlaps the wait for the server
    beside = dict(numel=1000, k=10, workers=4, union=20, compute_s=0.5, servers=4,
                  colocated=True, cpu_share=0.5, server_cpu_s=0.004)
    idle, busy = (predict(Setting(**beside, worker_ps_cpu_s=w), 8e6)["sparse PS"]
                  for w in (0.0, 0.001))
    assert busy - idle == pytest.approx(0.002)
    alone = predict(Setting(numel=1000, k=10, workers=4, union=20, compute_s=0.5,
                            cpu_share=0.5, worker_ps_cpu_s=0.001), 8e6)
    assert alone["sparse PS"] == pytest.approx(p["sparse PS"])
    assert alone["dense ring allreduce"] == pytest.approx(p["dense ring allreduce"])


def test_model_shards_colocation_value_formats_and_duplex():
    """Issue 54: the busiest link of a sharded round, shards beside the workers, a value
    format's bytes and a full-duplex link."""
    from psparse.analysis.costmodel import ps_link_bytes, value_bytes_of

    N, k, U, e, h = 8, 100, 150, 8, 110
    one = Setting(numel=10_000, k=k, workers=N, union=U, compute_s=0.0)
    assert ps_link_bytes(one) == (N * (k * e + h), N * (U * e + h))  # today's formula
    two = Setting(numel=10_000, k=k, workers=N, union=U, compute_s=0.0, servers=2,
                  shard_imbalance=1.2)
    assert ps_link_bytes(two) == pytest.approx((N * (k * e / 2 * 1.2 + h),
                                                N * (U * e / 2 * 1.2 + h)))
    beside = Setting(numel=10_000, k=k, workers=N, union=U, compute_s=0.0, servers=N,
                     colocated=True)
    each_way = (N - 1) / N * (k + U) * e + 2 * (N - 1) * h
    assert ps_link_bytes(beside) == pytest.approx((each_way, each_way))
    # the host whose shard carries f times the mean: only its shard's share grows by f
    f = 1.4
    lopsided = Setting(numel=10_000, k=k, workers=N, union=U, compute_s=0.0, servers=N,
                       colocated=True, shard_imbalance=f)
    assert ps_link_bytes(lopsided) == pytest.approx((
        f * (N - 1) / N * k * e + U * e * (1 - f / N) + 2 * (N - 1) * h,
        k * e * (1 - f / N) + f * (N - 1) / N * U * e + 2 * (N - 1) * h))
    # a run's measured bytes stand as they are with one server
    measured = Setting(numel=10_000, k=k, workers=N, union=U, compute_s=0.0,
                       up_bytes=12345.6, down_bytes=23456.7)
    assert ps_link_bytes(measured) == (12345.6, 23456.7)
    # beside the workers a host's bytes hardly grow with N; one server's grow N-fold
    wide = Setting(numel=10_000, k=k, workers=64, union=U, compute_s=0.0, servers=64,
                   colocated=True)
    assert ps_link_bytes(wide)[0] < 1.1 * each_way + 2 * 56 * h
    # S shards on hosts of their own past the point where a worker's link is the busier one
    many = Setting(numel=10_000, k=k, workers=2, union=U, compute_s=0.0, servers=64)
    assert ps_link_bytes(many) == (U * e + 64 * h, k * e + 64 * h)
    # value formats: bytes per value with the int8/int4 block scales
    assert value_bytes_of("bf16") == 2 and value_bytes_of("int4") == 0.5 + 4 / 128
    assert value_bytes_of("int8", 64) == 1 + 4 / 64
    with pytest.raises(ValueError, match="--values must be one of"):
        value_bytes_of("int2")
    int4 = Setting(numel=10_000, k=k, workers=N, union=U, compute_s=0.0,
                   value_bytes=value_bytes_of("int4"))
    assert ps_link_bytes(int4)[0] == pytest.approx(N * (k * (4 + 0.5 + 4 / 128) + h))
    # full duplex: the larger direction is the link's time; half: both add
    full = predict(Setting(numel=10_000, k=k, workers=N, union=U, compute_s=0.5,
                           full_duplex=True), 8e6)
    half = predict(one, 8e6)
    assert full["sparse PS"] == pytest.approx(0.5 + N * (U * e + h) / 1e6)
    assert half["sparse PS"] == pytest.approx(sum(ps_link_bytes(one)) / 1e6)


def test_model_cli_places_shards_beside_the_workers():
    args = ["--numel", "25600000", "--k", "256000", "--workers", "64", "--union", "384000",
            "--compute", "0.1", "--bandwidth", "10Gbit", "--latency", "0.05", "--json"]
    runs = {}
    for name, extra in {"one": [], "beside": ["--servers", "64", "--colocated"],
                        "int4": ["--servers", "64", "--colocated", "--values", "int4",
                                 "--full-duplex"]}.items():
        r = subprocess.run(python_module("psparse.analysis.costmodel", *args, *extra),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        runs[name] = json.loads(r.stdout)["predicted_s"]["10000 Mbit/s"]
    ring = runs["one"]["dense ring allreduce"]
    assert runs["one"]["sparse PS"] > ring  # one server loses to the ring at 64 workers
    assert runs["beside"]["sparse PS"] < 0.5 * ring  # a shard beside each worker does not
    assert runs["int4"]["sparse PS"] < runs["beside"]["sparse PS"]
    bad = subprocess.run(python_module("psparse.analysis.costmodel", *args, "--servers", "8",
                                       "--colocated"), capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "give --servers 64" in bad.stderr
    bad = subprocess.run(python_module("psparse.analysis.costmodel", *args, "--values", "int4",
                                       "--value-block", "0"), capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--value-block must be >= 1" in bad.stderr


def test_the_projection_says_where_one_server_loses_and_shards_beside_workers_win():
    from experiments.cost_projection import point

    at64 = point(25_600_000, 64, 10e9)  # issue 54's setting: one server 1.35x the ring
    ring = at64["ring allreduce, fp32"]
    assert at64["psparse, one server, fp32"] > 0.9 * ring
    assert at64["psparse, S = N beside the workers, int4"] < 0.5 * ring
    # one server's link grows with N, a shard beside each worker's does not
    at1024 = point(25_600_000, 1024, 10e9)
    assert at1024["psparse, one server, fp32"] > 8 * at64["psparse, one server, fp32"]
    assert at1024["psparse, S = N beside the workers, fp32"] == pytest.approx(
        at64["psparse, S = N beside the workers, fp32"], rel=0.01)


def test_model_cpu_terms_on_cpu_shares():
    """Issue 15: on hosts with a share s of a core, W CPU seconds of the exchange take W / s.
    The PS server's CPU overlaps its link message by message (the longer of the two plus the
    shorter one's part of one of the 2N messages); a collective's per-worker CPU adds."""
    base = Setting(numel=1000, k=10, workers=4, union=20, compute_s=0.5)
    plain = predict(base, 8e6)
    s = Setting(numel=1000, k=10, workers=4, union=20, compute_s=0.5, cpu_share=0.25,
                server_cpu_s=0.001, worker_comm_cpu_s=0.002, powersgd_entries=100)
    p = predict(s, 8e6)
    link = plain["sparse PS"] - 0.5  # 1.44 ms, less than the server's 4 ms of wall time
    assert p["sparse PS"] == pytest.approx(0.5 + 0.004 + link / 8)
    dense_link = plain["dense PS"] - 0.5  # 32.9 ms: the link dominates
    assert p["dense PS"] == pytest.approx(0.5 + dense_link + 0.004 / 8)
    # collectives: a step's send waits for the previous receive and reduction (series)
    assert p["dense ring allreduce"] == pytest.approx(plain["dense ring allreduce"] + 0.008)
    assert p["sparse allgather"] == pytest.approx(plain["sparse allgather"] + 0.008)
    assert p["PowerSGD"] == pytest.approx(0.5 + 2 * 3 / 4 * 400 / 1e6 + 0.008)
    # a latency per dependent step: 6 for the ring, 18 for PowerSGD's three, 2 for the PS
    late = predict(s, 8e6, latency_s=0.001)
    assert late["dense ring allreduce"] - p["dense ring allreduce"] == pytest.approx(0.006)
    assert late["PowerSGD"] - p["PowerSGD"] == pytest.approx(0.018)
    assert late["sparse PS"] - p["sparse PS"] == pytest.approx(0.002)
    # no share given: the CPU terms count at a whole core; zero CPU: the link-only formulas
    whole = predict(Setting(numel=1000, k=10, workers=4, union=20, compute_s=0.5,
                            worker_comm_cpu_s=0.002), 8e6)
    assert whole["dense ring allreduce"] == pytest.approx(plain["dense ring allreduce"] + 0.002)
    assert predict(Setting(numel=1000, k=10, workers=4, union=20, compute_s=0.5,
                           cpu_share=0.25), 8e6) == plain


def test_model_cli_takes_the_cpu_terms_and_powersgd():
    """psparse-model's flags reach the formulas: the same figures as predict() with them."""
    from psparse.analysis.costmodel import WIRE_OVERHEAD, model_shapes
    from psparse.training.ddp import powersgd_sizes

    args = ["--numel", "61706", "--k", "617", "--workers", "8", "--compute", "0.025",
            "--bandwidth", "80mbit", "--latency", "0.2", "--cpu-share", "0.25", "--server-cpu",
            "7", "--worker-comm-cpu", "19", "--powersgd-rank", "1", "--model", "lenet",
            "--wire-overhead", "--json"]
    r = subprocess.run(python_module("psparse.analysis.costmodel", *args), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["predicted_s"]["80 Mbit/s"]
    s = Setting(numel=61706, k=617, workers=8, union=617, compute_s=0.025, cpu_share=0.25,
                server_cpu_s=0.007, worker_comm_cpu_s=0.019,
                powersgd_entries=sum(powersgd_sizes(model_shapes("lenet"), 1)))
    want = predict(s, 80e6, latency_s=0.0002, wire_overhead=WIRE_OVERHEAD)
    assert got == pytest.approx(want) and "PowerSGD" in got
    bad = subprocess.run(python_module("psparse.analysis.costmodel", *args[:8], "--cpu-share", "2"),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--cpu-share must be in (0, 1]" in bad.stderr
    bad = subprocess.run(python_module("psparse.analysis.costmodel", *args[:8],
                                       "--powersgd-rank", "1"),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--powersgd-rank needs" in bad.stderr


def test_model_reads_a_run(two_runs):
    s, info = setting_from_run(two_runs[0])
    assert s.workers == 3 and s.numel == 2410 and s.k == 24
    assert 24 <= s.union <= 72 and s.compute_s == pytest.approx(info["measured_s"])
    r = subprocess.run(python_module("psparse.analysis.costmodel", "--run", str(two_runs[0]),
                                     "--bandwidth", "100Mbit"), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "sparse allgather" in r.stdout and "100 Mbit/s" in r.stdout


def test_parse_rate():
    assert parse_rate("100Mbit") == 1e8 and parse_rate("1Gbit") == 1e9
    assert parse_rate("2.5e6") == 2.5e6
    with pytest.raises(ValueError, match="bandwidth 'fast'"):
        parse_rate("fast")


def test_pacer_holds_each_block_for_bytes_over_rate():
    pacer = Pacer(8e6)  # 1 MB/s
    t = time.perf_counter()
    for _ in range(3):
        pacer.occupy(200_000)
    assert time.perf_counter() - t >= 0.95 * 0.6  # the emulated link, not loopback speed


def test_bandwidth_run_is_paced_at_the_server(tmp_path):
    out = tmp_path / "slow"
    r = run_launch("--out", str(out), "--quiet",
                   "--workers", "2", "--model", "mlp", "--dataset", "digits",
                   "--iterations", "20", "--bandwidth", "2Mbit", timeout=300)
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    # every byte went through the emulated 2 Mbit/s link: the run lasted at least that long
    assert s["wall_s"] >= 0.95 * (s["upload_mb"] + s["broadcast_mb"]) * 8 / 2


def test_plots_name_runs_short():
    """psparse-report's plot labels: the policy with its arguments and density, or the
    baseline (and its PowerSGD rank)."""
    from psparse.analysis.report import short_label

    assert short_label({}, {"policy": "vote", "policy_args": ["keep=1.5"], "density": 0.01}) \
        == "vote keep=1.5, 1%"
    assert short_label({}, {"policy": "topk", "policy_args": None, "density": 0.001}) == \
        "topk, 0.1%"
    assert short_label({"baseline": "powersgd"}, {"powersgd_rank": 2}) == "powersgd rank 2"
