"""Wire protocol: message codec and validation (see docs/protocol.md).

A message is a list of frames: one small msgpack header (a map), then raw binary frames: indices
and values for the types that carry a sparse vector, indices alone for the two-phase types. Large arrays never go inside
msgpack: raw frames are sent without a copy and viewed on receipt with ``numpy.frombuffer``.

``decode`` validates everything a peer controls and raises ``ProtocolError`` naming the problem;
callers answer with an ``error`` message and otherwise ignore the bad message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import numpy as np

from ..ops.codec import codec, reference
from ..ops.codec.codec import CodecError, KeyCache, codec_kernels
from ..ops.jit import REFERENCE, compiled
from ..ops.values.formats import FP32, MAX_BLOCK, ValueFormat, ValueFrameError, unpack

# 2: register proves the run token and carries the run description (``run``) instead of a
# digest of Python options; ready publishes the agreed run; push/propose lost ``budget``/``select``
# (the server takes both from the agreed run); aggregate may name the live ranks.
PROTOCOL_VERSION = 2
MAX_HEADER_BYTES = 64 * 1024

INDEX_DTYPES = {"int32": np.dtype("<i4"), "int64": np.dtype("<i8")}
# value frames (docs/protocol.md, "Value formats"; psparse/ops/values/formats.py): float32 unless a
# run's --values says otherwise; int8 and int4 carry "value_block" in the header
VALUE_DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")

# Message types. Each maps the header fields it requires to their Python types; every type also
# carries "v" (protocol version) and "type". Optional fields are listed in OPTIONAL. The
# specification of every field is docs/protocol.md; tests/test_docs.py checks the two agree.
_INT = (int,)
_NUM = (int, float)
_MAP = (dict,)
_LIST = (list,)
SCHEMAS: dict[str, dict[str, tuple]] = {
    # worker -> server, once: who I am; the run I train (or nothing: I adopt the others' run).
    "register": {"rank": _INT, "world_size": _INT},
    # server -> every worker, once: all ranks registered and agree; the run as agreed.
    "ready": {"world_size": _INT, "start": _INT, "run": _MAP, "token": (str,),
              "heartbeat_s": _NUM},
    # worker -> server, once per iteration: the selected entries of the accumulator.
    "push": {"iter": _INT, "rank": _INT, "count": _INT, "index_dtype": (str,),
             "value_dtype": (str,)},
    # two-phase rounds only, worker -> server: entries this worker proposes to the group.
    "propose": {"iter": _INT, "rank": _INT, "count": _INT, "index_dtype": (str,),
                "value_dtype": (str,)},
    # two-phase rounds only, server -> every worker: the proposed indices the group keeps.
    "indices": {"iter": _INT, "count": _INT, "index_dtype": (str,)},
    # two-phase rounds of a sharded run (S > 1 key-range servers), instead of "indices": the
    # shard's best proposed indices with their scores (mean |value|); the workers pick the
    # group's indices across the shards (docs/protocol.md, "Server shards").
    "candidates": {"iter": _INT, "count": _INT, "index_dtype": (str,), "value_dtype": (str,)},
    # server -> every worker, once per iteration: the mean of the pushes at their index union.
    "aggregate": {"iter": _INT, "count": _INT, "index_dtype": (str,), "value_dtype": (str,),
                  "workers": _INT},
    # worker -> server: evaluation results or end-of-run facts; written to the run directory.
    "metrics": {"iter": _INT, "rank": _INT, "report": _MAP},
    # server -> worker: the run is over (ok) or aborted (not ok, with the reason).
    "shutdown": {"ok": (bool,), "reason": (str,)},
    # either direction: the previous message was rejected, and why; from a worker: it gives up.
    "error": {"message": (str,)},
    # liveness: workers send rank + the token from "ready" on a second connection; the server
    # sends an empty one to waiting workers. Never answered.
    "heartbeat": {},
}
OPTIONAL: dict[str, dict[str, tuple]] = {
    # run: the run description (absent: adopt the agreed one from "ready"); checksum: of the
    # initial weights (absent: this worker opts out of replica comparison); start: resume
    # point; nonce + proof: the run-token HMAC (required when the server has a run token).
    "register": {"run": _MAP, "checksum": (str,), "start": _INT, "nonce": (str,),
                 "proof": (str,), "shard": _LIST},
    # dense: the index frame is empty and the values are the whole vector (count = numel);
    # sent when that is smaller than the sparse form (SparCML's switch).
    # part: in a run with parts (the run's "parts"), which key range this push holds.
    # overflow: this worker's gradient is not finite (a GradScaler step to skip): count 0.
    # stop: this rank asks to end the run with this round (docs/protocol.md, Stopping).
    # value_block: values per float32 scale of an int8/int4 value frame (required with them).
    "push": {"loss": _NUM, "checksum": (str,), "dense": (bool,), "index_format": (str,),
             "part": _INT, "overflow": (bool,), "stop": (bool,), "value_block": _INT},
    # live: the ranks still in an elastic run, once some were lost (absent: all ranks).
    # part: in a run with parts, which key range this aggregate holds.
    # overflow: some push of the round had overflow: every worker skips the step (count 0).
    # stop: a push of this round asked to end the run: it is the last round for every rank.
    "aggregate": {"dense": (bool,), "index_format": (str,), "live": _LIST, "part": _INT,
                  "overflow": (bool,), "stop": (bool,), "value_block": _INT},
    "propose": {"index_format": (str,), "value_block": _INT},
    "indices": {"index_format": (str,)},
    "candidates": {"index_format": (str,)},
    # nonce + proof: a worker that fails before its register was accepted proves the run token
    # as a register does (prefix psparse-error-v2), so a stranger cannot end the run.
    "error": {"iter": _INT, "rank": _INT, "nonce": (str,), "proof": (str,)},
    "metrics": {"checksum": (str,)},
    "heartbeat": {"rank": _INT, "token": (str,)},
}
# frames: header, indices, values
SPARSE_TYPES = frozenset({"push", "aggregate", "propose", "candidates"})
INDEX_TYPES = frozenset({"indices"})  # frames: header, indices
FRAME_COUNTS = {t: 3 if t in SPARSE_TYPES else 2 if t in INDEX_TYPES else 1 for t in SCHEMAS}



class ProtocolError(ValueError):
    """A received message is malformed; the text names the problem."""


@dataclass
class Message:
    type: str
    header: dict
    indices: np.ndarray | None = None
    values: np.ndarray | None = None
    extra: dict = field(default_factory=dict)

    def __getitem__(self, key):
        return self.header[key]

    def get(self, key, default=None):
        return self.header.get(key, default)


def index_dtype_for(numel: int) -> str:
    """The narrowest index dtype that addresses ``numel`` entries."""
    return "int32" if numel <= np.iinfo(np.int32).max else "int64"


def encode(msg_type: str, indices: np.ndarray | None = None, values: np.ndarray | None = None,
           *, model_size: int | None = None, cache: KeyCache | None = None,
           shared: dict | None = None, value_format: ValueFormat = FP32,
           value_frame: np.ndarray | None = None, **fields) -> list:
    """Build the frames of one message. Sparse types take ``indices`` and ``values``.

    With ``model_size`` the index frame takes the smallest of the raw, delta and bitmap encodings
    (``codec``); with a ``cache`` too, a set the receiver already holds goes as an 8-byte key.
    ``shared``: the same dict for every message of one broadcast (the same indices to several
    connections): the index frame is encoded once, and the key caches share one copy.
    ``value_format``: the value frame's format (float32 by default; psparse/ops/values/formats.py);
    ``value_frame``: that frame, packed already (``ValueFormat.encode``; ``values`` may then
    be None), else packed here, once per broadcast with ``shared``.
    """
    if msg_type not in SCHEMAS:
        raise ValueError(f"unknown message type {msg_type!r}")
    header = {"v": PROTOCOL_VERSION, "type": msg_type, **fields}
    if fields.get("dense"):
        values = np.ascontiguousarray(values, dtype=np.float32)
        header.update(count=int(values.size), index_dtype="int32",
                      value_dtype=value_format.dtype, **value_format.header())
        return [msgpack.packb(header), b"", _value_frame(values, value_format, value_frame,
                                                         shared)]
    if msg_type in SPARSE_TYPES:
        if indices is None or (values is None and value_frame is None):
            raise ValueError(f"{msg_type} needs indices and values")
        indices = np.ascontiguousarray(indices)
        if value_frame is None:
            values = np.ascontiguousarray(values, dtype=np.float32)
        if indices.dtype not in (np.int32, np.int64):
            raise ValueError(f"indices must be int32 or int64, got {indices.dtype}")
        header.update(count=int(indices.size), index_dtype=str(indices.dtype),
                      value_dtype=value_format.dtype, **value_format.header())
        frame = _index_frame(header, indices, model_size, cache, shared)  # may set index_format
        return [msgpack.packb(header), frame, _value_frame(values, value_format, value_frame,
                                                           shared)]
    if msg_type in INDEX_TYPES:
        if indices is None:
            raise ValueError(f"{msg_type} needs indices")
        indices = np.ascontiguousarray(indices)
        if indices.dtype not in (np.int32, np.int64):
            raise ValueError(f"indices must be int32 or int64, got {indices.dtype}")
        header.update(count=int(indices.size), index_dtype=str(indices.dtype))
        frame = _index_frame(header, indices, model_size, cache, shared)
        return [msgpack.packb(header), frame]
    return [msgpack.packb(header)]


def _value_frame(values: np.ndarray, value_format: ValueFormat,
                 packed: np.ndarray | None, shared: dict | None) -> np.ndarray:
    """The value frame: ``packed`` when given, else ``values`` packed (once for all the
    messages of a broadcast that share ``shared``)."""
    if packed is not None:
        return packed
    if shared is None:
        return value_format.pack(values)
    if "value_frame" not in shared:
        shared["value_frame"] = value_format.pack(values)
    return shared["value_frame"]


def _index_frame(header: dict, indices: np.ndarray, numel: int | None, cache: KeyCache | None,
                 shared: dict | None = None):
    """The index frame in its smallest form; records the chosen form in the header."""
    key = cache.match(indices) if cache is not None else None
    if key is not None:
        fmt, frame = "cached", key
    elif numel is None:
        fmt, frame = "raw", indices
    elif shared is not None:
        if "frame" not in shared:
            shared["frame"] = codec.encode_smallest(indices, numel, indices.dtype.itemsize)
        fmt, frame = shared["frame"]
    else:
        fmt, frame = codec.encode_smallest(indices, numel, indices.dtype.itemsize)
    if cache is not None:
        slot = None
        if shared is not None:
            slot = shared.get("slot") or shared.setdefault("slot", KeyCache.shared_slot(indices))
        cache.remember(indices, sent=True, key=key, slot=slot)
    if fmt != "raw":
        header["index_format"] = fmt
    return frame


def decode(frames, numel: int | None = None, max_count: int | None = None,
           cache: KeyCache | None = None, remember: bool = True, scope=None,
           admit=None) -> Message:
    """Parse and validate one received message; ProtocolError on anything malformed.

    ``numel`` bounds the indices of sparse messages ([0, numel)); ``max_count`` bounds their entry
    count (defaults to ``numel``); ``cache`` resolves key-cached index sets and, with
    ``remember``, records the received set (refused sets are not: a receiver that may refuse
    records on acceptance). ``scope(header)`` returns the (numel, cache) of a run's part, or
    raises ProtocolError; so may ``admit(msg)``, given the checked header before any other
    frame is read (a server's check of the sender)."""
    if not frames:
        raise ProtocolError("empty message")
    head = _buffer(frames[0])
    if len(head) > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame is {len(head)} bytes, limit {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(head, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several exception types for garbage
        raise ProtocolError(f"header is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a map, got {type(header).__name__}")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} not supported (expected "
                            f"{PROTOCOL_VERSION})")
    msg_type = header.get("type")
    if msg_type not in SCHEMAS:
        raise ProtocolError(f"unknown message type {msg_type!r}")
    _check_fields(msg_type, header)

    expected_frames = FRAME_COUNTS[msg_type]
    if len(frames) != expected_frames:
        raise ProtocolError(f"{msg_type} message has {len(frames)} frames, expected "
                            f"{expected_frames}")
    msg = Message(msg_type, header)
    if admit is not None:
        admit(msg)
    if scope is not None:
        numel, cache = scope(header)
    limit = max_count if max_count is not None else numel
    if msg_type in SPARSE_TYPES:  # the value frame's share of the message (byte counters)
        msg.extra["value_bytes"] = len(_buffer(frames[2]))
    if header.get("dense"):
        msg.values = _decode_dense(header, frames[1], frames[2], numel)
    elif msg_type in SPARSE_TYPES:
        msg.indices, msg.values = _decode_sparse(header, frames[1], frames[2], numel, limit,
                                                 cache)
    elif msg_type in INDEX_TYPES:
        msg.indices, _ = _decode_sparse(header, frames[1], None, numel, limit, cache)
    if remember and cache is not None and msg.indices is not None:
        cache.remember(msg.indices, sent=False)
    return msg


def _check_fields(msg_type: str, header: dict) -> None:
    schema, optional = SCHEMAS[msg_type], OPTIONAL.get(msg_type, {})
    for name, types in schema.items():
        if name not in header:
            raise ProtocolError(f"{msg_type} header lacks field {name!r}")
        check_type(msg_type, name, header[name], types)
    for name, value in header.items():
        if name in ("v", "type") or name in schema:
            continue
        if name not in optional:
            raise ProtocolError(f"{msg_type} header has unknown field {name!r}")
        check_type(msg_type, name, value, optional[name])
    for name in ("iter", "rank", "count", "start", "workers", "part"):
        if name in header and header[name] < 0:
            raise ProtocolError(f"{msg_type} field {name!r} is negative ({header[name]})")
    if "world_size" in header and header["world_size"] < 1:
        raise ProtocolError(f"{msg_type} field 'world_size' must be >= 1")
    if "live" in header and not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                                    for r in header["live"]):
        raise ProtocolError(f"{msg_type} field 'live' must be a list of non-negative ints")
    if "shard" in header:
        shard = header["shard"]
        if not (len(shard) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                        for x in shard) and 0 <= shard[0] < shard[1]):
            raise ProtocolError(f"{msg_type} field 'shard' must be [I, S], two ints with "
                                "0 <= I < S")


