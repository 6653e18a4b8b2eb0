"""Where the GPU path's kernels run, and the one door between device and host memory.

A *backend* owns a worker's device work: its array module (``xp``), its compiled kernels (both
CUDA C sources: ``kernels.CUDA_SOURCE`` and ``radix_source.RADIX_SOURCE``), its stream, and the
only two crossings the GPU exchange makes per round (docs/architecture.md, "The GPU
exchange"): ``copy_back`` (device to pinned host memory, then the round's one synchronisation)
and ``upload`` (pinned host memory to the device, asynchronous). Everything else a round does
is launched and never waited for.

* ``CudaBackend``: CuPy on a CUDA device, on a stream of its own that follows torch's stream
  through events (``follow_torch`` / ``lead_torch``).
* ``EmulatedBackend``: the same kernels compiled for the CPU (``psparse.kernel_emu``) over host
  memory. With ``strict=True`` its arrays are ``DeviceArray``s, which refuse every implicit
  trip to the host that would synchronise a GPU (``bool()``, ``int()``, ``float()``,
  ``.item()``, ``.get()``, ``np.asarray``, boolean masks, ``nonzero``, ``unique``,
  ``partition``...) with ``HostSync``: a round that runs under it makes exactly the crossings
  it counts (``copy_backs``, ``uploads``), which is how the tests prove the GPU exchange's
  synchronisation discipline on a machine without a GPU. ``PSPARSE_EMULATE_GPU=strict`` (or
  ``1``: not strict) makes a ``--device cpu`` worker run the GPU exchange this way.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from . import kernels, radix_source

THREADS = 256
SOURCES = (kernels.CUDA_SOURCE, radix_source.RADIX_SOURCE)


class HostSync(RuntimeError):
    """A device value was read into Python (or host data was pushed in) outside the sanctioned
    crossings: on a GPU that is a hidden synchronisation."""


def signatures() -> dict:
    out = {}
    for source in SOURCES:
        out.update(kernels.kernel_signatures(source))
    return out


class Backend:
    """What the GPU exchange needs of a device (see the module docstring)."""

    xp = np
    sm_count = 1
    capturing = False  # a graph capture is recording (nothing may be built or crossed)
    torch_device = "cpu"  # where torch tensors of this backend's memory live

    def __init__(self):
        self.signatures = signatures()
        self.copy_backs = 0  # synchronising device-to-host crossings of the rounds so far
        self.copied = None  # where the last copy back ended on the device's timeline
        self.uploads = 0
        self.reads = 0  # reads outside the rounds (checkpoints, digests, the final report)
        self._dummies: dict = {}
        self._staging: dict = {}

    name = "host"

    def report(self, rounds: int) -> dict:
        """rank-R.json's ``device``: the crossings made, in all and per round."""
        per = (lambda n: round(n / rounds, 3)) if rounds else (lambda n: None)
        return {"backend": self.name, "copy_backs": self.copy_backs, "uploads": self.uploads,
                "reads": self.reads, "copy_backs_per_iteration": per(self.copy_backs),
                "uploads_per_iteration": per(self.uploads)}

    # --------------------------------------------------------------------------- kernels
    def check(self, name: str, args: tuple) -> None:
        kernels.check_launch(name, args, self.signatures[name])

    def launch(self, name: str, grid: int, args: tuple, checked: bool = False) -> None:
        raise NotImplementedError

    def launch_over(self, name: str, n: int, args: tuple) -> None:
        """A grid-stride kernel of ``kernels.CUDA_SOURCE`` over n elements."""
        self.launch(name, min(max(1, -(-n // THREADS)), 8 * self.sm_count), args)

    def or_dummy(self, array, dtype):
        """``array``, or a one-element stand-in for a pointer the kernel will not read."""
        if array is not None:
            return array
        if dtype not in self._dummies:
            self._dummies[dtype] = self.xp.zeros(1, dtype=dtype)
        return self._dummies[dtype]

    # ------------------------------------------------------------------------- crossings
    def constant(self, host: np.ndarray):
        """A table built once on the host, on the device (at setup, not per round)."""
        raise NotImplementedError

    def pinned(self, name: str, count: int, dtype) -> np.ndarray:
        """A reusable page-locked host buffer of at least ``count`` entries (grows)."""
        dtype = np.dtype(dtype)
        held = self._staging.get(name)
        if held is None or held.size < count or held.dtype != dtype:
            held = self._allocate_pinned(max(count, 1024), dtype)
            self._staging[name] = held
        return held[:count]

    def _allocate_pinned(self, count: int, dtype) -> np.ndarray:
        return np.empty(count, dtype=dtype)

    def upload(self, name: str, host: np.ndarray, out=None):
        """``host`` onto the device, asynchronously through the pinned buffer ``name`` (each
        name holds one upload per round: the next round reuses it after its copy-back)."""
        raise NotImplementedError

    def copy_back(self, pairs) -> None:
        """[(device array, host array)]: every copy enqueued, then one wait (the round's
        synchronisation)."""
        raise NotImplementedError

    def read(self, array) -> np.ndarray:
        """A device array's values on the host, waiting for them: for what is not a round's
        work (checkpoints, state digests, the final report), never inside a round."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------ torch
    def from_torch(self, tensor):
        raise NotImplementedError

    def to_torch(self, array):
        raise NotImplementedError

    def follow_torch(self) -> None:
        """Our stream waits for what torch has queued so far (the backward pass)."""

    def lead_torch(self) -> None:
        """Torch's stream waits for what we have queued so far (the gradient we wrote)."""

    def stream_scope(self):
        import contextlib
        return contextlib.nullcontext()

    def mark(self):
        """A point on the device's timeline (``elapsed_ms`` between two once both passed)."""
        import time
        return time.perf_counter()

    def elapsed_ms(self, start, stop) -> float:
        return 1e3 * (stop - start)

    # ------------------------------------------------------------------------------ graphs
    def capture(self, work) -> Graph:
        """Record the kernels ``work()`` launches as a graph (launched with ``Graph.launch``)
        instead of running them: a round's selection as one launch (CUDA Graphs). Any
        crossing to the host inside ``work`` fails the capture (``CaptureFailed``)."""
        raise CaptureFailed(f"the {self.name} backend has no graphs")


class CaptureFailed(RuntimeError):
    """A graph could not be captured (a synchronisation inside, or no graph support)."""


class Graph:
    """A recorded sequence of launches; ``launch()`` runs it."""

    def __init__(self, launch):
        self.launch = launch


# ------------------------------------------------------------------------------------ CUDA
class CudaBackend(Backend):
    """CuPy kernels on one CUDA device, on psparse's own stream.

    The stream is made this thread's current CuPy stream, so every CuPy operation of the worker
    (allocations' memsets, fancy-index updates, elementwise work) is ordered with the kernels
    and the copies on it; threads of their own (an autograd hook, ``--overlap``) enter
    ``stream_scope()``. Torch's stream and this one are ordered by events (``follow_torch``,
    ``lead_torch``) on ``device``."""

    name = "cuda"
    torch_device = "cuda"

    def __init__(self, cupy, device_index: int | None = None):
        super().__init__()
        self.xp = cupy
        self.device_index = cupy.cuda.Device().id if device_index is None else device_index
        self.sm_count = cupy.cuda.Device(self.device_index).attributes["MultiProcessorCount"]
        self.functions = {}
        for source in SOURCES:
            self.functions.update(kernels.build_cupy_kernels(
                cupy, source, tuple(kernels.kernel_signatures(source))))
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()
        self._staged: dict = {}  # pinned buffer name -> the event after its last upload

    def launch(self, name, grid, args, checked=False):
        if grid <= 0:  # nothing to do (CuPy would launch one block)
            return
        if not checked:
            self.check(name, args)
        self.functions[name]((int(grid),), (THREADS,), args, stream=self.stream)

    @property
    def capturing(self) -> bool:
        return self.stream.is_capturing()

    def constant(self, host):
        if self.capturing:
            raise CaptureFailed("a table uploaded inside a graph capture")
        with self.stream:
            return self.xp.asarray(np.ascontiguousarray(host))

    def _allocate_pinned(self, count, dtype):
        memory = self.xp.cuda.alloc_pinned_memory(count * dtype.itemsize)
        return np.frombuffer(memory, dtype=dtype, count=count)

    def upload(self, name, host, out=None):
        self.uploads += 1
        done = self._staged.get(name)
        if done is not None:  # its previous copy has run (in a round, long since: no wait)
            done.synchronize()
        staging = self.pinned(name, host.size, host.dtype)
        staging[...] = host
        out = self.xp.empty(host.size, dtype=host.dtype) if out is None else out
        out.set(staging, stream=self.stream)
        self._staged[name] = self.mark()
        return out

    def copy_back(self, pairs):
        self.copy_backs += 1
        for device, host in pairs:  # asynchronous each (CuPy >= 13 would wait on every get)
            try:
                device.get(stream=self.stream, out=host, blocking=False)
            except TypeError:  # CuPy before 13: get on a stream never waits
                device.get(stream=self.stream, out=host)
        self.copied = self.mark()  # the copies' end on the device's timeline (passed below)
        self.stream.synchronize()

    def read(self, array):
        self.reads += 1
        out = np.empty(array.shape, dtype=array.dtype)
        array.get(stream=self.stream, out=out)
        self.stream.synchronize()  # CuPy >= 13 has waited already; older CuPy had not
        return out

    def from_torch(self, tensor):
        return self.xp.from_dlpack(tensor.detach())

    def to_torch(self, array):
        import torch
        return torch.from_dlpack(array)

    def _torch_stream(self):
        import torch
        stream = torch.cuda.current_stream(torch.device("cuda", self.device_index))
        return self.xp.cuda.ExternalStream(stream.cuda_stream)

    def follow_torch(self):
        event = self.xp.cuda.Event(disable_timing=True)
        event.record(self._torch_stream())
        self.stream.wait_event(event)

    def lead_torch(self):
        event = self.xp.cuda.Event(disable_timing=True)
        event.record(self.stream)
        self._torch_stream().wait_event(event)

    def stream_scope(self):
        return self.stream

    def mark(self):
        event = self.xp.cuda.Event()
        event.record(self.stream)
        return event

    def elapsed_ms(self, start, stop) -> float:
        return self.xp.cuda.get_elapsed_time(start, stop)

    def capture(self, work):
        stream = self.stream
        crossings = (self.copy_backs, self.uploads, self.reads)
        with stream:
            stream.begin_capture()
            try:
                work()
            except Exception as exc:
                try:
                    stream.end_capture()
                except Exception:
                    pass
                raise CaptureFailed(f"{type(exc).__name__}: {exc}") from None
            try:
                graph = stream.end_capture()
            except Exception as exc:  # the capture was invalidated (e.g. a synchronisation)
                raise CaptureFailed(f"{type(exc).__name__}: {exc}") from None
        if (self.copy_backs, self.uploads, self.reads) != crossings:
            raise CaptureFailed("the captured work crossed to the host")
        return Graph(lambda: graph.launch(stream))


# -------------------------------------------------------------------------------- emulated
class EmulatedBackend(Backend):
    """The same kernels on the CPU (``psparse.kernel_emu``), host memory as device memory."""

    def __init__(self, strict: bool = True, sm_count: int = 2, reverse: bool = False):
        super().__init__()
        from .kernel_emu import EmulatedKernels
        self.strict = strict
        self.name = "emulated-strict" if strict else "emulated"
        self.xp = StrictXP() if strict else np
        self.sm_count = sm_count
        self.emulators = {}
        for source in SOURCES:
            emu = EmulatedKernels(source, reverse=reverse)
            for name in emu.signatures:
                self.emulators[name] = emu
        self.launches: list[str] = []
        self._recording = None  # a capture's launches

    @property
    def capturing(self) -> bool:
        return self._recording is not None

    def launch(self, name, grid, args, checked=False):
        if grid <= 0:  # nothing to do
            return
        if self._recording is not None:  # a capture: recorded, run when the graph is
            self._recording.append((name, grid, args))
            return
        raw = tuple(a._a if isinstance(a, DeviceArray) else a for a in args)
        self.emulators[name].launch(name, int(grid), THREADS, raw)
        self.launches.append(name)

    def capture(self, work):
        """As CUDA Graphs do: the launches recorded, not run; a crossing to the host, or array
        work that is not a kernel launch (which a graph would not replay here), fails it."""
        global _CAPTURING
        self._recording = recorded = []
        before = (self.copy_backs, self.uploads, self.reads)
        _CAPTURING = True
        try:
            work()
        except HostSync as exc:
            raise CaptureFailed(str(exc)) from None
        finally:
            self._recording = None
            _CAPTURING = False
        if (self.copy_backs, self.uploads, self.reads) != before:
            raise CaptureFailed("the captured work crossed to the host")

        def replay():
            for name, grid, args in recorded:
                self.launch(name, grid, args, checked=True)
        return Graph(replay)

    def check(self, name, args):
        raw = tuple(a._a if isinstance(a, DeviceArray) else a for a in args)
        kernels.check_launch(name, raw, self.signatures[name])

    def constant(self, host):
        if self.capturing:
            raise CaptureFailed("a table uploaded inside a graph capture")
        return wrap(np.array(host, copy=True)) if self.strict else np.array(host, copy=True)

    def upload(self, name, host, out=None):
        self.uploads += 1
        if isinstance(host, DeviceArray) or not isinstance(host, np.ndarray):
            raise HostSync(f"upload {name!r}: expected a host numpy array, got "
                           f"{type(host).__name__}")
        if out is None:
            out = self.xp.empty(host.size, dtype=host.dtype)
        raw(out)[...] = host
        return out

    def copy_back(self, pairs):
        self.copy_backs += 1
        for device, host in pairs:
            host[...] = raw(device)
        self.copied = self.mark()

    def read(self, array):
        self.reads += 1
        return np.array(raw(array), copy=True)

    def from_torch(self, tensor):
        a = tensor.detach().numpy()
        return wrap(a) if self.strict else a

    def to_torch(self, array):
        import torch
        return torch.from_numpy(raw(array))


def raw(a):
    """The host memory behind an emulated device array."""
    return a._a if isinstance(a, DeviceArray) else a


def wrap(a):
    return a if isinstance(a, DeviceArray) else DeviceArray(np.asarray(a))


# ---------------------------------------------------------------------- the strict arrays
_CAPTURING = False  # an emulated graph capture is recording: array work would not replay


def _not_while_capturing(what: str) -> None:
    if _CAPTURING:
        raise CaptureFailed(f"{what} inside a graph capture (only kernel launches replay)")


_REFUSED = {"nonzero", "flatnonzero", "argwhere", "unique", "partition", "argpartition",
            "extract", "compress", "setdiff1d", "union1d", "intersect1d", "in1d", "isin",
            "trim_zeros", "array_equal", "allclose", "tolist"}


def _unwrap(value):
    if isinstance(value, DeviceArray):
        return value._a
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v) for v in value)
    if isinstance(value, np.ndarray) and value.ndim > 0:
        raise HostSync("a host numpy array mixed into device arithmetic (an implicit, "
                       "synchronous upload; use the backend's upload)")
    return value


def _rewrap(value):
    if isinstance(value, np.ndarray):
        return DeviceArray(value)
    if isinstance(value, (np.generic, bool, int, float)) and not isinstance(value, np.dtype):
        return DeviceArray(np.asarray(value))
    if isinstance(value, tuple):
        return tuple(_rewrap(v) for v in value)
    return value


def _refuse(what: str):
    raise HostSync(f"{what} of a device array: on a GPU this reads device memory into Python "
                   "and waits for the device (a hidden synchronisation)")


class DeviceArray(np.lib.mixins.NDArrayOperatorsMixin):
    """Host memory standing in for a CuPy array, refusing what would synchronise a GPU."""

    __slots__ = ("_a",)

    def __init__(self, a: np.ndarray):
        self._a = a

    # metadata is host-side on a GPU too
    shape = property(lambda self: self._a.shape)
    size = property(lambda self: self._a.size)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    flags = property(lambda self: self._a.flags)
    itemsize = property(lambda self: self._a.itemsize)

    def __len__(self):
        return len(self._a)

    def __repr__(self):
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype})"

    __str__ = __repr__

    def __bool__(self):
        _refuse("bool()")

    def __int__(self):
        _refuse("int()")

    def __float__(self):
        _refuse("float()")

    def __index__(self):
        _refuse("an index (operator.index)")

    def __complex__(self):
        _refuse("complex()")

    def __iter__(self):
        _refuse("iterating over the elements")

    def __array__(self, *args, **kwargs):
        _refuse("np.asarray / implicit conversion")

    def item(self, *args):
        _refuse(".item()")

    def tolist(self):
        _refuse(".tolist()")

    def get(self, *args, **kwargs):
        _refuse(".get() (outside the backend's copy_back)")

    def _key(self, key):
        if isinstance(key, tuple):
            return tuple(self._key(k) for k in key)
        if isinstance(key, DeviceArray):
            if key.dtype == bool:
                _refuse("boolean-mask indexing (a result of data-dependent size)")
            return key._a
        if isinstance(key, np.ndarray):
            raise HostSync("indexing a device array with a host array (an implicit upload)")
        if isinstance(key, list):
            raise HostSync("indexing a device array with a Python list (an implicit upload)")
        return key

    def __getitem__(self, key):
        return DeviceArray(np.asarray(self._a[self._key(key)]))

    def __setitem__(self, key, value):
        _not_while_capturing("an assignment to a device array")
        self._a[self._key(key)] = _unwrap(value)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        _not_while_capturing(f"numpy.{ufunc.__name__}")
        if "out" in kwargs:
            kwargs["out"] = tuple(_unwrap(o) for o in kwargs["out"])
        result = getattr(ufunc, method)(*_unwrap(inputs), **kwargs)
        if "out" in kwargs and method == "__call__":
            outs = kwargs["out"]
            return DeviceArray(outs[0]) if len(outs) == 1 else tuple(map(DeviceArray, outs))
        return _rewrap(result)

    def __getattr__(self, name):
        if name in _REFUSED:
            _refuse(f".{name}()")
        if name.startswith("__"):  # __array_interface__ & co: numpy would read the memory
            if name.startswith("__array"):
                _refuse("np.asarray / implicit conversion")
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if not callable(attr):
            return _rewrap(attr)

        def method(*args, **kwargs):
            return _rewrap(attr(*_unwrap(args), **_unwrap_kwargs(kwargs)))
        return method


