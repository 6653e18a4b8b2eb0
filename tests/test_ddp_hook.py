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
from conftest import ServerProcess, data_dir, python_module, read_jsonl

from psparse.launch.processes import free_port

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "ddp_hook.py"


def launch(out: Path, script: Path, *args: str) -> dict:
    r = subprocess.run(python_module("psparse.launch", "--workers", "2", "--quiet", "--out",
                                     str(out), str(script), *args),
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PSPARSE_DATA": str(data_dir())})
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((out / "summary.json").read_text())


def checksums(out: Path) -> list[str]:
    return [json.loads((out / f"rank-{r}.json").read_text())["checksum"] for r in (0, 1)]


def test_the_hook_is_the_session_round_bit_for_bit(tmp_path):
    """DDP with the hook (DDP buckets of 0.05 MB: several per backward) and the session API
    with the same buckets of layers: the same weights on every replica of both runs, the same
    bytes and unions in every round, the same accuracy."""
    ddp = launch(tmp_path / "ddp", EXAMPLE, "--iterations", "20", "--bucket-cap-mb", "0.05")
    session = launch(tmp_path / "session", EXAMPLE, "--iterations", "20", "--api", "session")
    assert ddp["status"] == session["status"] == "ok"
    assert len(set(checksums(tmp_path / "ddp")) | set(checksums(tmp_path / "session"))) == 1
    fields = ("k", "union", "upload_bytes", "broadcast_bytes")
    rounds = {n: [[r[f] for f in fields] for r in read_jsonl(tmp_path / n / "metrics.jsonl")]
              for n in ("ddp", "session")}
    assert rounds["ddp"] == rounds["session"] and len(rounds["ddp"]) == 20
    assert ddp["upload_mb"] == session["upload_mb"] > 0
    assert ddp["test_acc"] == session["test_acc"]
    overlap = json.loads((tmp_path / "ddp" / "rank-0.json").read_text())["overlap"]
    assert len(overlap["parts"]) - 1 == 3  # LeNet-5 in psparse's 0.1 MB buckets


def test_the_hook_under_torchrun_variables(tmp_path):
    """No launcher: a psparse-server, and the script started twice with RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT (torchrun's) and PSPARSE_PORT."""
    server = ServerProcess(tmp_path / "run", 2)
    try:
        env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port()), "PSPARSE_PORT": str(server.port),
               "PSPARSE_OUT": str(tmp_path / "run"), "PSPARSE_DATA": str(data_dir())}
        env.pop("PSPARSE_SERVER", None)
        ranks = [subprocess.Popen([sys.executable, str(EXAMPLE), "--iterations", "10"],
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in (0, 1)]
        outputs = [p.communicate(timeout=300)[0] for p in ranks]
        assert [p.returncode for p in ranks] == [0, 0], "\n".join(outputs)
        code, log = server.wait()
        assert code == 0, log
    finally:
        server.kill()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["iterations"] == 10
    assert len(set(checksums(tmp_path / "run"))) == 1 and summary["upload_mb"] > 0


def test_the_hook_inside_lightning(tmp_path):
    try:
        import lightning  # noqa: F401
    except ImportError as exc:
        print(f"Lightning cannot be imported here ({exc}): pip install -e '.[lightning]'")
        pytest.skip(f"Lightning not installed: {exc}")
    summary = launch(tmp_path / "run", REPO / "tests" / "user_lightning.py")
    assert summary["status"] == "ok" and summary["iterations"] == 20
    assert len(set(checksums(tmp_path / "run"))) == 1 and summary["upload_mb"] > 0
