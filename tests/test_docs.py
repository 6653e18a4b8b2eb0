"""The docs document every command-line flag (docs/cli.md), every run-directory field
(docs/run-directory.md), the protocol (docs/protocol.md), and the README stays a front page."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from psparse import launch, server
from psparse.training import loop

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CLI = (ROOT / "docs" / "cli.md").read_text()
RUN_DIRECTORY = (ROOT / "docs" / "run-directory.md").read_text()


@pytest.mark.parametrize("module", [launch, server, loop], ids=["launch", "server", "worker"])
def test_every_flag_is_in_the_cli_reference(module):
    flags = [s for a in module.build_parser()._actions for s in a.option_strings
             if s.startswith("--") and s != "--help"]
    missing = [f for f in flags if f"`{f}" not in CLI]
    assert not missing, f"docs/cli.md does not document {missing}"


def test_every_metrics_and_summary_field_is_in_the_run_directory_doc(tmp_path):
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
    missing = [k for k in [*record, *summary] if f"`{k}`" not in RUN_DIRECTORY]
    assert not missing, f"docs/run-directory.md does not document {missing}"



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
    from psparse.wire import protocol, run_description

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
    for field in run_description.RUN_FIELDS:
        assert f"| `{field}` |" in doc.split("## The run")[1].split("## Admission")[0]


def test_the_spec_example_proof_and_keys_are_what_the_code_computes():
    import hashlib
    import hmac

    import numpy as np

    from psparse.ops.codec import codec
    from psparse.wire import run_description

    expected = hmac.new(b"secret", b"psparse-register-v2\n1\n2\n00ff", hashlib.sha256).hexdigest()
    assert run_description.register_proof("secret", 1, 2, "00ff") == expected
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


def test_the_policy_help_and_readme_list_every_registered_policy():
    """`--policy` help (shared by psparse-launch and psparse-worker) and docs/cli.md name them
    all."""
    from psparse.config import HELP
    from psparse.policies import REGISTRY

    readme_row = next(line for line in CLI.splitlines() if line.startswith("| `--policy` |"))
    for name in REGISTRY:
        assert f" {name}," in HELP["policy"], name
        assert f"`{name}`" in readme_row, name


def test_the_spec_index_size_dense_switch_and_cache_key_examples():
    """docs/protocol.md: the dense switch uses the run's natural index size (not the message's
    index_dtype), -0.0 is not a nonzero value, a cached frame is the 8 raw digest bytes."""
    import numpy as np

    from psparse.ops.codec import codec
    from psparse.wire import protocol

    doc = " ".join((Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
                   .split())  # the wording below, whatever the line breaks
    assert "with `numel` 1000 a dense push is allowed only when `push_max` > 500" in doc
    natural = protocol.index_dtype_for(1000)
    assert natural == "int32" and protocol.index_dtype_for(2**31 - 1) == "int32"
    assert protocol.index_dtype_for(2**31) == "int64"
    assert not protocol.dense_is_smaller(500, 1000, natural)
    assert protocol.dense_is_smaller(501, 1000, natural)
    assert protocol.dense_is_smaller(400, 1000, "int64")  # what the server does NOT use
    # the server counts nonzero values with numpy: -0.0 is zero
    assert np.count_nonzero(np.array([-0.0, 0.0, 1.0], np.float32)) == 1
    # the cached frame example: raw digest bytes of [0, 3, 9]
    assert "the key of [0, 3, 9] is `E9 D6 C4 0C 7B 3F 93 17`" in doc
    assert codec.set_key(np.array([0, 3, 9])) == bytes.fromhex("e9d6c40c7b3f9317")


def test_the_spec_client_notes_hold_on_a_real_server(tmp_path):
    """What docs/protocol.md tells client writers, on a real psparse-server with raw msgpack:
    heartbeat_s is --timeout / 5; the dense switch uses the natural index size (an int64 dense
    push that only 12-byte pairs would justify is refused); -0.0 is not a nonzero value; the
    index_dtype of a dense message is not checked; after a refused push the set of the last
    accepted one may go by key (8 raw digest bytes, not hex); a push without loss is left out of
    the round's mean loss; metrics are never answered; server errors carry only message."""
    import hashlib

    import msgpack
    import numpy as np
    from conftest import ServerProcess

    from psparse.wire.transport import Channel

    numel = 1000
    s = ServerProcess(tmp_path, 2, timeout=10)
    # push_max 400 at iterations 0-1: 400 x 8 <= 4000 < 400 x 12; then 600: dense allowed
    run = dict(numel=numel, iterations=3, two_phase=False,
               steps=[[0, 10, 400, 0], [2, 10, 600, 0]], config={})
    a, b = Channel.client("127.0.0.1", s.port), Channel.client("127.0.0.1", s.port)

    def send(ch, header, *frames):
        ch.send([msgpack.packb({"v": 2, **header}), *frames])

    def recv(ch, timeout=10.0):
        while True:
            got = ch.recv(timeout)
            if got is None:
                return None
            header = msgpack.unpackb(bytes(got[1][0].buffer), raw=False)
            if header["type"] != "heartbeat":
                return header

    def push(ch, rank, it, idx, **kw):
        send(ch, {"type": "push", "iter": it, "rank": rank, "count": len(idx),
                  "index_dtype": "int32", "value_dtype": "float32", **kw},
             np.asarray(idx, "<i4").tobytes(), np.ones(len(idx), "<f4").tobytes())

    def dense(ch, rank, it, values, index_dtype):
        send(ch, {"type": "push", "iter": it, "rank": rank, "count": numel,
                  "index_dtype": index_dtype, "value_dtype": "float32", "dense": True},
             b"", np.asarray(values, "<f4").tobytes())

    try:
        send(a, {"type": "register", "rank": 0, "world_size": 2, "run": run})
        send(b, {"type": "register", "rank": 1, "world_size": 2})  # adopts
        ready = recv(a)
        assert recv(b)["type"] == "ready" and ready["heartbeat_s"] == 10 / 5
        first = [1, 5, 9]
        push(a, 0, 0, first, loss=2.0)
        push(b, 1, 0, [2])  # no loss: left out of the mean, not counted as 0
        assert recv(a)["type"] == "aggregate" and recv(b)["type"] == "aggregate"

        push(a, 0, 1, list(range(401)))  # over the cap: refused
        err = recv(a)
        assert err["type"] == "error" and set(err) == {"v", "type", "message"}
        key = hashlib.blake2b(np.array(first, "<i8").tobytes(), digest_size=8).digest()
        cached = {"type": "push", "iter": 1, "rank": 0, "count": 3, "index_dtype": "int32",
                  "value_dtype": "float32", "index_format": "cached"}
        send(b, {**cached, "rank": 1}, key.hex().encode(), np.ones(3, "<f4").tobytes())
        assert recv(b)["type"] == "error"  # a hex key is not a key
        one = np.zeros(numel)
        one[0] = 1.0
        dense(b, 1, 1, one, "int64")  # 400 x 12 > 4000, but the natural size is 4: refused
        assert "dense push refused" in recv(b)["message"]
        send(a, cached, key, np.ones(3, "<f4").tobytes())  # the older set, by key: accepted
        send(b, {"type": "metrics", "iter": 0, "rank": 1, "report": {"train_loss": 1.0}})
        assert recv(b, 1.0) is None  # metrics are never answered
        push(b, 1, 1, [3])
        assert recv(a)["type"] == "aggregate" and recv(b)["type"] == "aggregate"

        signed = np.zeros(numel)
        signed[:600] = 1.0
        signed[600:700] = -0.0  # zeros: 600 nonzero values, within push_max 600
        dense(a, 0, 2, signed, "no such dtype")  # not checked in a dense message
        dense(b, 1, 2, one, "int32")
        assert recv(a)["dense"] is True and recv(b)["dense"] is True
        for ch, rank in ((a, 0), (b, 1)):
            send(ch, {"type": "metrics", "iter": 2, "rank": rank, "report": {"final": True}})
        assert recv(a)["ok"] is True and recv(b)["ok"] is True
        assert s.wait()[0] == 0
    finally:
        a.close()
        b.close()
        s.kill()
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in metrics] == [2.0, None, None]
    assert [m["k"] for m in metrics] == [[3, 1], [3, 1], [numel, numel]]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rejected_messages"] == 3
    assert summary["test_acc"] is None and (tmp_path / "eval.jsonl").read_text() == ""
    doc = " ".join((Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
                   .split())
    assert "the server's `--timeout` ÷ 5" in doc and "5 × `heartbeat_s`" in doc


def test_protocol_lists_every_agreed_option():
    """docs/protocol.md names every option a worker sends in the run description's `config`
    (RunConfig.agreed()): a client writer must be able to fill all of them."""
    from psparse.config import RunConfig

    doc = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    para = doc[doc.index("fills `config` with its"):]
    para = para[:para.index("\n\n")]
    missing = [k for k in RunConfig().agreed() if f"`{k}`" not in para]
    assert not missing, f"docs/protocol.md's config list lacks {missing}"


def test_every_environment_variable_the_package_reads_is_documented():
    """PSPARSE_* variables the code reads (os.environ) appear in README.md or docs/*.md."""
    import re
    root = Path(__file__).resolve().parent.parent
    code = "\n".join(p.read_text() for p in (root / "psparse").rglob("*.py"))
    docs = README + "\n".join(p.read_text() for p in (root / "docs").glob("*.md"))
    used = set(re.findall(r"\bPSPARSE_[A-Z_]+\b", code))
    missing = sorted(v for v in used if f"`{v}" not in docs and f"${v}" not in docs)
    assert not missing, f"undocumented environment variables: {missing}"


def test_the_readme_is_a_front_page_and_its_map_is_complete():
    """README.md: short, the two commands and psparse.connect on its first screen; every doc
    it points to exists and every docs/*.md is on its map."""
    import re

    lines = README.splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move detail into docs/"
    first_screen = "\n".join(lines[:50])
    for needle in ("make demo", "make test", "psparse.connect"):
        assert needle in first_screen, needle
    linked = set(re.findall(r"\]\(([^)#]+)\)", README))
    for target in linked:
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"
    for doc in (ROOT / "docs").glob("*.md"):
        assert f"docs/{doc.name}" in linked, f"README.md's map does not list docs/{doc.name}"


def test_every_file_the_docs_name_exists():
    """`docs/x.md`, `psparse/y.py` and links between the docs name files that are there."""
    import re

    readmes = [ROOT / d / "README.md" for d in ("", "experiments", "benchmarks", "launch")]
    for doc in [*readmes, *(ROOT / "docs").rglob("*.md")]:
        text = doc.read_text()
        named = set(re.findall(r"\b((?:docs|psparse|experiments|benchmarks|launch|examples|tests)"
                               r"/[\w/-]+\.(?:md|py|cu|sh|toml))\b", text))
        named |= {str((doc.parent / t).resolve().relative_to(ROOT))
                  for t in re.findall(r"\]\(([\w./-]+\.md)\)", text)}
        # placeholders such as results/SWEEP.md name no file
        missing = sorted(n for n in named if not (ROOT / n).exists()
                         and not any(part.split(".")[0].isupper() for part in n.split("/")))
        assert not missing, f"{doc.relative_to(ROOT)} names missing files: {missing}"


def test_every_psparse_name_the_docs_give_exists():
    """`psparse.module.name` in the docs (an import path, a `python -m` module, a class a user
    subclasses) is a module or an attribute there: a move in the package's layout moves the
    docs too."""
    import importlib
    import re

    readmes = [ROOT / d / "README.md" for d in ("", "experiments", "benchmarks", "launch")]
    missing = []
    for doc in [*readmes, *(ROOT / "docs").rglob("*.md")]:
        for name in sorted(set(re.findall(r"(?<![\w/.-])psparse(?:\.[A-Za-z_]\w*)+",
                                          doc.read_text()))):
            parts = name.split(".")
            for i in range(len(parts), 0, -1):  # the longest importable prefix
                try:
                    obj = importlib.import_module(".".join(parts[:i]))
                    break
                except ImportError:
                    continue
            for attribute in parts[i:]:
                if not hasattr(obj, attribute):
                    missing.append(f"{doc.relative_to(ROOT)}: {name}")
                    break
                obj = getattr(obj, attribute)
    assert not missing, "\n".join(missing)
