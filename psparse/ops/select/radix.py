"""Selection on the device with no host round trip: a radix select over the bits of a score.

A non-negative float32 orders as its bit pattern read as an unsigned integer, so "the k entries
of largest score, ties to the lower index" is "the k largest keys" where key = the score's bits
(``KEY_FREQ``: 64 bits, a priority's then a magnitude's). The engine finds them in a fixed
sequence of kernel launches whose sizes never depend on the data, so nothing is read back to the
host until the caller's one copy of the result (docs/architecture: the GPU exchange). Two
launches read every entry; the rest read only the candidates:

1. ``hist0`` (the first pass over every tile): a histogram of each segment's top 12 key bits in
   shared memory, the count of non-finite scores, and error feedback folded in first
   (``accumulate``); the block that completes a segment's histogram (the last to count itself
   in) finds its *threshold digit*, where the count from the top reaches k: the entries above
   it are surely selected, the candidates are those in or above it;
2. when the candidates fit the segment's buffer (``MODE_BUF``, the usual case: a digit spans
   4.4% of magnitude, about a third of k entries) ``write_cand`` (the second and last pass)
   copies them there in index order, each tile at the prefix of the earlier tiles' counts,
   found in the same launch by a decoupled look-back; otherwise (``MODE_FULL``: many equal
   keys, e.g. zeros) the next levels read the whole segment again;
3. ``hist`` per further digit (11 and 8 bits; 64-bit keys: five more) over the candidates, its
   digit found by the block that completes the segment: the exact k-th key T, and how many
   entries equal to T are still needed (R);
4. ``final``: every key > T and the first R keys == T in index order, written in index order
   (so the output is sorted), at each unit's look-back prefix, with their values gathered and
   the accumulator zeroed there (``take``); a segment's last unit writes its report.

So a 32-bit top-k is five launches (64-bit keys: eight), and a selection of all or nothing
(every segment's k is 0 or its size) one, or two with error feedback folded in. Units (tiles,
buffer chunks) are read as 16 rows of a block: coalesced loads, several in flight per thread.

Segments are the policy's slices (the whole model, or one per layer with ``--granularity
layer``): every launch covers all of them at once, so a 65-layer model costs the launches of
one. ``plan_reference`` is the same plan written in array operations (numpy or CuPy), the
oracle the kernels are tested against; ``keys_reference`` computes every key mode's keys on the
host. The CUDA C is ``psparse/ops/select/radix.cu`` (loaded by ``psparse/ops/sources.py``).

Tables (int64): ``segs`` per segment [lo, hi, k, candidate base, candidate capacity, output
base, first tile, tiles, first chunk, chunks]; ``tiles`` [segment, lo, hi] per tile of at most
TILE positions (a tile never spans two segments); ``chunks`` [segment, lo] per TILE-sized piece
of a segment's candidate buffer. The device-written ``state`` holds per segment the key prefix
decided so far, what is still needed, the mode, the candidate count and the non-finite count;
``report`` (what a caller copies back) [selected, non-finite] per segment. The look-backs
keep per unit a flag (its launch's epoch and whether its own counts or its inclusive prefix
are published) and the counts, and take units from ``tickets`` in order (never reset). So
an engine's launches must run one at a time and each to its end (one stream, or a graph whose
launches form a chain, as a captured ``run()``'s do): the tickets count whole launches, and a
launch cut short, or two runs of one engine at once, would put every later run out of step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class CaptureFailed(RuntimeError):
    """A graph could not be captured (a synchronisation inside, or no graph support)."""

THREADS = 256
TILE = THREADS * 16
MAXBINS = 4096
SG_W, ST_W, RP_W = 10, 8, 2
ST_PREFIX, ST_NEED, ST_MODE, ST_CAND, ST_BAD, ST_DONE = range(6)
MODE_BUF, MODE_FULL, MODE_ALL, MODE_NONE = 0, 1, 2, 3
KEY_ABS, KEY_EMA, KEY_PENALTY, KEY_PRIORITY, KEY_CORE, KEY_FREQ, KEY_THRESHOLD, KEY_MASK = \
    range(8)
ACC_NONE, ACC_RESIDUAL, ACC_DGC, ACC_FILTERED = range(4)
CORE_KEY = 0x7F7FFFFF  # a core entry's key: float32's largest finite value (the host's too)
# (shift, bits) of each digit, most significant first: 31-bit keys (bit 31 of a non-negative
# float is 0) and 63-bit ones (KEY_FREQ: a non-negative priority's bits, then a magnitude's)
LEVELS_32 = ((19, 12), (8, 11), (0, 8))
LEVELS_64 = ((51, 12), (40, 11), (29, 11), (18, 11), (7, 11), (0, 7))
HIST_BLOCKS_PER_SM = 4  # blocks of the histogram passes: a few per SM keep them all busy


def capacity_for(k: int, n: int) -> int:
    """Candidate buffer entries for a segment of n selecting k: twice k and a tile's worth, at
    most n (a segment of one tile always fits)."""
    return min(n, 2 * k + TILE)


# ------------------------------------------------------------------------------ reference
def keys_reference(mode: int, x, aux=None, mask=None, p0: float = 0.0, top: float = 0.0):
    """The keys ``rs_key`` computes, for a host slice (numpy), and whether each is non-finite.
    ``top``: KEY_EMA's max(stored priority) of the slice."""
    x = np.asarray(x, dtype=np.float32)
    mag = np.abs(x)
    if mode == KEY_EMA and top > 0 and p0 != 0:
        floor = np.float32(top) / np.float32(p0)
        mag = np.abs((np.asarray(aux, np.float32) + floor) * x)
    elif mode == KEY_PENALTY:
        mag = np.where(np.asarray(mask, bool), mag, mag * np.float32(p0))
    elif mode == KEY_PRIORITY:
        mag = np.asarray(aux, np.float32)
        mag = np.abs(mag) if p0 != 0 else mag
    if mode == KEY_MASK:
        return np.asarray(mask, bool).astype(np.uint64), np.zeros(x.size, bool)
    bad = ~np.isfinite(mag) | (mag < 0)  # a negative score has no key (a bad priority)
    keys = np.where(bad | (mag == 0), 0, mag.view(np.uint32)).astype(np.uint64)
    if mode == KEY_CORE:
        keys[np.asarray(mask, bool) & ~bad] = CORE_KEY
    elif mode == KEY_THRESHOLD:
        keys[~bad & ~(mag >= np.float32(p0))] = 0
    elif mode == KEY_FREQ:
        prio = np.asarray(aux, np.float32) + np.float32(0)  # -0.0 + 0 is +0.0
        bad |= ~np.isfinite(prio) | (prio < 0)
        keys = (prio.view(np.uint32).astype(np.uint64) << np.uint64(32)) | \
            mag.view(np.uint32).astype(np.uint64)
        keys[bad] = 0
    return keys, bad


def plan_reference(xp, keys, k: int, levels=LEVELS_32, capacity: int | None = None,
                   exclude_zero: bool = False) -> dict:
    """The engine's plan for one segment, step by step in ``xp`` array operations: the mode,
    the candidates, the threshold key T, the ties still needed R, and the selected positions
    (sorted). ``exclude_zero``: a zero key is never selected (fewer than k then)."""
    keys = xp.asarray(keys).astype(xp.uint64)
    n = int(keys.size)
    capacity = capacity_for(k, n) if capacity is None else capacity
    if k <= 0:
        return {"mode": MODE_NONE, "selected": xp.empty(0, dtype=xp.int64)}
    if k >= n:
        chosen = xp.flatnonzero(keys > 0) if exclude_zero else xp.arange(n, dtype=xp.int64)
        return {"mode": MODE_ALL, "selected": chosen.astype(xp.int64)}
    prefix, need, plan = 0, k, {}
    for level, (shift, bits) in enumerate(levels):
        high = shift + bits
        keep = (keys >> xp.uint64(high)) == xp.uint64(prefix >> high) if level else \
            xp.ones(n, dtype=bool)
        digits = ((keys[keep] >> xp.uint64(shift)) & xp.uint64((1 << bits) - 1)).astype(
            xp.int64)
        hist = xp.bincount(digits, minlength=1 << bits)
        from_top = xp.cumsum(hist[::-1])
        at = int(xp.searchsorted(from_top, need))  # the first reaching need
        digit = (1 << bits) - 1 - at
        above = int(from_top[at]) - int(hist[digit])
        if level == 0:
            plan["candidates"] = above + int(hist[digit])
            plan["mode"] = MODE_BUF if plan["candidates"] <= capacity else MODE_FULL
            plan["digit"] = digit
        prefix |= digit << shift
        need -= above
    if exclude_zero and prefix == 0:
        need = 0
    tie = keys == xp.uint64(prefix)
    rank = xp.cumsum(tie) - tie
    chosen = xp.flatnonzero((keys > xp.uint64(prefix)) | (tie & (rank < need)))
    plan.update(threshold=prefix, need=need, selected=chosen.astype(xp.int64))
    return plan


# --------------------------------------------------------------------------------- engine
@dataclass
class Key:
    """What the engine ranks (``rs_key``): a mode and the arrays it reads, all on the device.
    ``x``: the accumulator (or any vector; its magnitude); ``aux``: a second vector (a policy's
    stored priority); ``mask``: a uint8 vector (penalty: in the last aggregate; core: in the
    core); ``p0``: a scalar (ema: lam; penalty: pi; threshold: lam; priority: signed);
    ``pdev``: per-segment floats on the device (ema: max stored priority); ``gather``: int64
    positions to global indices (a selection among earlier candidates)."""

    mode: int
    x: object
    aux: object = None
    mask: object = None
    p0: float = 0.0
    pdev: object = None
    gather: object = None

    @property
    def levels(self):
        return LEVELS_64 if self.mode == KEY_FREQ else LEVELS_32