def _unwrap_kwargs(kwargs):
    return {k: _unwrap(v) for k, v in kwargs.items()}


class StrictXP:
    """numpy's namespace for DeviceArrays: the functions CuPy has, results on the "device";
    host inputs (numpy arrays, lists) refused as CuPy refuses them or synchronises on them."""

    __name__ = "psparse.backend.StrictXP"

    def asarray(self, a, dtype=None):
        if isinstance(a, DeviceArray):
            return a if dtype is None or a.dtype == dtype else a.astype(dtype)
        raise HostSync("xp.asarray of host data (a blocking upload; use the backend's upload)")

    def ascontiguousarray(self, a, dtype=None):
        return self.asarray(a, dtype)

    def __getattr__(self, name):
        if name in _REFUSED:
            _refuse(f"xp.{name}()")
        attr = getattr(np, name)
        if not callable(attr) or isinstance(attr, type):
            return attr  # dtypes, constants

        @functools.wraps(attr)
        def function(*args, **kwargs):
            _not_while_capturing(f"xp.{name}")
            return _rewrap(attr(*_unwrap(args), **_unwrap_kwargs(kwargs)))
        return function


def device_backend(device, log=print):
    """The backend for a worker on ``device`` (a torch.device): the emulated one when
    ``PSPARSE_EMULATE_GPU`` asks for it, CUDA with CuPy on a CUDA device, else None (the host
    path; on a CUDA device without CuPy the gradient crosses to the host once per round)."""
    emulated = emulated_from_env()
    if emulated is not None:
        return emulated
    if device.type != "cuda":
        return None
    if os.environ.get("PSPARSE_GPU_PATH") == "host":  # the fallback, for comparisons
        log("PSPARSE_GPU_PATH=host: selection runs on the host (one gradient copy per "
            "iteration)")
        return None
    from .xp import CUPY_HINT, cupy_or_none
    cupy = cupy_or_none()
    if cupy is None:
        log("CuPy not found: selection runs on the host (one gradient copy per iteration; "
            f"{CUPY_HINT} for the GPU kernels)")
        return None
    cupy.cuda.Device(device.index or 0).use()
    return CudaBackend(cupy, device.index or 0)


def emulated_from_env():
    """The backend ``PSPARSE_EMULATE_GPU`` asks for (strict / 1), or None."""
    mode = os.environ.get("PSPARSE_EMULATE_GPU", "")
    if mode in ("", "0"):
        return None
    return EmulatedBackend(strict=mode == "strict")
