"""A process without numba runs small calls through the numpy references (psparse/ops/jit.py,
``SMALL``) and gets what the kernels give, bytes and dtypes; the launcher's ``prepare`` starts
numba without loading every kernel when the cache is complete.

The kernels' side of each comparison runs here, in the test session (numba loaded: every call
compiled); the references' side in a fresh interpreter that must end without numba."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np

from psparse.ops import jit
from psparse.ops.codec import codec
from psparse.ops.codec.codec import CodecError
from psparse.server.aggregation import Aggregator
from psparse.wire import protocol

HERE = Path(__file__).resolve().parent


def small_calls() -> list:
    """Every gated call on small inputs, good and hostile: (what, dtype, bytes) or the error."""
    rng = np.random.default_rng(5)
    out = []

    def note(what, fn, *args):
        try:
            got = fn(*args)
        except (CodecError, IndexError, ValueError) as error:
            out.append((what, type(error).__name__, str(error)))
            return
        for part in got if isinstance(got, tuple) else (got,):
            part = np.asarray(part)
            out.append((what, str(part.dtype), part.tobytes()))

    for numel, k in ((2410, 120), (2410, 900), (50, 50), (7000, 1)):
        idx = np.sort(rng.choice(numel, k, replace=False))
        for dtype in (np.int32, np.int64):
            note("encode_smallest", codec.encode_smallest, idx.astype(dtype), numel)
            note("delta_size", codec.delta_size, idx.astype(dtype))
            frame = codec.encode_delta(idx)
            note("decode_delta", codec.decode_delta, frame, k, dtype)
            note("encode_bitmap", codec.encode_bitmap, idx.astype(dtype), numel)
        note("decode_bitmap", codec.decode_bitmap, codec.encode_bitmap(idx, numel), k, numel)
    for data, count in (([], 0), ([], 2), ([0x80], 1), ([1, 0], 2), ([1, 2], 3),
                        ([0xFF] * 6 + [1], 1), ([200, 1, 5], 2), ([0xFF] * 4 + [0x7F], 1)):
        note("decode_delta bad", codec.decode_delta, np.array(data, np.uint8), count, np.int32)
    note("decode_bitmap bad", codec.decode_bitmap, np.array([0xFF, 0x7], np.uint8), 11, 10)
    note("encode_bitmap outside", codec.encode_bitmap, np.array([-1, 3, 10], np.int64), 10)
    values = np.ones(4, np.float32)
    for idx, vals, numel in (([1, 2, 3, 4], values, 10), ([2, 1, 3, 4], values, 10),
                             ([-1, 2, 3, 4], values, 10), ([1, 2, 3, 10], values, 10),
                             ([1, 2, 3, 4], np.array([1, np.nan, 0, 0], np.float32), 10)):
        out.append(("frame problem", protocol.sparse_frame_problem(
            np.array(idx, np.int32), vals, numel, True)))
    out.append(("all_finite", protocol.all_finite(np.array([1, np.inf], np.float32))))
    for numel, dtype in ((2410, np.int32), (61, np.int64)):
        pushes = [np.sort(rng.choice(numel, 40, replace=False)).astype(dtype) for _ in range(3)]
        vals = [rng.standard_normal(40).astype(np.float32) for _ in range(3)]
        note("mean", Aggregator(numel).mean, pushes, vals)
        note("mean dense", Aggregator(numel).mean, [pushes[0], None],
             [vals[0], rng.standard_normal(numel).astype(np.float32)])
        note("mean none", Aggregator(numel).mean, [], [])
    return out


def in_fresh_process(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120,
                          cwd=HERE)


def test_small_calls_need_no_numba_and_give_what_the_kernels_give():
    assert "numba" in sys.modules  # conftest's warm_up: this side runs the kernels
    kernels = small_calls()
    done = in_fresh_process("import pickle, sys, test_small_calls as t; calls = t.small_calls(); "
                            "sys.stdout.buffer.write(pickle.dumps(('numba' in sys.modules, "
                            "calls)))")
    assert done.returncode == 0, done.stderr.decode()
    numba_loaded, references = pickle.loads(done.stdout)
    assert not numba_loaded
    assert len(references) == len(kernels)
    for want, got in zip(kernels, references):
        assert want == got


def test_long_varints_are_decoded_by_the_kernel():
    # only a varint of 8 bytes or more can bring a small frame's indices near 2**63, where the
    # reference's float64 bound on the gaps' sum differs from the kernel's: the kernel decides
    below = [0xFF] * 8 + [0x7F]  # 2**63 - 1
    frames = [(below, 1), ([1] + below, 2), ([0xFF] * 11 + [1], 1), ([0xFF] * 9 + [2], 1),
              ([0x80] * 7 + [1], 1)]
    want = []
    for data, count in frames:
        try:
            want.append(codec.decode_delta(np.array(data, np.uint8), count).tolist())
        except CodecError as error:
            want.append(str(error))
    done = in_fresh_process(
        "import json, sys, numpy as np; from psparse.ops.codec import codec; got = []\n"
        f"for data, count in {frames!r}:\n"
        "    try: got.append(codec.decode_delta(np.array(data, np.uint8), count).tolist())\n"
        "    except codec.CodecError as error: got.append(str(error))\n"
        "print(json.dumps([got, 'numba' in sys.modules]))")
    assert done.returncode == 0, done.stderr.decode()
    got, numba_loaded = json.loads(done.stdout)
    assert got == want and numba_loaded
    assert want[:2] == [[2**63 - 1], "delta-encoded indices overflow"]


def test_prepare_starts_numba_and_loads_only_what_a_child_runs():
    jit.warm_up()  # a complete cache, stamped
    probe = ("import json, numba, numpy as np; from psparse.ops import jit; from psparse.ops.aggregate import agg_kernels; "
             "from psparse.ops.codec import codec_kernels; from psparse.ops.codec import codec; "
             "jit.prepare(); kernels = {f.__name__: f for m in "
             "(agg_kernels, codec_kernels) for f in vars(m).values() "
             "if isinstance(f, numba.core.dispatcher.Dispatcher)}; "
             "loaded = sorted(n for n, f in kernels.items() if f.signatures); "
             "codec.encode_delta(np.arange(5)); "
             "misses = sum(sum(f.stats.cache_misses.values()) for f in kernels.values()); "
             "print(json.dumps([loaded, misses, kernels['encode_delta'].signatures != []]))")
    done = in_fresh_process(probe)
    assert done.returncode == 0, done.stderr.decode()
    loaded, misses, encoded = json.loads(done.stdout.decode().splitlines()[-1])
    assert loaded == ["divide"] and misses == 0 and encoded
