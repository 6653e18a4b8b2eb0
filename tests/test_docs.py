"""The README documents every command-line flag and every metrics field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from psparse import launch, server, worker

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


@pytest.mark.parametrize("module", [launch, server, worker], ids=["launch", "server", "worker"])
def test_every_flag_is_in_the_readme(module):
    flags = [s for a in module.build_parser()._actions for s in a.option_strings
             if s.startswith("--") and s != "--help"]
    missing = [f for f in flags if f"`{f}" not in README]
    assert not missing, f"README does not document {missing}"


def test_every_metrics_and_summary_field_is_in_the_readme(tmp_path):
    from conftest import ServerProcess
    from test_server import start_clients

    s = ServerProcess(tmp_path, 1)
    (c,) = start_clients(s, 1, 1)
    c.push(0, [1], [1.0], loss=0.5)
    c.recv()
    c.finish(0)
    assert s.wait()[0] == 0
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    summary = json.loads((tmp_path / "summary.json").read_text())
    missing = [k for k in [*record, *summary] if f"`{k}`" not in README]
    assert not missing, f"README does not document {missing}"



# console script name -> module, from setup.cfg's entry points
SCRIPTS = dict((name.strip(), target.strip().split(":")[0]) for name, target in
               (line.split("=") for line in
                (Path(__file__).resolve().parent.parent / "setup.cfg").read_text().splitlines()
                if line.strip().startswith("psparse-") and "=" in line))


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_console_script_prints_its_help(script):
    """--help is the first thing a user runs; argparse %-formats help text, so it can crash."""
    r = subprocess.run([sys.executable, "-m", SCRIPTS[script], "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout
