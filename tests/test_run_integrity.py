"""Nothing lost, nothing mixed: run directories under reuse, kills and damage, on real runs.

A fresh run in a used --out is refused (or the old run deleted with --overwrite); --resume of a
complete run changes nothing; the JSON-lines rewrite of a resume is atomic under SIGKILL; torn
and damaged lines, and damaged checkpoints, are named (file, line) and end the run as failed
without a launcher traceback; an attempt that died before its first round says so."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import read_jsonl, run_launch, start_launch
from test_restarts import kill_once_saved

from psparse.rundir import RunDirError, open_truncated
from psparse.rundir import read_jsonl as read_jsonl_named

RUN = ["--workers", "2", "--model", "mlp", "--dataset", "digits", "--eval-every", "20",
       "--seed", "3", "--quiet"]


def launch(out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_launch("--out", str(out), *args, timeout=timeout)


def snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``folder``: its content's hash and its mtime (ns)."""
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                         p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def stopped_run(tmp_path) -> Path:
    """A run of 120 iterations whose worker rank 1 was killed once the checkpoints of iteration
    80 were saved (no restarts): it failed, with checkpoints at 40 and 80 to resume from."""
    out = tmp_path / "stopped"
    proc = start_launch("--out", str(out), *RUN,
                        "--iterations", "120", "--checkpoint-every", "40")
    kill_once_saved(proc, out, [out / "checkpoint" / f"{w}-80.pt"
                                for w in ("server", "rank-0", "rank-1")], "rank-1")
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0, output
    assert json.loads((out / "summary.json").read_text())["status"] == "failed"
    return out


def test_a_fresh_run_in_a_used_out_is_refused_unless_overwrite(tmp_path):
    out = tmp_path / "run"
    first = launch(out, *RUN, "--iterations", "60", "--checkpoint-every", "20")
    assert first.returncode == 0, first.stderr
    before = snapshot(out)
    again = launch(out, *RUN, "--iterations", "30", "--max-restarts", "2")
    assert again.returncode == 2
    assert f"--out {out} holds another run" in again.stderr and "--overwrite" in again.stderr
    assert "--resume" in again.stderr
    assert snapshot(out) == before  # nothing of the old run touched
    fresh = launch(out, *RUN, "--iterations", "30", "--overwrite", "--checkpoint-every", "20")
    assert fresh.returncode == 0, fresh.stderr
    assert len(read_jsonl(out / "metrics.jsonl")) == 30
    assert [e["iter"] for e in read_jsonl(out / "eval.jsonl")] == [19, 29]
    assert sorted(p.name for p in (out / "checkpoint").iterdir()) == \
        ["rank-0-20.pt", "rank-1-20.pt", "server-20.pt"]  # none of the old run's 40
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 30 and summary["status"] == "ok"
    # an empty folder, or one holding other things than a run, takes a fresh run
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.txt").write_text("mine")
    assert launch(tmp_path / "notes", *RUN, "--iterations", "5").returncode == 0
    assert (tmp_path / "notes" / "README.txt").read_text() == "mine"


def test_resume_of_a_complete_run_says_so_and_changes_nothing(tmp_path):
    out = tmp_path / "run"
    done = launch(out, *RUN, "--iterations", "40", "--checkpoint-every", "20",
                  "--max-restarts", "1")
    assert done.returncode == 0, done.stderr
    history = json.loads((out / "summary.json").read_text())["attempts"]
    before = snapshot(out)
    again = launch(out, "--resume", str(out), "--quiet")
    assert again.returncode == 0, again.stderr
    assert "is complete (ok: 40 iterations" in again.stderr and "nothing to resume" in again.stderr
    assert snapshot(out) == before
    assert json.loads((out / "summary.json").read_text())["attempts"] == history


@pytest.mark.long
def test_the_resume_rewrite_is_atomic_under_sigkill(tmp_path):
    """A process rewrites a 40 MB metrics file keeping its first half (as a resume does) and is
    killed with SIGKILL at 20 moments spread over the rewrite: every time the file is whole,
    the old one or the new one, never a part."""
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"iter": i, "pad": "x" * 400}) + "\n" for i in range(100_000)]
    old = "".join(rows)
    new = "".join(rows[:50_000])
    code = ("import sys; from psparse.rundir import open_truncated; "
            "open_truncated(sys.argv[1], lambda n, r: n < 50000).close(); print('done')")
    t = time.perf_counter()
    path.write_text(old)
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, capture_output=True)
    whole = time.perf_counter() - t
    outcomes = set()
    for i in range(20):
        path.write_text(old)
        proc = subprocess.Popen([sys.executable, "-c", code, str(path)],
                                stdout=subprocess.PIPE, text=True)
        time.sleep(whole * (0.2 + 0.05 * i))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        text = path.read_text()
        assert text in (old, new), f"kill {i}: {len(text)} bytes, neither file"
        outcomes.add("old" if text == old else "new")
    print(f"atomic rewrite: 20 kills, outcomes {sorted(outcomes)}")
    # a torn last line (its writer killed mid-line) is dropped; a damaged whole line is named
    path.write_text(new + '{"iter": 50000, "pad": "xx')
    open_truncated(path, lambda n, r: True).close()
    assert path.read_text() == new
    path.write_text(rows[0] + "{not json\n" + rows[2])
    with pytest.raises(RunDirError, match=r"metrics.jsonl, line 2: not a JSON record"):
        open_truncated(path, lambda n, r: True)


