"""Cluster launch: hostfiles, remote command lines through a real shell, SLURM and torchrun
environments."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import alive, descendants, python_module, read_jsonl

from psparse.config import RunConfig
from psparse.launch import cluster
from psparse.worker import environment

FAKE_RSH = Path(__file__).resolve().parent / "fake_rsh.sh"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_parse_hostfile_and_place_ranks():
    hosts = cluster.parse_hostfile("# cluster\nnode-a slots=2   # two GPUs\n\nnode-b\n"
                                   "10.0.0.7 slots=3\n")
    assert hosts == [cluster.Host("node-a", 2), cluster.Host("node-b", 1),
                     cluster.Host("10.0.0.7", 3)]
    assert cluster.place(hosts, 4) == [(0, "node-a", 0), (1, "node-a", 1), (2, "node-b", 0),
                                       (3, "10.0.0.7", 0)]
    with pytest.raises(ValueError, match="7 workers but the hostfile has only 6 slots"):
        cluster.place(hosts, 7)
    with pytest.raises(ValueError, match="hosts:2: expected 'host slots=K'"):
        cluster.parse_hostfile("a slots=1\nb slots=zero\n", "hosts")
    with pytest.raises(ValueError, match="no hosts"):
        cluster.parse_hostfile("# nothing\n")


def test_remote_command_survives_a_real_shell(tmp_path):
    argv = ["python3", "-c", "import sys; print(sys.argv[1:])", "it's", "a b", "$HOME"]
    cmd = cluster.remote_command(["bash", str(FAKE_RSH)], "node-a", argv, str(tmp_path),
                                 {"PSPARSE_DATA": "/data/with space", "LOCAL_RANK": "1"})
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[\"it's\", 'a b', '$HOME']"  # quoting intact, nothing expanded
    probe = cluster.remote_command(["bash", str(FAKE_RSH)], "node-a",
                                   ["sh", "-c", "pwd; echo $PSPARSE_DATA $LOCAL_RANK"],
                                   str(tmp_path), {"PSPARSE_DATA": "/data/with space",
                                                   "LOCAL_RANK": "1"})
    lines = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.split("\n")
    assert lines[0] == str(tmp_path) and lines[1] == "/data/with space 1"


def test_config_flags_round_trip_through_the_worker_parser():
    from psparse.training.loop import build_parser

    cfg = RunConfig(model="mlp", dataset="digits", workers=3, policy="core",
                    policy_args=["own=0.2", "beta=0.3"], record_selections=True,
                    server_limit="2k", iterations=7).validate()
    args = build_parser().parse_args(["--rank", "0", *cluster.config_flags(cfg)])
    from psparse.options import resolve_config

    assert resolve_config(args) == cfg
    # model arguments repeat as --model-arg KEY=VALUE (they once went as one list repr)
    cfg = RunConfig(model="synthetic", dataset="digits", workers=2, iterations=3,
                    model_args=["numel=1M"]).validate()
    flags = cluster.config_flags(cfg)
    assert flags[flags.index("--model-arg") + 1] == "numel=1M"
    assert resolve_config(build_parser().parse_args(["--rank", "0", *flags])) == cfg


def _hostfile_run(tmp_path, hostfile_text, *extra, env=None):
    (tmp_path / "hosts").write_text(hostfile_text)
    env = {**os.environ, **(env or {}), "FAKE_RSH_LOG": str(tmp_path / "rsh.log")}
    return subprocess.Popen(python_module(
        "psparse.launch", "--out", str(tmp_path / "run"), "--hostfile", str(tmp_path / "hosts"),
        "--rsh", f"bash {FAKE_RSH}", "--server-host", "127.0.0.1", "--bind", "127.0.0.1",
        "--port", str(free_port()), "--workers", "3", "--model", "mlp", "--dataset", "digits",
        *extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.mark.long
def test_hostfile_launch_through_the_remote_shell(tmp_path):
    """... and a float-kernel cap set here reaches every host (docs/api.md, Determinism)."""
    proc = _hostfile_run(tmp_path, "localhost slots=2  # first host\n127.0.0.1 slots=2\n",
                         "--iterations", "30", "--timeout", "20",
                         env={"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"})
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    calls = [line.split("\t") for line in (tmp_path / "rsh.log").read_text().splitlines()]
    calls.sort(key=lambda call: int(re.search(r"--rank '?(\d+)", call[1]).group(1)))
    assert [host for host, _ in calls] == ["localhost", "localhost", "127.0.0.1"]
    assert all(f"cd {os.getcwd()}" in cmd and "LOCAL_RANK=" in cmd and "--rank" in cmd
               and "ONEDNN_MAX_CPU_ISA=AVX512_CORE" in cmd for _, cmd in calls)
    assert "rank 2| [rank 2" in out  # output prefixed by rank
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["world_size"] == 3
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 30
    ranks = [json.loads((tmp_path / "run" / f"rank-{r}.json").read_text()) for r in range(3)]
    assert len({r["checksum"] for r in ranks}) == 1


@pytest.mark.long
def test_hostfile_launch_of_a_user_script(tmp_path):
    """TRAIN.PY through the remote shell: torchrun's variables and the configuration inline
    (PSPARSE_CONFIG_JSON: no shared filesystem assumed)."""
    script = str(Path(__file__).resolve().parent / "user_train.py")
    proc = _hostfile_run(tmp_path, "localhost slots=2\n127.0.0.1 slots=1\n", "--policy", "core",
                         "--density", "0.05", script, "--iterations", "20")
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    calls = [line.split("\t") for line in (tmp_path / "rsh.log").read_text().splitlines()]
    # in rank order (the remote shells start at once and may log in any order on a busy host)
    calls.sort(key=lambda call: int(re.search(r"\bRANK=(\d+) ", call[1]).group(1)))
    assert [host for host, _ in calls] == ["localhost", "localhost", "127.0.0.1"]
    for rank, (_, cmd) in enumerate(calls):
        assert f"RANK={rank} " in cmd and "WORLD_SIZE=3" in cmd and "PSPARSE_CONFIG_JSON=" in cmd
        assert f"{script} --iterations 20" in cmd
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "ok"
    ranks = [json.loads((tmp_path / "run" / f"rank-{r}.json").read_text()) for r in range(3)]
    assert len({r["checksum"] for r in ranks}) == 1 and ranks[0]["policy"].startswith("core")


def test_a_failing_remote_host_ends_the_run_everywhere(tmp_path):
    proc = _hostfile_run(tmp_path, "localhost slots=2\ndeadhost slots=1\n",
                         "--iterations", "100000", "--timeout", "10")
    t0 = time.monotonic()
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 255, out  # ssh's exit code, propagated
    assert "rank-2 exited with code 255" in out and "No route to host" in out
    assert time.monotonic() - t0 < 60
    time.sleep(0.5)
    assert not [p for p in descendants(proc.pid) if alive(p)]


def test_worker_takes_rank_world_size_and_server_from_the_environment(tmp_path):
    server = subprocess.Popen(python_module("psparse.server", "--workers", "2", "--port", "0",
                                            "--out", str(tmp_path)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (tmp_path / "server.port").is_file():
        time.sleep(0.05)
    port = (tmp_path / "server.port").read_text().strip()
    workers = []
    for rank in range(2):  # what torchrun sets, plus where the psparse server is
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "PSPARSE_PORT": port}
        workers.append(subprocess.Popen(python_module("psparse.training.loop", "--model", "mlp",
                                                      "--dataset", "digits", "--iterations",
                                                      "10"), env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True))
    outs = [w.communicate(timeout=120)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outs
    assert server.wait(timeout=30) == 0


def test_slurm_helpers():
    env = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1"}
    assert cluster.slurm_workers(env) == 8 and environment.rank_from_env(env) == 5
    assert environment.world_size_from_env(env) == 8
    cfg = RunConfig(workers=8).validate()
    cmd = cluster.srun_command(cfg, "node-a:5555", "/runs/x")
    assert cmd[:5] == ["srun", "--ntasks", "8", "--kill-on-bad-exit=1", "--label"]
    assert "--rank" not in cmd and cmd[cmd.index("--connect") + 1] == "node-a:5555"
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST is not set"):
        cluster.slurm_nodes({})


def test_processes_started_alone_load_their_kernels_before_the_first_round(tmp_path):
    """--hostfile: every worker and the server (neither forked from a warm launcher) load the
    compiled kernels they run at start-up, says how long it took, and does so
    before registering, so round 1 does not pay for them (issue 38's cold start). A model of
    20,000 parameters: above SMALL, so its calls run compiled."""
    proc = _hostfile_run(tmp_path, "localhost slots=3\n", "--model", "synthetic",
                         "--model-arg", "numel=20000", "--iterations", "5", "--eval-every", "0",
                         "--timeout", "30")
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    for name in ("rank-0", "rank-1", "rank-2"):
        log = (tmp_path / "run" / "logs" / f"{name}.log").read_text()
        loaded = log.index("CPU kernels (select_kernels, codec_kernels) loaded in")
        assert loaded < log.index("registered: numel=20000"), log
        # said before too: compiling them on a slow host can outlast --register-timeout
        assert log.index("loading CPU kernels (select_kernels, codec_kernels)") < loaded, log
    server = (tmp_path / "run" / "logs" / "server.log").read_text()
    assert server.index("CPU kernels (agg_kernels, codec_kernels) loaded in") < \
        server.index("3 workers registered"), server
