"""The run a worker registers with: its checks, its steps, the comparison, the token's proofs.

The run a worker registers with (docs/protocol.md, "The run"): its fields and their checks,
the step in force at an iteration, the type-strict comparison that tells two workers' runs
apart, and the HMAC proofs of the run token (docs/protocol.md, "Admission")."""

from __future__ import annotations

import hashlib
import hmac
import math

from ..ops.values.formats import FP32, MAX_BLOCK, WIRE_NAMES, ValueFormat
from .protocol import _INT, _LIST, _MAP, ProtocolError, check_type

# The run description a worker registers with (docs/protocol.md, "The run"): what every rank
# must agree on, in a form any language can build and compare.
RUN_FIELDS = {"numel": _INT, "iterations": _INT, "two_phase": (bool,), "steps": _LIST,
              "config": _MAP}
# parts: the boundaries of the key ranges a round is exchanged in (buckets of layers,
# --bucket-mb / --overlap); absent: one part, the whole vector.
# values: the value format of every push and aggregate (--values; absent: float32), as
# {"dtype": "int8", "block": 128, "server_memory": true} (docs/protocol.md, "Value formats").
# shard_edges: the S + 1 boundaries of the key-range shards' ranges (--shard-edges); absent:
# equal ranges.
RUN_OPTIONAL = {"parts": _LIST, "values": _MAP, "shard_edges": _LIST}
CONFIG_VALUE_TYPES = (type(None), bool, int, float, str)
REGISTER_PROOF_PREFIX = "psparse-register-v2"
ERROR_PROOF_PREFIX = "psparse-error-v2"


def check_run(run: dict) -> dict:
    """Validate a ``run`` map (docs/protocol.md, "The run"); returns it, or raises naming the
    problem."""
    for name, types in RUN_FIELDS.items():
        if name not in run:
            raise ProtocolError(f"run lacks field {name!r}")
        check_type("run", name, run[name], types)
    unknown = sorted(set(run) - set(RUN_FIELDS) - set(RUN_OPTIONAL))
    if unknown:
        raise ProtocolError(f"run has unknown field {unknown[0]!r}")
    numel, iterations = run["numel"], run["iterations"]
    if numel < 1 or iterations < 0:  # iterations 0: open-ended, until a rank asks to stop
        raise ProtocolError("run field 'numel' must be >= 1 and 'iterations' >= 0 (0: "
                            "open-ended)")
    for field in ("parts", "shard_edges"):  # boundaries of key ranges
        if field in run:
            edges = run[field]
            check_type("run", field, edges, RUN_OPTIONAL[field])
            if not (len(edges) >= 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                            for x in edges)
                    and edges[0] == 0 and edges[-1] == numel
                    and all(a < b for a, b in zip(edges, edges[1:]))):
                raise ProtocolError(f"run field {field!r} must be strictly increasing ints from "
                                    f"0 to numel ({numel}): the boundaries of the key ranges")
    if "values" in run:
        run_value_format(run)
    steps = run["steps"]
    if not steps:
        raise ProtocolError("run field 'steps' is empty")
    previous = -1
    for n, step in enumerate(steps):
        if not (isinstance(step, list) and len(step) == 4 and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in step)):
            raise ProtocolError(f"run step {n} must be [from_iter, budget, push_max, "
                                f"propose_max], non-negative ints")
        start, budget, push_max, propose_max = step
        if (n == 0) != (start == 0) or start <= previous:
            raise ProtocolError("run steps must start at iteration 0, in increasing order")
        if budget < 1 or push_max > numel or propose_max > numel:
            raise ProtocolError(f"run step {n}: budget must be >= 1 and push_max, "
                                f"propose_max <= numel ({numel})")
        if run["two_phase"] and push_max < 1:
            raise ProtocolError(f"run step {n}: a two-phase run keeps push_max >= 1 indices")
        previous = start
    for key, value in run["config"].items():
        items = value if isinstance(value, list) else [value]
        if not isinstance(key, str) or not all(isinstance(v, CONFIG_VALUE_TYPES) for v in items):
            raise ProtocolError(f"run config entry {key!r}: values must be nil, bool, int, "
                                "float, str or a list of those")
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            raise ProtocolError(f"run config entry {key!r} is not finite")
    return run


def run_value_format(run: dict):
    """The run's value format (``values.ValueFormat``) and whether the server keeps its error
    memory for the broadcast: (FP32, False) for a run without ``values``."""
    spec = run.get("values")
    if spec is None:
        return FP32, False
    if set(spec) != {"dtype", "block", "server_memory"}:
        raise ProtocolError("run field 'values' must be a map of exactly dtype, block and "
                            "server_memory")
    dtype, block, memory = spec["dtype"], spec["block"], spec["server_memory"]
    if dtype not in WIRE_NAMES or dtype == "float32":
        raise ProtocolError(f"run values.dtype must be one of {list(WIRE_NAMES)[1:]} "
                            f"(float32 runs leave 'values' out), got {dtype!r}")
    if not (isinstance(block, int) and not isinstance(block, bool) and 1 <= block <= MAX_BLOCK):
        raise ProtocolError(f"run values.block must be an int in [1, {MAX_BLOCK}]")
    if not isinstance(memory, bool):
        raise ProtocolError("run values.server_memory must be true or false")
    return ValueFormat(dtype, block), memory


def step_at(run: dict, iteration: int) -> tuple[int, int, int]:
    """(budget, push_max, propose_max) in force at ``iteration``: the last step starting at or
    before it."""
    current = run["steps"][0]
    for step in run["steps"]:
        if step[0] > iteration:
            break
        current = step
    return current[1], current[2], current[3]


def run_difference(a: dict, b: dict) -> str | None:
    """The first field where two run maps differ (type-strict: 1 and 1.0 differ), or None."""
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            return key
        if key == "config":
            inner = run_difference(a[key], b[key])
            if inner is not None:
                return f"config.{inner}"
        elif not same_value(a[key], b[key]):
            return key
    return None


def same_value(a, b) -> bool:
    """Equality that also compares types, as a decoded msgpack value (1 != 1.0 != true)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b


def register_proof(token: str, rank: int, world_size: int, nonce: str) -> str:
    """HMAC-SHA256 (key: the token's UTF-8 bytes) of "psparse-register-v2\n<rank>\n<world_size>
    \n<nonce>", as lowercase hex: what a register proves the run token with."""
    return _hmac(token, f"{REGISTER_PROOF_PREFIX}\n{rank}\n{world_size}\n{nonce}")


def error_proof(token: str, rank: int, nonce: str) -> str:
    """The same for a worker's ``error`` before its register was accepted, of
    "psparse-error-v2\n<rank>\n<nonce>" (no world size: it may be what the server refused)."""
    return _hmac(token, f"{ERROR_PROOF_PREFIX}\n{rank}\n{nonce}")


def _hmac(token: str, text: str) -> str:
    return hmac.new(token.encode(), text.encode(), hashlib.sha256).hexdigest()


def proof_is_valid(token: str, header: dict) -> bool:
    """Whether a register's (or, without ``world_size``, an error's) nonce and proof prove
    the run token."""
    nonce, proof = header.get("nonce"), header.get("proof")
    if not nonce or not proof or "rank" not in header:
        return False
    expected = register_proof(token, header["rank"], header["world_size"], nonce) \
        if "world_size" in header else error_proof(token, header["rank"], nonce)
    return hmac.compare_digest(expected, proof)