def check_type(msg_type: str, name: str, value, types: tuple) -> None:
    # bool is a subclass of int in Python; a true/false where a number belongs is a bug upstream.
    if isinstance(value, bool) and bool not in types:
        ok = False
    else:
        ok = isinstance(value, types)
    if not ok:
        want = " or ".join(t.__name__ for t in types)
        raise ProtocolError(f"{msg_type} field {name!r} must be {want}, got "
                            f"{type(value).__name__}")
    if isinstance(value, float) and not np.isfinite(value):
        raise ProtocolError(f"{msg_type} field {name!r} is not finite")


def _decode_sparse(header, idx_frame, val_frame, numel, max_count, cache=None):
    count = header["count"]
    idx_dtype = INDEX_DTYPES.get(header["index_dtype"])
    if idx_dtype is None:
        raise ProtocolError(f"index_dtype {header['index_dtype']!r} not supported "
                            f"(use one of {sorted(INDEX_DTYPES)})")
    if max_count is not None and count > max_count:
        raise ProtocolError(f"count {count} exceeds the limit {max_count}")
    idx_buf = _buffer(idx_frame)
    fmt = header.get("index_format", "raw")
    if fmt == "raw":
        if len(idx_buf) != count * idx_dtype.itemsize:
            raise ProtocolError(f"index frame is {len(idx_buf)} bytes, expected {count} x "
                                f"{idx_dtype.itemsize}")
        indices = np.frombuffer(idx_buf, dtype=idx_dtype)
    else:
        indices = _decode_index_format(fmt, idx_buf, count, numel, cache, idx_dtype)
    values = None
    if val_frame is not None:
        values = _decode_values(header, val_frame, count)
    if count:
        # Strictly increasing indices: no duplicates (so ``acc[idx] += val`` is exact), cheap
        # range check on the two ends, and a canonical order for compact encodings. The
        # delta, bitmap and cached forms hold such sets by construction (their decoders refuse
        # anything else; a cached set was checked when it was first sent or accepted), so only
        # a raw frame is read for order; every form is checked against numel at its last index.
        # One compiled pass (codec_kernels.check_sparse) over the frames where they lie.
        problem = sparse_frame_problem(indices, values, numel, check_order=fmt == "raw")
        if problem is not None:
            raise ProtocolError(problem)
    return indices, values