def test_a_damaged_metrics_line_fails_the_resume_naming_it_with_the_attempt_on_record(
        stopped_run):
    """The server cannot open its metrics file (a damaged line before the checkpoint): it
    exits before it listens; the summary says failed naming the file and line, and the attempt
    record names the server, when it was noticed and stopped, and that it died while
    resuming, at its resume point, not at the rows the earlier attempt left past it."""
    metrics = stopped_run / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    lines[10] = lines[10][:25] + "\n"
    metrics.write_text("".join(lines))
    r = launch(stopped_run, "--resume", str(stopped_run), "--quiet", "--max-restarts", "1")
    assert r.returncode != 0 and "Traceback" not in r.stderr + r.stdout
    summary = json.loads((stopped_run / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert f"{metrics}, line 11: not a JSON record" in summary["error"]
    attempt = summary["attempts"][0]
    assert attempt["process"] == "server" and attempt["resumed_from"] == 80
    assert attempt["noticed_at"] and attempt["stopped_at"]
    assert attempt["iterations_done"] == 80  # not the earlier attempt's rows past 80
    assert "server could not start" in r.stderr


@pytest.mark.parametrize("victim, size", [("rank-1-80.pt", "half"), ("server-80.pt", "half"),
                                          ("server-80.pt", 10)])
def test_a_damaged_checkpoint_is_named_and_the_run_fails(stopped_run, victim, size):
    path = stopped_run / "checkpoint" / victim
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2 if size == "half" else size])
    r = launch(stopped_run, "--resume", str(stopped_run), "--quiet", "--max-restarts", "2")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    summary = json.loads((stopped_run / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert f"checkpoint {path} is damaged" in summary["error"], summary["error"]
    assert f"checkpoint {path} is damaged" in r.stderr
    assert not (stopped_run / "logs" / "attempt-0").exists()  # nothing was started on it


def test_a_resumed_run_continues_its_own_history(stopped_run):
    """The control: the stopped run, resumed, ends ok with one record per iteration."""
    r = launch(stopped_run, "--resume", str(stopped_run), "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = read_jsonl(stopped_run / "metrics.jsonl")
    assert [m["iter"] for m in rows] == list(range(120))
    assert os.path.getsize(stopped_run / "summary.json") > 0


def test_an_attempt_that_ran_no_round_after_resuming_is_placed_at_its_resume_point(tmp_path):
    """476 rows from the attempt before, none written since this one started at 450: it
    failed while resuming, not "after 476 iterations"."""
    from psparse.launch.restart import Attempt, iterations_done

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"iter": i}) + "\n" for i in range(476)))
    os.utime(metrics, (time.time() - 60, time.time() - 60))
    attempt = Attempt(1, 450, time.time(), process="server", error="exited with code -9")
    attempt.iterations_done = iterations_done(tmp_path, attempt)
    assert attempt.iterations_done == 450
    assert attempt.describe() == ("server failed while resuming at iteration 450, before its "
                                  "first round: exited with code -9")
    metrics.touch()  # this attempt wrote rows: they count
    assert iterations_done(tmp_path, attempt) == 476


def test_undecodable_bytes_and_form_feeds_are_named_on_their_own_line(tmp_path):
    path = tmp_path / "eval.jsonl"
    good = [json.dumps({"iter": i}).encode() + b"\n" for i in range(4)]
    path.write_bytes(good[0] + good[1] + good[2] + b'{"iter": 3, "pad": "\xff\xfe"}\n')
    with pytest.raises(RunDirError, match=r"eval.jsonl, line 4: not UTF-8 text"):
        open_truncated(path, lambda n, r: True)
    # a form feed is no line end (str.splitlines would read line 2 as two good records)
    path.write_bytes(good[0] + b'{"iter": 1}\x0c{"iter": 9}\n' + good[2])
    with pytest.raises(RunDirError, match=r"eval.jsonl, line 2: not a JSON record"):
        read_jsonl_named(path)
