"""The reports that set psparse beside its peers (issues 54 and 55): the transformer's seeds,
torchft timed on the cluster, DDP beside the shards, and torchft's DiLoCo on separate hosts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"


@pytest.fixture()
def results(tmp_path, monkeypatch):
    """A copy of the committed results for the reports to read and write, no run folders."""
    from experiments import cluster_report, local_steps, shards_cluster, transformer_tta

    copy = tmp_path / "results"
    shutil.copytree(RESULTS, copy, ignore=shutil.ignore_patterns("*.png", "tta-runs",
                                                                 "policies-report"))
    for module in (local_steps, shards_cluster, transformer_tta):
        monkeypatch.setattr(module, "RESULTS", copy)
    for module in (cluster_report, shards_cluster, transformer_tta):
        monkeypatch.setattr(module, "ROOT", tmp_path)  # no run folders: what the JSON recorded
    return copy


def test_transformer_seeds_are_listed_and_ratios_paired_by_seed(results):
    from experiments import transformer_tta as tta

    path = results / "transformer-tta.json"
    recorded = json.loads(path.read_text())
    recorded["runs"] = [r for r in recorded["runs"] if r["seed"] == 0]  # the report's seeds: ours
    runs = {r["run"]: r for r in recorded["runs"]}
    # seed 1 of DDP and of psparse's local steps, reaching 2.0 at other evaluations
    for name, at in (("ddp", 299), ("local16-dense-int4-avg", 20)):
        evals = [{"iter": e["iter"], "test_loss": 2.5 if e["iter"] < at else 1.9}
                 for e in runs[name]["evals"]]
        recorded["runs"].append({**runs[name], "seed": 1, "evals": evals})
    path.write_text(json.dumps(recorded))
    out = tta.report(tta.RATES)
    row = {(r["rate"], r["target"], r["run"]): r for r in out["rows"]}
    steady = {n: t["steady_ms"] for n, t in out["timing"]["5mbit"].items()}
    ours, ddp = row[("5mbit", 2.0, "local16-dense-int4-avg")], row[("5mbit", 2.0, "ddp")]
    assert ours["by_seed"]["seeds"] == [0, 1] and ddp["by_seed"]["iterations"] == [250, 300]
    assert ours["by_seed"]["iterations"] == [24, 21]  # the first evaluation at 1.9: sync 21
    assert ours["by_seed"]["composed_s"][1] == pytest.approx(21 * steady[
        "local16-dense-int4-avg"] / 1e3)
    assert ours["by_seed"]["vs_ddp"] == pytest.approx(
        [a / b for a, b in zip(ours["by_seed"]["composed_s"], ddp["by_seed"]["composed_s"])])
    assert ours["vs_ddp"] == pytest.approx(ours["by_seed"]["vs_ddp"][0])  # seed 0's headline
    # a run with one seed has no by_seed and keeps its recorded figures
    assert "by_seed" not in row[("5mbit", 2.0, "localsgd-h16")]
    assert row[("5mbit", 2.0, "localsgd-h16")]["iterations"] == 24


def test_torchft_timing_composes_local_sgd_at_torchfts_synchronisation(results):
    from experiments import local_steps

    data = json.loads((results / local_steps.JSON).read_text())
    peer = data["timing"]["25mbit"]["localsgd-h16"]["steady_ms"]
    (results / local_steps.TORCHFT_TIMING).write_text(json.dumps({
        "timing": {"25mbit": {"localsgd": {"steady_ms": 2 * peer, "code": "abc"}}},
        "machine": "here", "psparse_peer": {"localsgd": "localsgd-h16"}, "workload": "w"}))
    section = local_steps.page(data).split("### torchft timed on the emulated cluster")[1]
    line = next(x for x in section.splitlines() if x.startswith("| 25mbit | torchft localsgd"))
    cells = [c.strip() for c in line.split("|")[1:-1]]
    syncs = [r["syncs_to_target"] for r in data["runs"] if r["run"] == "localsgd-h16"]
    composed = [n * 2 * peer / 1e3 for n in syncs]
    assert cells[4] == "2.00"  # torchft / peer
    assert cells[5].startswith(f"{sum(composed) / len(composed):.1f}")
    best = next(r for r in local_steps.compose(data)
                if r["rate"] == "25mbit" and r["best_psparse_run"])
    ratios = [best["composed_s"][s] / c for s, c in enumerate(composed)]
    assert cells[6].startswith(f"{sum(ratios) / len(ratios):.2f}") and best["run"] in cells[6]


def test_shard_report_keeps_recorded_rows_and_sets_ddp_against_one_server(results):
    from experiments import shards_cluster

    path = results / "shards-cluster.json"
    recorded = json.loads(path.read_text())
    one = next(r for r in recorded["rows"] if r["run"] == "topk-fp32-one-server")
    recorded["rows"] = [r for r in recorded["rows"] if r["run"] != "ddp"] + [
        {**one, "run": "ddp", "placement": "ring", "servers": 0, "median_ms": 2 * one[
            "median_ms"], "shard_imbalance": None, "server_cpu_ms": None,
         "worker_ps_cpu_ms": None}]
    path.write_text(json.dumps(recorded))
    out = shards_cluster.report()
    rows = {r["run"]: r for r in out["rows"]}
    assert set(rows) == {r["run"] for r in recorded["rows"]}  # every folder is gone here
    assert rows["ddp"]["vs_one_server"] == pytest.approx(2.0)
    assert out["shard_edges"] == recorded["shard_edges"]
    assert "| ddp | 8 | none (ring) |" in shards_cluster.page(out)


@pytest.mark.long
def test_torchft_ranks_on_their_own_hosts_train_as_in_one_process(tmp_path):
    """experiments/diloco_peer.py's --rank and --serve-lighthouse (each rank a host of the
    emulated cluster) evaluate exactly as its one-process mode: the same torchft LocalSGD."""
    site = os.environ.get("PSPARSE_TORCHFT", str(ROOT / ".torchft"))
    if not (ROOT / ".torchft" / ".stamp").is_file() and "PSPARSE_TORCHFT" not in os.environ:
        subprocess.run(["make", "torchft"], cwd=ROOT, check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": f"{site}:{ROOT}"}
    peer = [sys.executable, str(ROOT / "experiments" / "diloco_peer.py"), "--workers", "2",
            "--algorithm", "localsgd", "--optimizer", "sgd", "--steps", "32",
            "--eval-every", "16", "--timeout", "30"]
    whole = tmp_path / "whole"
    subprocess.run([*peer, "--out", str(whole)], env=env, cwd=ROOT, check=True,
                   capture_output=True, timeout=300)
    apart = tmp_path / "apart"
    apart.mkdir()
    port = 29600 + os.getpid() % 300
    lighthouse = subprocess.Popen([*peer, "--out", str(apart), "--serve-lighthouse",
                                   f"127.0.0.1:{port}"], env=env, cwd=ROOT)
    ranks = [subprocess.Popen([*peer, "--out", str(apart), "--rank", str(r), "--lighthouse",
                               f"http://127.0.0.1:{port}", "--hostname", "127.0.0.1"],
                              env=env, cwd=ROOT) for r in range(2)]
    try:
        assert [p.wait(300) for p in ranks] == [0, 0]
        assert lighthouse.wait(60) == 0  # it ends once both ranks reported
    finally:
        for p in (*ranks, lighthouse):
            if p.poll() is None:
                p.kill()
    reported = [json.loads((apart / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [r["commits"] for r in reported] == [2, 2]
    assert all(s["at_s"] > 0 and not s["errored"] for r in reported for s in r["syncs"])

    def accuracy(out):
        return [(e["step"], e["test_acc"]) for e in map(json.loads, (out / "eval.jsonl")
                                                        .read_text().splitlines())]
    assert accuracy(apart) == accuracy(whole) and len(accuracy(whole)) == 3
