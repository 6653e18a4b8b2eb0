"""The GPU path's backend on the CPU: the CUDA C kernels emulated, host memory as device memory.

``EmulatedBackend`` is ``psparse.backends.cuda.CudaBackend``'s interface over
``psparse.backends.kernel_emu`` (the kernels compiled for the CPU, blocks one after another, threads
as fibers). With ``strict=True`` its arrays are ``DeviceArray``s, which refuse every implicit trip
to the host that would synchronise a GPU -- ``bool()``, ``int()``, ``float()``, ``.item()``,
``.get()``, ``np.asarray``, iterating, boolean masks, ``nonzero``, ``unique``, ``partition``, host
arrays mixed in -- with ``HostSync``, while arithmetic, reductions to device scalars, gathers and
metadata work: a round that runs under it makes exactly the crossings it counts (``copy_backs``,
``uploads``, ``reads``). Graph capture is emulated too: launches are recorded and replayed, and any
other array work inside a capture refuses (a graph would not replay it).
"""

from __future__ import annotations

import functools

import numpy as np

from ..ops import sources
from .cuda import SOURCES, THREADS, Backend, CaptureFailed, Graph, HostSync


class EmulatedBackend(Backend):
    """The same kernels on the CPU (``psparse.backends.kernel_emu``), host memory as device
    memory."""

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
        self._allocations_before = ALLOCATIONS

    def allocations(self) -> int | None:
        """Strict device arrays made with memory of their own since the backend was built
        (what would be pool allocations on a GPU); None when not strict (plain numpy)."""
        return ALLOCATIONS - self._allocations_before if self.strict else None

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
        self.kernel_launches += 1

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
        sources.check_launch(name, raw, self.signatures[name])

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
        self.copy_back_bytes += sum(host.nbytes for _, host in pairs)
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
ALLOCATIONS = 0  # strict device arrays made with memory of their own, in this process


def _not_while_capturing(what: str) -> None:
    if _CAPTURING:
        raise CaptureFailed(f"{what} inside a graph capture (only kernel launches replay)")


_REFUSED = {"nonzero", "flatnonzero", "argwhere", "unique", "partition", "argpartition",
            "extract", "compress", "setdiff1d", "union1d", "intersect1d", "in1d", "isin",
            "trim_zeros", "array_equal", "allclose", "tolist",
            # CuPy sizes the result from the data: int(x.max()) + 1, a read and a wait
            "bincount"}
# array methods that make a view, not new memory: allowed inside a graph capture (any other
# method allocates, and CuPy's relaxed capture lets a pool allocation alias memory the graph
# writes later)
_VIEWS = {"view", "reshape", "transpose", "swapaxes", "squeeze"}


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
        global ALLOCATIONS
        self._a = a
        if a.base is None:  # memory of its own (not a view): a pool allocation on a GPU
            ALLOCATIONS += 1

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

    def __repr__(self):  # metadata only: for tracebacks and debuggers
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype})"

    def __str__(self):  # CuPy prints the values: a read and a wait
        _refuse("str() (or print, or %s)")

    def __format__(self, spec):
        _refuse("an f-string or format()")

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
        if _CAPTURING and _gathers(key):
            _not_while_capturing("indexing with a device array (a gather: new memory)")
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
            if name not in _VIEWS:
                _not_while_capturing(f".{name}() (new memory)")
            return _rewrap(attr(*_unwrap(args), **_unwrap_kwargs(kwargs)))
        return method


def _gathers(key) -> bool:
    if isinstance(key, tuple):
        return any(_gathers(k) for k in key)
    return isinstance(key, DeviceArray)


def _unwrap_kwargs(kwargs):
    return {k: _unwrap(v) for k, v in kwargs.items()}


class StrictXP:
    """numpy's namespace for DeviceArrays: the functions CuPy has, results on the "device";
    host inputs (numpy arrays, lists) refused as CuPy refuses them or synchronises on them."""

    __name__ = "psparse.backends.cuda.StrictXP"

    def asarray(self, a, dtype=None):
        if isinstance(a, DeviceArray):
            return a if dtype is None or a.dtype == dtype else a.astype(dtype)
        raise HostSync("xp.asarray of host data (a blocking upload; use the backend's upload)")

    def ascontiguousarray(self, a, dtype=None):
        return self.asarray(a, dtype)

    def where(self, condition, *branches):
        if not branches:  # one argument: nonzero, a result of data-dependent size
            _refuse("xp.where() with one argument")
        return self.__getattr__("where")(condition, *branches)

    def histogram(self, a, bins=10, range=None, **kwargs):
        if not isinstance(bins, DeviceArray):  # bins from the data's min and max: a read
            _refuse("xp.histogram() without device bin edges")
        return self.__getattr__("histogram")(a, bins, range=range, **kwargs)

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
