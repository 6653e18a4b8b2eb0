"""Where the GPU path's kernels run, and the one door between device and host memory.

A *backend* owns a worker's device work: its array module (``xp``), its compiled kernels (both
CUDA C sources: ``elementwise.cu`` and ``psparse/ops/select/radix.cu``), its stream, and the
only two crossings the GPU exchange makes per round (docs/architecture.md, "The GPU
exchange"): ``copy_back`` (device to pinned host memory, then the round's one synchronisation)
and ``upload`` (pinned host memory to the device, asynchronous). Everything else a round does
is launched and never waited for.

* ``CudaBackend``: CuPy on a CUDA device, on a stream of its own that follows torch's stream
  through events (``follow_torch`` / ``lead_torch``).
* ``EmulatedBackend`` (``psparse/backends/emulated.py``): the same kernels compiled for the CPU
  (``psparse.backends.kernel_emu``) over host memory, with strict device arrays that refuse every
  implicit trip to the host (``HostSync``): how the tests prove the GPU exchange's
  synchronisation discipline without a GPU. ``PSPARSE_EMULATE_GPU=strict`` (or ``1``: not
  strict) makes a ``--device cpu`` worker run the GPU exchange this way.
"""

from __future__ import annotations

import numpy as np

from ..ops import sources
from ..ops.select import radix
from ..ops.select.radix import CaptureFailed  # noqa: F401 (where the backends' users find it)
from .device_engines import DeviceDecaying, DeviceEngines, DeviceIndexSet

THREADS = 256
STEADY_AFTER = 3  # rounds before the steady state: the first builds the engines, the second
#                   captures a graph (where rounds replay one)
SOURCES = (sources.CUDA_SOURCE, sources.RADIX_SOURCE, sources.VALUES_SOURCE)


class HostSync(RuntimeError):
    """A device value was read into Python (or host data was pushed in) outside the sanctioned
    crossings: on a GPU that is a hidden synchronisation."""


def signatures() -> dict:
    out = {}
    for source in SOURCES:
        out.update(sources.kernel_signatures(source))
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
        self.copy_back_bytes = 0  # what they moved
        self.kernel_launches = 0  # kernels launched (a graph's replay counts its kernels)
        self.copied = None  # where the last copy back ended on the device's timeline
        self.uploads = 0
        self.reads = 0  # reads outside the rounds (checkpoints, digests, the final report)
        self._dummies: dict = {}
        self._staging: dict = {}
        self.rounds_ended = 0
        self._steady_from = None  # the counters when the steady state began

    name = "host"

    def allocations(self) -> int | None:
        """Device memory allocations so far (pool hits included), or None where not counted."""
        return None

    def _counters(self) -> dict:
        return {"copy_backs": self.copy_backs, "copy_back_bytes": self.copy_back_bytes,
                "kernel_launches": self.kernel_launches, "uploads": self.uploads,
                "allocations": self.allocations()}

    def end_round(self) -> None:
        """A round's device work is enqueued: the steady state's counters start after
        STEADY_AFTER of them."""
        self.rounds_ended += 1
        if self.rounds_ended == STEADY_AFTER:
            self._steady_from = self._counters()

    def report(self, rounds: int) -> dict:
        """rank-R.json's ``device``: the crossings made, in all and per round."""
        per = (lambda n: round(n / rounds, 3)) if rounds else (lambda n: None)
        return {"backend": self.name, "copy_backs": self.copy_backs, "uploads": self.uploads,
                "reads": self.reads, "copy_backs_per_iteration": per(self.copy_backs),
                "copy_back_bytes_per_iteration": per(self.copy_back_bytes),
                "kernel_launches_per_iteration": per(self.kernel_launches),
                "uploads_per_iteration": per(self.uploads),
                "allocations_per_iteration": None if self.allocations() is None else
                per(self.allocations()), "steady_state": self.steady_state()}

    def steady_state(self) -> dict | None:
        """Per round after the first STEADY_AFTER (warm-up: engines built, graph captured):
        copy backs, their bytes, launches, uploads and allocations; None before."""
        rounds = self.rounds_ended - STEADY_AFTER
        if self._steady_from is None or rounds <= 0:
            return None
        now = self._counters()
        return {"rounds": rounds, **{f"{name}_per_iteration": None if now[name] is None else
                                     round((now[name] - self._steady_from[name]) / rounds, 3)
                                     for name in now}}

    # --------------------------------------------------------------------------- kernels
    def check(self, name: str, args: tuple) -> None:
        sources.check_launch(name, args, self.signatures[name])

    def launch(self, name: str, grid: int, args: tuple, checked: bool = False) -> None:
        raise NotImplementedError

    def launch_over(self, name: str, n: int, args: tuple) -> None:
        """A grid-stride kernel of ``elementwise.cu`` over n elements."""
        self.launch(name, min(max(1, -(-n // THREADS)), 8 * self.sm_count), args)

    def or_dummy(self, array, dtype):
        """``array``, or a one-element stand-in for a pointer the kernel will not read."""
        if array is not None:
            return array
        if dtype not in self._dummies:
            self._dummies[dtype] = self.xp.zeros(1, dtype=dtype)
        return self._dummies[dtype]

    # ------------------------------------------------------------ what policies ask for
    # The same operations as the host's (psparse/backends/host.py), on the device.
    def engines(self, layout):
        """The radix engines one policy selects with (``device_policy.DeviceEngines``)."""
        return DeviceEngines(self, layout)

    def decaying(self, n: int, bounds=None) -> DeviceDecaying:
        """A policy's lazily decayed state on the device (``device_policy.DeviceDecaying``)."""
        return DeviceDecaying(n, self, bounds)

    def index_set(self, n: int) -> DeviceIndexSet:
        """The indices of one aggregate as a byte mask (``device_policy.DeviceIndexSet``)."""
        return DeviceIndexSet(n, self)

    def accumulate(self, mode: int, acc, grad, velocity, filtered, momentum: float):
        """Fold a (prepared) gradient into the accumulator, as the radix engine's first pass
        would (``Memory.accumulate_spec`` names the mode)."""
        if mode == radix.ACC_RESIDUAL:
            acc += grad
        elif mode == radix.ACC_DGC:
            self.launch_over("psparse_dgc_accumulate", acc.size, (
                grad, np.float32(momentum), velocity, acc, np.int64(acc.size)))
        else:
            self.xp.add(filtered, grad, out=acc)
        return acc

    def take(self, acc, indices, velocity):
        """acc's values at ``indices``, then zero them there (and the velocity): one kernel."""
        values = self.xp.empty(indices.size, dtype=self.xp.float32)
        if indices.size:
            self.launch_over("psparse_take", indices.size, (
                indices, np.int64(indices.size), acc, np.int64(acc.size),
                self.or_dummy(velocity, np.float32), np.int32(velocity is not None), values))
        return values

    def clipped(self, grad, clip_norm: float):
        """The gradient scaled to L2 norm <= clip_norm, the factor min(1, clip / norm) a
        device scalar (the norm is never read back)."""
        xp = self.xp
        norm = xp.sqrt(xp.sum(xp.square(grad.astype(xp.float64))))
        factor = xp.where(norm > clip_norm, clip_norm / xp.maximum(norm, 1e-300), 1.0)
        return grad * factor.astype(xp.float32)

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
            self.functions.update(sources.build_cupy_kernels(
                cupy, source, tuple(sources.kernel_signatures(source))))
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.stream.use()
        self._staged: dict = {}  # pinned buffer name -> the event after its last upload
        self._pool_mallocs = _count_pool_mallocs(cupy)

    def allocations(self) -> int:
        """CuPy memory-pool allocations made on this thread since the backend was built
        (a hook counts them; those of an --overlap hook's thread are not seen)."""
        return self._pool_mallocs.count

    def launch(self, name, grid, args, checked=False):
        if grid <= 0:  # nothing to do (CuPy would launch one block)
            return
        if not checked:
            self.check(name, args)
        self.kernel_launches += 1
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
        self.copy_back_bytes += sum(host.nbytes for _, host in pairs)
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
        launches = self.kernel_launches
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
        recorded = self.kernel_launches - launches  # counted when the graph is replayed
        self.kernel_launches = launches

        def replay():
            self.kernel_launches += recorded
            graph.launch(stream)
        return Graph(replay)


def _count_pool_mallocs(cupy):
    """A CuPy memory hook, entered on this thread for the process's life, that counts every
    allocation from the pool (a reuse included): what a steady-state round should not make."""
    class PoolMallocs(cupy.cuda.MemoryHook):
        name = "psparse-pool-mallocs"

        def __init__(self):
            self.count = 0

        def malloc_preprocess(self, **kwargs):
            self.count += 1
    hook = PoolMallocs()
    hook.__enter__()
    return hook
