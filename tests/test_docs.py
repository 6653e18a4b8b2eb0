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


def _spec_tables() -> dict[str, dict[str, tuple[str, str]]]:
    """docs/protocol.md's per-type field tables: type -> field -> (type, req./opt.)."""
    import re

    doc = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    tables = {}
    for section in re.split(r"^### ", doc, flags=re.M)[1:]:
        name = re.match(r"`(\w+)`", section)
        if not name:
            continue
        rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \| (req|opt)\. \|", section, flags=re.M)
        tables[name.group(1)] = {f: (t.strip(), r) for f, t, r in rows}
    return tables


def test_the_protocol_spec_lists_every_message_field_and_frame_count():
    """docs/protocol.md is the specification others implement: it must match the code."""
    from psparse import protocol

    doc = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    tables = _spec_tables()
    assert set(tables) == set(protocol.SCHEMAS)
    names = {int: "int", float: "num", bool: "bool", str: "str", dict: "map", list: "list"}
    for msg_type, required in protocol.SCHEMAS.items():
        optional = protocol.OPTIONAL.get(msg_type, {})
        spec = tables[msg_type]
        assert set(spec) == set(required) | set(optional), msg_type
        for field, types in [*required.items(), *optional.items()]:
            kind = "num" if types == (int, float) else names[types[0]]
            assert spec[field][0].startswith(kind), (msg_type, field, spec[field])
            assert spec[field][1] == ("req" if field in required else "opt"), (msg_type, field)
        frames = protocol.FRAME_COUNTS[msg_type]
        assert f"| `{msg_type}` |" in doc and f"| {frames}: header" in doc.split(
            f"| `{msg_type}` |")[1].splitlines()[0], msg_type
    assert f"(version {protocol.PROTOCOL_VERSION})" in doc
    for field in protocol.RUN_FIELDS:
        assert f"| `{field}` |" in doc.split("## The run")[1].split("## Admission")[0]


def test_the_spec_example_proof_and_keys_are_what_the_code_computes():
    import hashlib
    import hmac

    import numpy as np

    from psparse import codec, protocol

    expected = hmac.new(b"secret", b"psparse-register-v2\n1\n2\n00ff", hashlib.sha256).hexdigest()
    assert protocol.register_proof("secret", 1, 2, "00ff") == expected
    assert codec.encode_delta(np.array([3, 130])).tobytes() == bytes([0x03, 0x7F])
    assert codec.encode_delta(np.array([0, 300])).tobytes() == bytes([0x00, 0xAC, 0x02])
    assert codec.encode_bitmap(np.array([0, 3, 9]), 10).tobytes() == bytes([0x09, 0x02])
    key = hashlib.blake2b(np.array([0, 3, 9], "<i8").tobytes(), digest_size=8).digest()
    assert codec.set_key(np.array([0, 3, 9], np.int32)) == key


def test_python_version_is_the_same_everywhere():
    """tomllib is 3.11+: the README and setup.cfg say so."""
    import re

    setup = (Path(__file__).resolve().parent.parent / "setup.cfg").read_text()
    assert set(re.findall(r"python_requires = (.+)", setup)) == {">=3.11"}
    assert "Python 3.11+" in README and "3.10" not in README
