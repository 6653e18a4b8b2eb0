"""The host's top-k and the policies' scores and state, compiled for the CPU.

Compiled CPU kernels of the host's selection and the policies' state (numba; see
psparse/ops/jit.py and psparse/ops/numba_jit.py).

Each kernel gives what its numpy reference gives (the same indices, the same state bits):
``selection.select`` / ``sparsify.topk_exact`` and the policies' block-by-block scores for the
selections, ``updates.scatter_add`` and ``Decaying.renormalise`` for the state;
tests/test_select_kernels.py holds them to it. Loaded on first use (``LazyModule`` in
psparse/ops/select/sparsify.py and psparse/ops/select/selection.py): a process that never selects on
the host never imports numba.

* ``top_k``: the sorted indices of the k largest scores, ties to the lower index, where the
  score is one of ``ABS`` (|acc|), ``EMA`` (|acc| * (stored + floor), ema's ranking),
  ``PENALTY`` (|acc|, times pi off the sorted ``marks``: penalty's) or ``CORE`` (|acc|, with the
  sorted ``marks`` at float32's maximum: core's own slice). One strided ~1% sample of the score
  gives a threshold about MARGIN * k scores reach; one pass over the accumulator collects the
  candidates, 128 entries at a time, then 16: the group's |acc| bits are compared with the
  |acc| that a score at the threshold needs (one vector compare a cache line,
  ``numba_jit.magnitude_mask``: non-negative float32 bits order as the values do, NaN and inf above
  every number), and only the rare lines that reach it are scored one by one (and checked for NaN
  and inf); so ema reads its priority only where |acc| is large enough. PENALTY's pass is top-k's at
  about t / pi (what an entry off the marks needs), and the marks are merged in afterwards, each
  scored once. The candidates are trimmed to exactly k. When the sample misjudged (too few
  candidates, or more than the buffer holds) the exact k-th score is found by a partition of all of
  them, as ``kernels.select`` does.
* ``frequency_top_k``: frequency's rule, the k best by (count, magnitude) of the pool (the
  ``pool`` largest |acc|), its candidates collected by the same pass with their stored counts.
* ``at_least``: threshold's selection, |acc| >= lam (NaN never selected, nothing refused), 64
  entries per vector compare (``numba_jit.magnitude_mask``).
* ``scatter_add``: target[indices] += weight * (|values|, values or 1), the old and updated
  values written out, and per slice the largest updated value (ema's maximum).
* ``renormalise``: a decayed state's stored *= scale, values below float32's smallest normal
  flushed to zero, in one pass.
"""

from __future__ import annotations

import numpy as np

from ..numba_jit import inlined, kernel, magnitude_mask, trailing_zeros

ABS, EMA, PENALTY, CORE = 0, 1, 2, 3
SAMPLE_STRIDE = 97  # as kernels.SAMPLE_STRIDE: the same sample, so the same estimate
MARGIN = 1.25  # as kernels.MARGIN
GROUP = 128  # entries whose |acc| bits are compared at once, then LINE at a time in a group
LINE = 16  # that reaches the bound (one 64-byte cache line), then one by one
SIGN_OFF = np.uint32(0x7FFFFFFF)
INF_BITS = np.uint32(0x7F800000)
TINY = np.float32(np.finfo(np.float32).tiny)
CORE_SCORE = np.float32(np.finfo(np.float32).max)
NO_MARKS = np.empty(0, np.int64)
NO_AUX = np.empty(0, np.float32)


@inlined
def _bits(value):
    """The bits of a float32 scalar, as uint32."""
    cell = np.empty(1, np.float32)
    cell[0] = value
    return cell.view(np.uint32)[0]


@inlined
def _float(bits):
    """The float32 whose bits are ``bits``."""
    cell = np.empty(1, np.uint32)
    cell[0] = bits
    return cell.view(np.float32)[0]