class RadixSelect:
    """One configuration of the engine: segments, k per segment, key, and what to write.

    ``segments``: [(lo, hi)] position ranges (global indices, or positions in ``key.gather``),
    in order, disjoint. The output of segment s is ``out_idx[obase[s]:obase[s] + report[s]]``
    (sorted global indices; ``obase`` the sums of the earlier segments' k), with
    ``out_val`` = ``values[index]`` when ``values`` is given, and ``values`` (and ``velocity``)
    zeroed there when ``take``. Every launch and argument is fixed at construction, so
    ``run()`` only enqueues them (and a graph can capture them); ``accumulate`` (error feedback
    folded into the first pass) is given per run.
    """

    def __init__(self, dev, segments, ks, key: Key, *, exclude_zero: bool = False,
                 index_dtype=np.int64, values=None, take: bool = False, velocity=None,
                 out_idx=None, out_val=None):
        if dev.capturing:  # its tables and buffers would be graph nodes: build it before
            raise CaptureFailed("a selection engine built inside a graph capture")
        xp = self.xp = dev.xp
        self.dev, self.key = dev, key
        self.segments = [(int(lo), int(hi)) for lo, hi in segments]
        self.ks = [max(0, min(int(k), hi - lo)) for k, (lo, hi) in zip(ks, self.segments)]
        self.total_k = sum(self.ks)
        self.selects_all = all(k in (0, hi - lo) for k, (lo, hi) in zip(self.ks, self.segments))
        self.levels = key.levels
        self.exclude_zero = exclude_zero
        segs, tiles, chunks = self._tables()
        self.ntiles, self.nchunks = len(tiles), len(chunks)
        nseg = len(self.segments)
        self.obase = np.cumsum([0, *self.ks[:-1]]).astype(np.int64)
        self.segs, self.tiles = dev.constant(segs), dev.constant(tiles)
        self.chunks = dev.constant(chunks if len(chunks) else np.zeros((1, 2), np.int64))
        self.state = xp.zeros(nseg * ST_W, dtype=xp.int64)
        self.hist = xp.zeros(nseg * MAXBINS, dtype=xp.uint32)
        self.report = xp.zeros(nseg * RP_W, dtype=xp.int64)
        cap = max(1, int(segs[:, 4].sum()))
        self.cand_key = xp.zeros(cap, dtype=xp.uint64)
        self.cand_pos = xp.zeros(cap, dtype=xp.int64)
        units = self.ntiles + self.nchunks
        self.tickets = xp.zeros(2, dtype=xp.uint64)  # write_cand's, final's
        self.cand_flags = xp.zeros(max(1, self.ntiles), dtype=xp.uint64)
        self.cand_counts = xp.zeros((2, 2 * max(1, self.ntiles)), dtype=xp.int64)
        self.final_flags = xp.zeros(max(1, units), dtype=xp.uint64)
        self.final_counts = xp.zeros((2, 2 * max(1, units)), dtype=xp.int64)
        self.index_dtype = np.dtype(index_dtype)
        size = max(1, self.total_k)
        self.out_idx = out_idx if out_idx is not None else xp.zeros(size, dtype=self.index_dtype)
        self.out_val = out_val if out_val is not None else xp.zeros(size, dtype=xp.float32)
        self.values, self.take, self.velocity = values, take, velocity
        self.hist_blocks = max(1, min(self.ntiles, HIST_BLOCKS_PER_SM * dev.sm_count))
        self._launches = self._plan_launches()
        self._hist0 = {}  # accumulate's arrays -> hist0's arguments, checked once

    def set_key(self, key: Key) -> None:
        """Rank another key of the same mode (other arrays): the launches are re-planned, the
        buffers kept."""
        if key.mode != self.key.mode:
            raise ValueError(f"a RadixSelect for key mode {self.key.mode} given mode {key.mode}")
        self.key = key
        self._launches = self._plan_launches()
        self._hist0 = {}

    def _tables(self):
        segs, tiles, chunks = [], [], []
        cbase = 0
        for s, ((lo, hi), k) in enumerate(zip(self.segments, self.ks)):
            n = hi - lo
            cap = capacity_for(k, n) if 0 < k < n else 0
            first_tile, first_chunk = len(tiles), len(chunks)
            tiles += [(s, t, min(hi, t + TILE)) for t in range(lo, hi, TILE)]
            chunks += [(s, c) for c in range(0, cap, TILE)]
            segs.append((lo, hi, k, cbase, cap, 0, first_tile, len(tiles) - first_tile,
                         first_chunk, len(chunks) - first_chunk))
            cbase += cap
        segs = np.array(segs, dtype=np.int64).reshape(-1, SG_W)
        segs[:, 5] = np.cumsum([0, *self.ks[:-1]])
        return (segs, np.array(tiles, dtype=np.int64).reshape(-1, 3),
                np.array(chunks, dtype=np.int64).reshape(-1, 2))

    def _key_args(self):
        dev, key = self.dev, self.key
        return (np.int32(key.mode), key.x, dev.or_dummy(key.aux, np.float32),
                dev.or_dummy(key.mask, np.uint8), dev.or_dummy(key.gather, np.int64),
                np.int32(key.gather is not None), np.float32(key.p0),
                dev.or_dummy(key.pdev, np.float32))

    def _plan_launches(self) -> list:
        """Every launch after the first, with its arguments: fixed for this configuration."""
        key_args = self._key_args()
        ntiles, ex = self.ntiles, np.int32(self.exclude_zero)
        later = () if self.selects_all else self.levels[1:]  # all or none: no threshold
        launches = []
        if not self.selects_all:
            launches.append(("psparse_rs_write_cand", ntiles, (
                *key_args, self.tiles, self.segs, self.state, self.tickets, self.cand_flags,
                self.cand_counts[0], self.cand_counts[1], self.cand_key, self.cand_pos)))
        for level, (shift, bits) in enumerate(later, start=1):
            launches.append(("psparse_rs_hist", self.hist_blocks + self.nchunks, (
                *key_args, self.tiles, np.int64(ntiles), np.int64(self.hist_blocks),
                self.chunks, self.segs, self.state, self.cand_key, self.hist,
                np.int32(shift), np.int32(bits), np.int32(level),
                np.int32(level == len(self.levels) - 1), ex)))
        final = "psparse_rs_final_i32" if self.index_dtype == np.int32 else \
            "psparse_rs_final_i64"
        values = self.values
        launches.append((final, ntiles + self.nchunks, (
            *key_args, self.tiles, np.int64(ntiles), self.chunks, self.segs, self.state,
            self.cand_key, self.cand_pos, ex, np.int32(self.selects_all), self.tickets,
            self.final_flags, self.final_counts[0], self.final_counts[1], self.report,
            self.out_idx, self.out_val, np.int32(values is not None),
            self.dev.or_dummy(values, np.float32), np.int32(bool(self.take)),
            self.dev.or_dummy(self.velocity, np.float32), np.int32(self.velocity is not None))))
        for name, _, args in launches:
            self.dev.check(name, args)
        return launches

    def _hist0_args(self, accumulate) -> tuple:
        """hist0's arguments for one ``accumulate``, checked against the signature the first
        time those arrays are given (a round passes the same ones every time)."""
        dev = self.dev
        mode, acc, grad, velocity, filtered, momentum = accumulate or (ACC_NONE,) + (None,) * 5
        cache_key = (mode, *(id(a) for a in (acc, grad, velocity, filtered)), momentum)
        cached = self._hist0.get(cache_key)
        if cached is None:
            (shift, bits), ex = self.levels[0], np.int32(self.exclude_zero)
            args = (*self._key_args(), np.int32(mode), dev.or_dummy(acc, np.float32),
                    dev.or_dummy(grad, np.float32), dev.or_dummy(velocity, np.float32),
                    dev.or_dummy(filtered, np.float32), np.float32(momentum or 0.0),
                    self.tiles, np.int64(self.ntiles), self.segs, self.state, self.hist,
                    np.int32(shift), np.int32(bits),
                    np.int32(self.selects_all or len(self.levels) == 1), ex)
            dev.check("psparse_rs_hist0", args)
            if len(self._hist0) >= 8:  # a caller that passes fresh arrays every time
                self._hist0.clear()
            # the arrays are held with their arguments, so their ids are not reused meanwhile
            cached = self._hist0[cache_key] = (args, (acc, grad, velocity, filtered))
        return cached[0]

    def run(self, accumulate=None) -> None:
        """Enqueue the selection. ``accumulate``: (mode, acc, grad, velocity, filtered,
        momentum) folded into the first pass (acc must be ``key.x``), or None."""
        dev = self.dev
        if not (self.selects_all and (accumulate is None or accumulate[0] == ACC_NONE)):
            dev.launch("psparse_rs_hist0", self.hist_blocks, self._hist0_args(accumulate),
                       checked=True)
        for name, grid, args in self._launches:
            dev.launch(name, grid, args, checked=True)

    def outputs(self, report: np.ndarray) -> list[tuple[int, int]]:
        """[(start, count)] of each segment's selection in out_idx, from a copied-back report."""
        report = np.asarray(report).reshape(-1, RP_W)
        return [(int(b), int(c)) for b, c in zip(self.obase, report[:, 0])]