_NO_VALUES = np.empty(0, dtype=np.float32)


def sparse_frame_problem(indices: np.ndarray, values: np.ndarray | None, numel: int | None,
                         check_order: bool) -> str | None:
    """What is wrong with a received sparse frame, in the order the protocol names it (order,
    a negative first index, the last index against numel, non-finite values), or None."""
    if not compiled(indices.size):  # jit.SMALL: the same answer without loading numba
        return reference.sparse_frame_problem(indices, values, numel, check_order)
    # the kernels read whole cache lines from the arrays' start: contiguous (no copy when so)
    flags = codec_kernels.check_sparse(np.ascontiguousarray(indices),
                                       _NO_VALUES if values is None else
                                       np.ascontiguousarray(values),
                                       -1 if numel is None else numel, check_order)
    if flags & codec_kernels.BAD_ORDER:
        return "indices must be strictly increasing (sorted, no duplicates)"
    if flags & codec_kernels.NEGATIVE:
        return f"index {int(indices[0])} is negative"
    if flags & codec_kernels.OUT_OF_RANGE:
        return f"index {int(indices[-1])} out of range [0, {numel})"
    if flags & codec_kernels.NOT_FINITE:
        return "values contain NaN or Inf"
    return None


def all_finite(values: np.ndarray) -> bool:
    """Whether no value is NaN or +-Inf: one compiled pass that allocates nothing."""
    if not compiled(values.size):
        return reference.all_finite(values)
    return bool(codec_kernels.all_finite(np.ascontiguousarray(values)))