@kernel
def kth_largest(values, count, k):
    """The k-th largest of values[:count], unsigned integers (1 <= k <= count): a radix select
    on 11-bit digits, the highest first (numba's ``np.partition`` is ~30x slower than numpy's
    here). Non-negative float32 bits order as the values do, so it ranks scores too."""
    hist = np.zeros(2048, np.int64)
    prefix, known = np.uint64(0), np.uint64(0)  # the digits found so far, and their mask
    shift = values.itemsize * 8
    while shift > 0:
        step = min(11, shift)
        shift -= step
        digit = np.uint64((1 << step) - 1)
        hist[:] = 0
        for j in range(count):
            v = np.uint64(values[j])
            if (v & known) == prefix:
                hist[(v >> np.uint64(shift)) & digit] += 1
        d = (1 << step) - 1
        while k > hist[d]:
            k -= hist[d]
            d -= 1
        prefix |= np.uint64(d) << np.uint64(shift)
        known |= digit << np.uint64(shift)
    return prefix


@inlined
def _marked(marks, cursor, j):
    """(cursor moved to the first mark >= j, whether j is marked): for increasing j."""
    while cursor < marks.size and marks[cursor] < j:
        cursor += 1
    return cursor, cursor < marks.size and marks[cursor] == j


@inlined
def _score(kind, a, aux, p, j, marked):
    """The score of entry j whose |acc| is ``a`` (CORE's marks are merged in afterwards)."""
    if kind == EMA:
        return a * (aux[j] + p)
    if kind == PENALTY and not marked:
        return a * p
    return a


@kernel
def _sample_threshold(kind, acc, aux, marks, p, k):
    """The score about MARGIN * k entries reach, from every SAMPLE_STRIDE-th score (as
    ``kernels.sample_threshold``); -1 - j when the score at a sampled j is NaN or inf."""
    n = acc.size
    sample, status = _scores(kind, acc, aux, marks, p, SAMPLE_STRIDE)
    if status < 0:
        return np.float32(0), status
    m = sample.size
    expected = k * m / n
    want = max(expected * MARGIN, expected + 3 * np.sqrt(expected))
    want = min(m, max(1, int(np.ceil(want)) + 1))
    return _float(np.uint32(kth_largest(sample.view(np.uint32), m, want))), 0


@inlined
def _lowest_acc(kind, t, q):
    """Bits of an |acc| below which no score reaches t (so a group below it is skipped)."""
    if kind == EMA:  # |acc| * F, F <= q = max(stored) + floor: the bound t / q, rounded down
        if t < 1e-30 or q <= 0:
            return np.uint32(0)
        low = _bits(np.float32(np.float64(t) / np.float64(q) * (1.0 - 2.0 ** -20)))
    else:  # |acc| itself, or pi * |acc| <= |acc| (pi <= 1)
        low = _bits(t)
    return min(low, INF_BITS)  # NaN and inf always looked at


