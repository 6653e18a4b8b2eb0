"""Resuming an --elastic run that lost workers, on real processes: from a checkpoint after the
loss with only the ranks live then (here restarted by --max-restarts after the server is
killed), and from one before it with every rank back (here by hand with --resume). The newest
checkpoint that every rank live at it saved wins (psparse/checkpoint.py, resume_point)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import read_jsonl, start_launch
from test_restarts import assert_identical, kill_once_saved, launch, restarted_once

from psparse import checkpoint
from psparse.config import RunConfig
from psparse.launch.cluster import Host
from psparse.launch.plan import Plan, StartFailure, Topology
from psparse.launch.progress import Progress
from psparse.launch.supervisor import Supervisor
from psparse.rundir import METRICS_FILE

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "faulty_train.py")
# rank 2 fails at iteration 25 (a data error: the loss is at the same iteration in every run)
AFTER = ["--workers", "3", "--elastic", "--checkpoint-every", "20", "--quiet",
         "--restart-backoff", "0.5", SCRIPT, "--iterations", "600", "--fail-at", "25",
         "--fail-rank", "2"]
BEFORE = ["--workers", "2", "--elastic", "--checkpoint-every", "20", "--quiet", SCRIPT,
          "--iterations", "60"]


def summary_of(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_resume_point_is_the_newest_checkpoint_every_rank_live_at_it_saved(tmp_path):
    for who, it, live in (("server", 20, [0, 1, 2]), ("server", 40, [0, 2])):
        checkpoint.save(tmp_path, who, it, {"iteration": it}, header={"live": live})
    for r in range(3):
        checkpoint.save(tmp_path, f"rank-{r}", 20, {"iteration": 20})
    checkpoint.save(tmp_path, "rank-0", 40, {"iteration": 40})
    # rank 2 has not saved 40 yet: the checkpoint before the loss, with every rank
    assert checkpoint.resume_point(tmp_path, 3) == (20, [0, 1, 2])
    checkpoint.save(tmp_path, "rank-2", 40, {"iteration": 40})
    # rank 1 (lost) never saves 40, and is not asked for
    assert checkpoint.resume_point(tmp_path, 3) == (40, [0, 2])
    assert checkpoint.load(tmp_path, "server", 40) == {"iteration": 40}
    assert checkpoint.header(tmp_path, "rank-0", 40) == {}


@pytest.mark.long
def test_a_run_that_lost_a_worker_restarts_after_the_loss_with_the_live_ranks(tmp_path):
    """The restarted run equals the same elastic run never interrupted (the loss is at
    iteration 25 in both): same records, same final weights on the live ranks."""
    clean = tmp_path / "clean"
    r = launch(clean, *AFTER)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank-2 exited with code 1; --elastic: the run goes on without it" in r.stdout
    assert summary_of(clean)["lost_workers"] == [{"rank": 2, "iter": 25}]
    rows = read_jsonl(clean / METRICS_FILE)  # what the launcher reads to know rank 2 is gone
    assert "live" not in rows[0] and rows[-1]["live"] == [0, 1]
    out = tmp_path / "run"
    proc = start_launch("--out", str(out), "--max-restarts",
                        "1", *AFTER)
    saved = [out / "checkpoint" / name for name in ("server-60.pt", "rank-0-60.pt",
                                                    "rank-1-60.pt")]
    kill_once_saved(proc, out, saved, "server")
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output
    assert "with the ranks live then, [0, 1]" in output
    assert "psparse: 2 of 3 workers (ranks [0, 1]" in output
    failed, resumed = restarted_once(out, output)
    assert failed["process"] == "server" and failed["ranks"] is None
    assert resumed["resumed_from"] >= 60 and resumed["ranks"] == [0, 1]
    assert summary_of(out)["lost_workers"] == [{"rank": 2, "iter": 25}]
    assert not (out / "logs" / "rank-2.log").exists()  # the lost rank was not started again
    assert_identical(out, clean, 2)


def test_a_lost_worker_reaped_with_a_later_server_failure_is_not_its_cause(tmp_path):
    """Rank 2 was lost at 25 and the server went on (its records name the live ranks, as the
    test above checks on a real run); the launcher reaps rank 2's exit only in the poll that
    finds the server killed at 60. The failure is the server's, not rank 2's (which sorts
    first by name): CI once saw that."""
    record = {"iter": 60, "workers": 2, "live": [0, 1], "upload_bytes": 8,
              "broadcast_bytes": 8, "union": 1, "budget": 1}
    (tmp_path / METRICS_FILE).write_text(json.dumps(record) + "\n")
    said: list[str] = []
    supervisor = Supervisor(tmp_path, quiet=True, grace_s=1.0, elastic_from=1, say=said.append)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    supervisor.procs = {"server": subprocess.Popen(sleeper),
                        "rank-0": subprocess.Popen(sleeper), "rank-1": subprocess.Popen(sleeper),
                        "rank-2": subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])}
    supervisor.procs["rank-2"].wait()
    supervisor.procs["server"].send_signal(signal.SIGKILL)
    supervisor.procs["server"].wait()
    code = supervisor.monitor(Progress(tmp_path, 1, None, quiet=True))
    assert code == 1 and supervisor.failure == ("server", -signal.SIGKILL)
    assert supervisor.lost == {"rank-2"}
    assert any("rank-2 exited with code 1; --elastic: the run goes on without it" in s
               for s in said)
    assert all(p.poll() is not None for p in supervisor.procs.values())  # the rest stopped


@pytest.mark.long
def test_a_run_that_failed_soon_after_a_loss_resumes_before_it_with_every_rank(tmp_path):
    """Rank 1 is lost at 25, then rank 0 fails at 30 and the run with it: the newest usable
    checkpoint is 20's, from before the loss; resumed by hand with both ranks (the faults do
    not repeat), the run equals one that never failed."""
    clean = tmp_path / "clean"
    r = launch(clean, *BEFORE)
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "run"
    r = launch(out, *BEFORE, "--fail-at", "25,30", "--fail-rank", "1,0")
    assert r.returncode != 0
    summary = summary_of(out)
    assert summary["status"] == "failed" and summary["lost_workers"] == [{"rank": 1, "iter": 25}]
    assert "rank 0 failed at iteration 30" in summary["error"]
    assert checkpoint.resume_point(out, 2) == (20, [0, 1])
    r = launch(out, "--resume", str(out), "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "psparse: 2 workers" in r.stdout
    summary = summary_of(out)
    assert summary["status"] == "ok" and summary["lost_workers"] == []
    assert "resumed at iteration 20" in (out / "logs" / "server.log").read_text()
    assert_identical(out, clean, 2)


def test_a_plan_resumed_with_the_live_ranks_starts_only_those(tmp_path):
    cfg = RunConfig(workers=3, elastic=True)
    (tmp_path / "config.json").write_text(cfg.to_json())
    hosts = Topology(mode="hostfile", hosts=[Host("a", 2), Host("b", 1)], rsh=["ssh"])
    plan = Plan(cfg, tmp_path, tmp_path / "config.json", hosts, "token", resume=True,
                ranks=[0, 2])
    specs = plan.workers("srv:5555")
    assert [s.name for s in specs] == ["rank-0", "rank-2"]
    assert specs[1].argv[1] == "b"  # rank 2 keeps its slot: the lost rank 1's stays empty
    local = Plan(cfg, tmp_path, tmp_path / "config.json", Topology(), "token", ranks=[1])
    assert [s.name for s in local.workers("127.0.0.1:1")] == ["rank-1"]
    slurm = Plan(cfg, tmp_path, tmp_path / "config.json", Topology(mode="slurm"), "token",
                 ranks=[0, 2])
    with pytest.raises(StartFailure, match="one srun starts them all: resume it with "
                                           "--hostfile"):
        slurm.workers("srv:5555")