def _decode_index_format(fmt, buf, count, numel, cache, dtype=np.int64) -> np.ndarray:
    data = np.frombuffer(buf, dtype=np.uint8)
    try:
        if fmt == "delta":  # in the header's dtype, as a raw frame is
            return codec.decode_delta(data, count, dtype)
        if fmt == "bitmap":
            if numel is None:
                raise ProtocolError("bitmap index frame needs the model size")
            return codec.decode_bitmap(data, count, numel)
        if fmt == "cached":
            if cache is None:
                raise ProtocolError("cached index set on a connection without a key cache")
            indices = cache.lookup(bytes(buf))
            if indices.size != count:
                raise ProtocolError(f"cached index set has {indices.size} indices, count is "
                                    f"{count}")
            return indices
    except CodecError as exc:
        raise ProtocolError(str(exc)) from None
    raise ProtocolError(f"index_format {fmt!r} unknown (use one of {list(codec.FORMATS)})")


def dense_is_smaller(count: int, numel: int, index_dtype: str = "int32",
                     value_format: ValueFormat = FP32) -> bool:
    """True when sending all numel values beats count (index, value) pairs (in
    ``value_format``)."""
    return count * INDEX_DTYPES[index_dtype].itemsize + value_format.frame_bytes(count) > \
        value_format.frame_bytes(numel)