@inlined
def _reaches(bits, start, stop, bound):
    """Whether any |value| of bits[start:stop] (whole LINEs) reaches ``bound`` (as bits; NaN's
    lie above inf's, so a NaN reaches every bound): one vector compare per line, OR-ed
    (``magnitude_mask``: 2x faster than a uint32 maximum in numba's own loop, which spends
    the difference on widening the AND to 64 bits and back)."""
    at = bits.ctypes.data + 4 * start
    hit = np.uint64(0)
    for line in range((stop - start) // LINE):
        hit |= magnitude_mask(at + 64 * line, bound, SIGN_OFF)
    return hit != np.uint64(0)


@inlined
def _line_reaches(bits, start, bound):
    """``_reaches`` of one LINE from ``start``."""
    return magnitude_mask(bits.ctypes.data + 4 * start, bound, SIGN_OFF) != np.uint64(0)


@inlined
def _collect(kind, acc, aux, marks, p, t, start, stop, cursor, count, capacity, idx, val):
    """The scores of acc[start:stop], one by one, those >= t into idx / val (a store without a
    branch: one not counted is overwritten). Returns (count, cursor, -1 - j at a NaN or inf
    score, else 0); CORE's marks may hold one, as their score replaces it."""
    if kind == PENALTY:  # the first mark at or after start (a search: most lines are skipped)
        cursor = np.searchsorted(marks, start)
    for j in range(start, stop):
        marked = False
        if kind == PENALTY:
            marked = cursor < marks.size and marks[cursor] == j
            cursor += marked
        s = _score(kind, abs(acc[j]), aux, p, j, marked)
        if not np.isfinite(s):
            if kind != CORE or not _marked(marks, 0, j)[1]:
                return count, cursor, -1 - j
            continue
        at = min(count, capacity)
        idx[at] = j
        val[at] = s
        count += s >= t
    return count, cursor, 0


@kernel
def _pass(kind, acc, aux, marks, p, t, bound, capacity, idx, val):
    """Candidates: every j with score >= t (CORE: |acc| >= t, marks merged later) into idx /
    val (room for capacity + 1), looking only at the lines whose |acc| reaches ``bound``;
    returns (how many there were, -1 - j at a NaN or inf score, else 0). One copy of the loop
    per kind, the kind a constant in each (its tests folded away: 1.5x faster)."""
    if kind == ABS:
        return _pass_of(ABS, acc, aux, marks, p, t, bound, capacity, idx, val)
    if kind == EMA:
        return _pass_of(EMA, acc, aux, marks, p, t, bound, capacity, idx, val)
    if kind == PENALTY:
        return _pass_of(PENALTY, acc, aux, marks, p, t, bound, capacity, idx, val)
    return _pass_of(CORE, acc, aux, marks, p, t, bound, capacity, idx, val)


@inlined
def _pass_of(kind, acc, aux, marks, p, t, bound, capacity, idx, val):
    """``_pass`` for one kind."""
    n = acc.size
    bits = acc.view(np.uint32)
    start = acc.ctypes.data
    low = _bits(t) if t > 0 else np.uint32(0)  # |acc| >= t as bits (t is never NaN)
    count, cursor, status = 0, 0, 0
    full = n - n % GROUP
    for g in range(0, full, GROUP):
        if not _reaches(bits, g, g + GROUP, bound):
            continue
        for h in range(g, g + GROUP, LINE):
            if not _line_reaches(bits, h, bound):
                continue
            if kind == ABS and magnitude_mask(start + 4 * h, INF_BITS, SIGN_OFF) == 0:
                # |acc| is the score and the line holds no NaN or inf: its candidates are the
                # set bits of one more compare (4x fewer instructions than one by one)
                hits = magnitude_mask(start + 4 * h, low, INF_BITS)
                while hits:
                    j = h + np.int64(trailing_zeros(hits))
                    at = min(count, capacity)
                    idx[at] = j
                    val[at] = abs(acc[j])
                    count += 1
                    hits &= hits - np.uint64(1)
                continue
            count, cursor, status = _collect(kind, acc, aux, marks, p, t, h, h + LINE,
                                             cursor, count, capacity, idx, val)
            if status < 0:
                return count, status
    count, cursor, status = _collect(kind, acc, aux, marks, p, t, full, n, cursor, count,
                                     capacity, idx, val)
    return count, status


@inlined
def _penalty_bound(t, p):
    """An |acc| at or below which no unmarked entry's score pi * |acc| reaches t (t / pi,
    rounded down a little: the pass may collect a few too many, ``_merge_penalty`` scores them
    exactly). 0 for a t below float32's normal range, as ``_lowest_acc`` does for EMA: a
    subnormal product's rounding is not within a relative 2**-20 (a review's reproduction:
    tests/test_select_kernels.py, subnormal accumulators)."""
    if t < 1e-30:
        return np.float32(0)
    return np.float32(np.float64(t) / np.float64(p) * (1.0 - 2.0 ** -20))


@kernel
def _merge_penalty(idx, val, count, acc, marks, p, t):
    """PENALTY's candidates: the pass's (every |acc| >= about t / pi, val = |acc|) and the
    marks (the previous aggregate's entries, sorted) merged in index order, each scored as
    ``_score`` scores it (pi * |acc| off the marks, |acc| on them) and kept if it reaches t:
    so the marks are looked up once each, not searched for in every line the pass reads (the
    first compiled PENALTY score did, 2-3x slower than numpy)."""
    out_idx = np.empty(count + marks.size, np.int64)
    out_val = np.empty(count + marks.size, np.float32)
    a, b, c = 0, 0, 0
    while a < count or b < marks.size:
        if b < marks.size and (a >= count or marks[b] <= idx[a]):
            j = marks[b]
            s = abs(acc[j])
            if a < count and idx[a] == j:
                a += 1
            b += 1
        else:
            j = idx[a]
            s = val[a] * p
            a += 1
        if s >= t:
            out_idx[c], out_val[c] = j, s
            c += 1
    return out_idx, out_val, c


@kernel
def _merge_marks(idx, val, count, marks):
    """CORE: the candidates and the marks (at float32's maximum) merged, in index order."""
    out_idx = np.empty(count + marks.size, np.int64)
    out_val = np.empty(count + marks.size, np.float32)
    a, b, c = 0, 0, 0
    while a < count or b < marks.size:
        if b < marks.size and (a >= count or marks[b] <= idx[a]):
            if a < count and idx[a] == marks[b]:
                a += 1
            out_idx[c], out_val[c] = marks[b], CORE_SCORE
            b += 1
        else:
            out_idx[c], out_val[c] = idx[a], val[a]
            a += 1
        c += 1
    return out_idx, out_val, c


@kernel
def _scores(kind, acc, aux, marks, p, stride):
    """The scores of every stride-th entry (the sample; all of them for the exact fallback);
    -1 - j at the first NaN or inf. Every entry is scored as unmarked first, then the marks
    that fall on the sample overwrite theirs: a walk of the marks beside the sample (a
    cursor, as ``_collect`` keeps) cost penalty's sample 3.5x top-k's at 11M/1%, where the
    previous aggregate holds 5 entries for every sampled one."""
    m = (acc.size + stride - 1) // stride
    scores = np.empty(m, np.float32)
    for i in range(m):
        j = i * stride
        scores[i] = _score(kind, abs(acc[j]), aux, p, j, False)
    if kind == PENALTY or kind == CORE:
        for c in range(marks.size):
            j = marks[c]
            if j % stride == 0:
                scores[j // stride] = CORE_SCORE if kind == CORE else abs(acc[j])
    for i in range(m):  # the first NaN or inf, in index order
        if not np.isfinite(scores[i]):
            return scores, -1 - i * stride
    return scores, 0


@kernel
def candidates(kind, acc, aux, marks, p, q, k):
    """(indices, scores, count, status) of a set of at least k entries holding the k largest
    scores (every entry whose score reaches some t), in index order; status 0, 1 when the
    sampled threshold misjudged and the exact one was used, -1 - j at a NaN or inf score."""
    t, status = _sample_threshold(kind, acc, aux, marks, p, k)
    if status < 0:
        return NO_MARKS, NO_AUX, 0, status
    capacity = 2 * k + 1024
    for attempt in range(3):
        idx = np.empty(capacity + 1, np.int64)
        val = np.empty(capacity + 1, np.float32)
        if kind == PENALTY:  # |acc| >= about t / pi, then the marks merged in
            low = _penalty_bound(t, p)
            count, status = _pass(ABS, acc, aux, NO_MARKS, p, low, _lowest_acc(ABS, low, q),
                                  capacity, idx, val)
        else:
            count, status = _pass(kind, acc, aux, marks, p, t, _lowest_acc(kind, t, q),
                                  capacity, idx, val)
        if status < 0:
            return NO_MARKS, NO_AUX, 0, status
        if kind == CORE and count <= capacity:
            idx, val, count = _merge_marks(idx, val, count, marks)
        if kind == PENALTY and count <= capacity:
            idx, val, count = _merge_penalty(idx, val, count, acc, marks, p, t)
        if k <= count <= capacity:
            return idx, val, count, min(attempt, 1)
        if attempt == 0:  # the sample misjudged: the exact k-th score
            scores, status = _scores(kind, acc, aux, marks, p, 1)
            if status < 0:
                return NO_MARKS, NO_AUX, 0, status
            t = _float(np.uint32(kth_largest(scores.view(np.uint32), scores.size, k)))
        else:  # many ties at the k-th score: room for all of them
            capacity = count
    return idx, val, count, 1


@kernel
def largest(keys, count, k, positions):
    """The positions of the k largest of keys[:count] (unsigned integers, or float32 bits),
    ties to the lower position, into ``positions`` in increasing order (1 <= k <= count)."""
    kth = kth_largest(keys, count, k)
    above = 0
    for j in range(count):
        above += keys[j] > kth
    ties = k - above
    c = 0
    for j in range(count):
        key = keys[j]
        if key > kth or (key == kth and ties > 0):
            ties -= key == kth
            positions[c] = j
            c += 1


@kernel
def trim(idx, val, count, k, out_idx, out_val):
    """The k of ``count`` candidates (index order) with the largest scores, ties to the lower
    index, into out_idx / out_val in index order (as ``kernels.trim``)."""
    if count <= k:
        out_idx[:count] = idx[:count]
        out_val[:count] = val[:count]
        return count
    positions = np.empty(k, np.int64)
    largest(val.view(np.uint32), count, k, positions)
    for c in range(k):
        out_idx[c], out_val[c] = idx[positions[c]], val[positions[c]]
    return k


@kernel
def top_k(kind, acc, aux, marks, p, q, k, out):
    """The sorted indices of the k largest scores into out (0 < k < acc.size); returns the
    status of ``candidates`` (negative: a NaN or inf score, nothing written)."""
    idx, val, count, status = candidates(kind, acc, aux, marks, p, q, k)
    if status >= 0:
        trim(idx, val, count, k, out, np.empty(k, np.float32))
    return status


@kernel
def frequency_top_k(acc, stored, pool, k, out):
    """frequency: of the pool (the ``pool`` largest |acc|, k < pool < acc.size), the k with the
    largest (stored count, |acc|) -- one 64-bit key, the count's bits above the magnitude's --
    ties to the lower index, sorted into out. Returns the status of ``candidates``."""
    idx, val, count, status = candidates(ABS, acc, NO_AUX, NO_MARKS, np.float32(1), np.float32(1),
                                        pool)
    if status < 0:
        return status
    pool_idx = np.empty(pool, np.int64)
    pool_mag = np.empty(pool, np.float32)
    trim(idx, val, count, pool, pool_idx, pool_mag)
    counts, mags = stored.view(np.uint32), pool_mag.view(np.uint32)
    key = np.empty(pool, np.uint64)
    for j in range(pool):
        key[j] = (np.uint64(counts[pool_idx[j]]) << np.uint64(32)) | np.uint64(mags[j])
    positions = np.empty(k, np.int64)
    largest(key, pool, k, positions)
    for c in range(k):
        out[c] = pool_idx[positions[c]]
    return status


@kernel
def at_least(acc, lam):
    """Sorted indices of the entries with |acc| >= lam (float32 lam > 0; NaN never, inf
    always), as ``kernels.at_least``.

    64 entries at a time: four ``magnitude_mask`` compares make a 64-bit mask (at a plain
    read's speed), and its set bits are appended by trailing-zero counts. The first four bits
    go out without a branch (past the last, the count does not move and the next write
    overwrites the slot): at threshold's usual 0.1-3% hits a block holds four or fewer, and a
    branch per block, or a loop as long as its bits, mispredicts on about every block that
    has any (measured: 1.3-2x slower). More than four: a loop for the rest."""
    n = acc.size
    low = _bits(lam)
    start = acc.ctypes.data
    out = np.empty(1024, np.int64)
    count = 0
    full = n - n % 64
    for h in range(0, full, 64):
        at = start + 4 * h
        mask = magnitude_mask(at, low, INF_BITS) \
            | (magnitude_mask(at + 64, low, INF_BITS) << np.uint64(16)) \
            | (magnitude_mask(at + 128, low, INF_BITS) << np.uint64(32)) \
            | (magnitude_mask(at + 192, low, INF_BITS) << np.uint64(48))
        if count + 64 > out.size:
            out = _grown(out, count)
        for _ in range(4):  # unrolled: a constant trip count
            mask, count = _append_lowest(mask, h, out, count)
        while mask:
            mask, count = _append_lowest(mask, h, out, count)
    bits = acc.view(np.uint32)
    for j in range(full, n):
        b = np.uint32(bits[j] & SIGN_OFF)
        if low <= b <= INF_BITS:
            if count + 1 > out.size:
                out = _grown(out, count)
            out[count] = j
            count += 1
    return out[:count]


@inlined
def _append_lowest(mask, base, out, count):
    """out[count] = base + the lowest set bit of ``mask``, counted if there is one; returns
    (mask without it, count)."""
    lowest = trailing_zeros(mask)  # 64 for an empty mask: written, not counted
    out[count] = base + np.int64(lowest)
    return mask & (mask - np.uint64(1)), count + np.int64(lowest < np.uint64(64))


@kernel
def _grown(out, count):
    """``out`` with twice the room, its first ``count`` entries kept."""
    grown = np.empty(2 * out.size, np.int64)
    grown[:count] = out[:count]
    return grown


@kernel
def scatter_add(target, indices, values, weight, mode, old, updated, edges, tops):
    """target[indices] += weight * (|values| for mode 0, values for 1, 1 for 2), each rounded
    as numpy rounds it (the float32 product, then the sum); the values before and after into
    old / updated; tops[s] = max(tops[s], updated) over the entries in [edges[s], edges[s+1])
    (sorted indices; empty ``tops``: not tracked). As ``kernels.scatter_add``."""
    s = 0
    for j in range(indices.size):
        at = indices[j]
        if mode == 2:
            add = weight
        elif mode == 0:
            add = weight * abs(values[j])
        else:
            add = weight * values[j]
        before = target[at]
        after = before + add
        target[at] = after
        old[j] = before
        updated[j] = after
        if tops.size:
            while at >= edges[s + 1]:
                s += 1
            tops[s] = max(tops[s], after)


@kernel
def renormalise(stored, scale):
    """stored *= scale (float32), then what is below float32's smallest normal set to 0."""
    for j in range(stored.size):
        v = stored[j] * scale
        stored[j] = np.float32(0) if abs(v) < TINY else v


def warm_up() -> None:
    """Compile or load every kernel for the argument types the package passes."""
    acc = np.array([1.0, -2.0, 0.5, 3.0, -0.25], np.float32)
    aux = np.ones(5, np.float32)
    marks = np.array([1], np.int64)
    one = np.float32(1)
    for kind in (ABS, EMA, PENALTY, CORE):
        top_k(kind, acc, aux if kind == EMA else NO_AUX, marks if kind in (PENALTY, CORE)
              else NO_MARKS, one, one, 2, np.empty(2, np.int64))
    frequency_top_k(acc, aux, 3, 2, np.empty(2, np.int64))
    at_least(acc, one)
    for dtype in (np.int32, np.int64):  # a received aggregate's indices, or a policy's own
        indices = np.array([0, 3], dtype)
        for mode in (0, 1, 2):
            for tops in (np.zeros(1, np.float32), NO_AUX):
                scatter_add(aux.copy(), indices, acc[:2], one, mode, np.empty(2, np.float32),
                            np.empty(2, np.float32), np.array([0, 5], np.int64), tops)
    renormalise(aux.copy(), one)
