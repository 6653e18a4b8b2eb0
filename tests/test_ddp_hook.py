"""psparse as DDP's communication (psparse.ddp_hook), on real processes with gloo: under
psparse-launch, under torchrun's environment variables beside a psparse-server, and inside
PyTorch Lightning's DDPStrategy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ServerProcess, data_dir, read_jsonl, run_launch

from psparse.launch.processes import free_port

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "ddp_hook.py"


def launch(out: Path, script: Path, *args: str, options=()) -> dict:
    r = run_launch("--workers", "2", "--quiet", *options,
                   "--out", str(out), str(script), *args,
                   timeout=300, env={**os.environ, "PSPARSE_DATA": str(data_dir())})
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((out / "summary.json").read_text())


def checksums(out: Path) -> list[str]:
    return [json.loads((out / f"rank-{r}.json").read_text())["checksum"] for r in (0, 1)]


def torchrun_style(out: Path, *args: str, script: Path = EXAMPLE) -> dict:
    """No launcher: a psparse-server, and the script started twice with torchrun's RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, and PSPARSE_PORT (the server at
    MASTER_ADDR:PSPARSE_PORT)."""
    server = ServerProcess(out, 2)
    try:
        env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), "PSPARSE_PORT": str(server.port),
               "PSPARSE_OUT": str(out), "PSPARSE_DATA": str(data_dir()),
               # torchrun's default with several processes per node; psparse-launch's too
               # (threads = cores / workers): the same gradients to the bit need the same
               "OMP_NUM_THREADS": "1"}
        for name in ("PSPARSE_SERVER", "PSPARSE_CONFIG", "PSPARSE_CONFIG_JSON"):
            env.pop(name, None)
        ranks = [subprocess.Popen([sys.executable, str(script), *args],
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in (0, 1)]
        outputs = [p.communicate(timeout=300)[0] for p in ranks]
        assert [p.returncode for p in ranks] == [0, 0], "\n".join(outputs)
        code, log = server.wait()
        assert code == 0, log
    finally:
        server.kill()
    return json.loads((out / "summary.json").read_text())


def test_the_hook_is_the_session_round_bit_for_bit(tmp_path):
    """DDP with the hook under torchrun's variables (DDP buckets of 0.05 MB: several per
    backward, re-formed by DDP after the first iteration) and the session API under
    psparse-launch with the same buckets of layers: the same weights on every replica of
    both runs, the same bytes and unions in every round, the same accuracy."""
    ddp = torchrun_style(tmp_path / "ddp", "--iterations", "20", "--bucket-cap-mb", "0.05")
    session = launch(tmp_path / "session", EXAMPLE, "--iterations", "20", "--api", "session",
                     options=("--threads", "1"))
    assert ddp["status"] == session["status"] == "ok", ddp["error"]
    assert len(set(checksums(tmp_path / "ddp")) | set(checksums(tmp_path / "session"))) == 1
    fields = ("k", "union", "upload_bytes", "broadcast_bytes")
    rounds = {n: [[r[f] for f in fields] for r in read_jsonl(tmp_path / n / "metrics.jsonl")]
              for n in ("ddp", "session")}
    assert rounds["ddp"] == rounds["session"] and len(rounds["ddp"]) == 20
    assert ddp["upload_mb"] == session["upload_mb"] > 0
    assert ddp["broadcast_mb"] == session["broadcast_mb"]
    assert ddp["test_acc"] == session["test_acc"]
    overlap = json.loads((tmp_path / "ddp" / "rank-0.json").read_text())["overlap"]
    assert len(overlap["parts"]) - 1 == 3  # LeNet-5 in psparse's 0.1 MB buckets


@pytest.mark.long
@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_the_lightning_strategy_trains_under_the_launcher(tmp_path, precision):
    """psparse.lightning.PsparseStrategy in a Trainer under psparse-launch (which gives the
    script torchrun's LOCAL_RANK, MASTER_ADDR and MASTER_PORT): DDP's buckets go through the
    server, the run ends with fit (every rank closes after step 19), the replicas are
    identical and the accuracy the module logged in validation is the run's; in 16-mixed,
    Lightning's own GradScaler is psparse's."""
    try:
        import lightning  # noqa: F401
    except ImportError as exc:
        print(f"Lightning cannot be imported here ({exc}): pip install -e '.[lightning]'")
        pytest.skip(f"Lightning not installed: {exc}")
    summary = launch(tmp_path / "run", REPO / "tests" / "user_lightning.py", "--precision",
                     precision)
    assert (summary["status"], summary["ended"], summary["iterations"]) == \
        ("ok", "closed by every rank after iteration 19", 20)
    assert len(set(checksums(tmp_path / "run"))) == 1 and summary["upload_mb"] > 0
    evals = read_jsonl(tmp_path / "run" / "eval.jsonl")
    assert evals and summary["test_acc"] == evals[-1]["test_acc"] > 0


@pytest.mark.long
def test_the_hook_with_a_grad_scaler_skips_overflowed_steps_as_ddp_does(tmp_path):
    """fp16 under DDP with a GradScaler whose scale overflows, backs off and grows again
    (first scale 2^22, growth every 4 steps), psparse as the comm hook given the scaler: the
    run keeps training; every rank skips the same steps (its scaler's records, and the
    server's overflow flag of those rounds), its replicas end identical; and the run equals,
    bit for bit, its replay that never takes the skipped steps and sets each other step's
    scale to the recorded one: an overflowed step leaves nothing behind (weights, momentum,
    error-feedback memory) but the scale's back-off, as a GradScaler's skip without psparse."""
    script = REPO / "tests" / "user_ddp_amp.py"
    recorded = launch(tmp_path / "run", script, "--record", str(tmp_path / "run"))
    assert recorded["status"] == "ok" and recorded["iterations"] == 40
    records = [json.loads((tmp_path / "run" / f"scales-rank-{r}.json").read_text())
               for r in (0, 1)]
    assert records[0] == records[1]
    skipped = [t for t, s in enumerate(records[0]["skipped"]) if s]
    flagged = [t for t, r in enumerate(read_jsonl(tmp_path / "run" / "metrics.jsonl"))
               if r["overflow"]]
    assert flagged == skipped and 3 <= len(skipped) < 30  # overflows, and training between
    scales = records[0]["scales"]
    assert any(b > a for a, b in zip(scales, scales[1:]))  # the scale grew again, too
    assert len(set(checksums(tmp_path / "run"))) == 1
    replay = launch(tmp_path / "replay", script, "--replay", str(tmp_path / "run"))
    assert replay["status"] == "ok" and replay["iterations"] == 40 - len(skipped)
    assert not any(r["overflow"] for r in read_jsonl(tmp_path / "replay" / "metrics.jsonl"))
    assert checksums(tmp_path / "replay") == checksums(tmp_path / "run")


@pytest.mark.long
def test_one_line_in_an_ordinary_ddp_script_ends_the_run_well(tmp_path):
    """register(model) and nothing else: no length, no close. Every rank's session closes at
    the script's end (its final report after iteration 14), and the server ends the
    open-ended run there: status ok, replicas identical; under psparse-launch and under
    torchrun's variables beside a psparse-server (the session closes at interpreter exit)."""
    script = REPO / "tests" / "user_ddp_one_line.py"
    summary = launch(tmp_path / "launched", script, "15")
    assert (summary["status"], summary["ended"], summary["iterations"]) == \
        ("ok", "closed by every rank after iteration 14", 15)
    assert len(set(checksums(tmp_path / "launched"))) == 1
    bare = torchrun_style(tmp_path / "torchrun", "15", script=script)
    assert (bare["status"], bare["ended"]) == ("ok", "closed by every rank after iteration 14")
    assert checksums(tmp_path / "torchrun") == checksums(tmp_path / "launched")


@pytest.mark.long
def test_one_line_ranks_that_train_different_lengths_are_named(tmp_path):
    """Rank 1 trains 3 steps more than rank 0: the run fails, naming both ranks and rounds."""
    r = run_launch("--workers", "2", "--quiet", "--out",
                   str(tmp_path / "run"),
                   str(REPO / "tests" / "user_ddp_one_line.py"), "15", "3", timeout=300)
    assert r.returncode != 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert ("rank 0 closed after iteration 14 (the script ended) while rank 1 sent "
            "iteration 15") in summary["error"], summary["error"]
