"""A short chaos run in make test-long (tests/chaos.py; make soak runs a long one): random SIGKILLs
of the workers and the server of a self-healing run, some while it writes a checkpoint or
restarts; the run must end exactly as an uninterrupted one."""

from __future__ import annotations

import pytest
from chaos import assert_same, chaos_run, launcher, run_args


@pytest.mark.long
def test_random_kills_over_a_self_healing_run_leave_it_identical(tmp_path):
    clean = tmp_path / "clean"
    proc = launcher(clean, run_args(300, 30))
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output
    said = []
    summary = chaos_run(tmp_path / "chaos", 300, 30, kills=4, seed=1, say=said.append)
    print("\n".join(said))
    assert sum(line.startswith("chaos: SIGKILL") for line in said) >= 3, said
    assert summary["restarts"] >= 3
    assert_same(tmp_path / "chaos", clean)