def _decode_values(header: dict, val_frame, count: int) -> np.ndarray:
    """A value frame's float32 values (a view of a float32 frame, decoded otherwise)."""
    dtype = header["value_dtype"]
    if dtype not in VALUE_DTYPES:
        raise ProtocolError(f"value_dtype {dtype!r} not supported (use one of "
                            f"{list(VALUE_DTYPES)})")
    block = header.get("value_block")
    if dtype in ("int8", "int4"):
        if block is None:
            raise ProtocolError(f"{dtype} values need the header field 'value_block'")
        if not 1 <= block <= MAX_BLOCK:
            raise ProtocolError(f"value_block must be in [1, {MAX_BLOCK}] (2^20), got {block}")
    elif block is not None:
        raise ProtocolError(f"value_block is for int8 and int4 values, not {dtype}")
    try:
        return unpack(_buffer(val_frame), dtype, count, block)
    except ValueFrameError as exc:
        raise ProtocolError(str(exc)) from None


def _decode_dense(header, idx_frame, val_frame, numel):
    if len(_buffer(idx_frame)):
        raise ProtocolError("dense message must have an empty index frame")
    if numel is not None and header["count"] != numel:
        raise ProtocolError(f"dense message has {header['count']} values, the model {numel}")
    values = _decode_values(header, val_frame, header["count"])
    if not all_finite(values):
        raise ProtocolError("values contain NaN or Inf")
    return values


def _buffer(frame) -> memoryview:
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    return memoryview(buf).cast("B") if not isinstance(buf, (bytes, bytearray)) else memoryview(buf)


if REFERENCE:  # PSPARSE_CPU_KERNELS=numpy: the numpy references instead of the kernels
    from ..ops.codec import reference as _reference

    sparse_frame_problem, all_finite = _reference.sparse_frame_problem, _reference.all_finite  # noqa: F811
