"""frequency: among the c*k largest |accumulator| entries, send the k most often aggregated.

priority[i] = decayed count of rounds in which index i was in the aggregate:
    priority <- gamma * priority;  priority[aggregate indices] += 1
(identical on every worker, since it is built from the aggregate alone). Candidates are the
c*k entries of largest |accumulator|; of those, the k with the highest priority are sent,
ties broken by magnitude. Error feedback zeroes what was just sent, so recently aggregated
indices often drop out of the candidate pool: a larger c keeps them reachable.

Cost (issue 18, item 3): the counts decay lazily (``updates.Decaying``: one scale factor, so
``observe`` touches only the aggregate's entries); the ranking reads the stored counts, which
order as the counts do. On a large host slice with a large pool (density 1%: 4.4% of the slice)
the pool is not listed: one pass collects only the entries that can be sent (in the pool by a
sampled lower bound on its smallest magnitude, with a key the k-th best surely reaches) and the
entries near the pool's edge, which fix that edge exactly; listing the c*k = 4k pool entries
(2.7x a top-k's time) then costs 2.0x. On a small host slice the pool is listed by one
``argpartition`` (a mask's ``flatnonzero`` mispredicts a branch per pool entry: 4k of them) and
ranked by one more over 64-bit keys written in place, ties settled by index as the plain way.
Those numpy ways are the reference of the compiled one the host runs where the pool is not
streamed (``select_kernels.frequency_top_k``: the pool by the top-k pass, its keys by a radix
select); where it is (a pool over STREAM_ABOVE of a large slice) the numpy stream was measured
faster.
"""

import math
import sys

import numpy as np

from ..ops.jit import host_compiled
from ..ops.select import radix, selection, sparsify
from ..ops.select.sparsify import select_kernels
from .base import Param, SelectionPolicy

# A large host slice's pool is streamed when it is over this fraction of the slice, else listed
# (a top-(c*k)): listing costs ~70 ns per pool entry, streaming ~0.7 ns per slice entry
# (measured at 11M, 0.1% and 1%: a pool of 0.4% of the slice listed in 1.35x top-k's time,
# streamed in 2.0x; one of 4.4% listed in 2.7x, streamed in 2.0x). On a small slice the
# partition that finds the pool's edge is most of the time either way: listed.
STREAM_ABOVE = 0.01
LITTLE_ENDIAN = sys.byteorder == "little"  # a key's halves: (magnitude, count) in memory order


class Frequency(SelectionPolicy):
    name = "frequency"
    params = {
        "c": Param(float, 4.0, "candidate pool size, as a multiple of k", lambda v: v >= 1,
                   ">= 1"),
        "gamma": Param(float, 0.9, "per-round decay of the counts", lambda v: 0 <= v < 1,
                       "in [0, 1)"),
    }

    def __init__(self, layout, k, **kw):
        super().__init__(layout, k, **kw)
        self.priority = self.backend.decaying(layout.numel)
        self._scratch = None  # the streamed pass's block buffers (host, large slices)
        self._mag = None  # |acc| of a small host slice

    def select_device(self, accumulator, iteration, group=None):
        """The pool (the c*k largest |acc| per slice, in index order), then its k best by
        (count, magnitude): a second engine over the pool's positions."""
        pools = [min(size, int(np.ceil(self.c * k))) if k else 0
                 for (_, size), k in zip(self.layout.slices, self.slice_k)]
        pool = self.engines.select("pool", radix.Key(radix.KEY_ABS, accumulator), pools,
                                   self.fusion, final=False, values=False)
        segments = [(int(b), int(b) + p) for b, p in zip(pool.starts, pool.ks)]
        key = radix.Key(radix.KEY_FREQ, accumulator, aux=self.priority.stored,
                        gather=pool.engine.out_idx)
        chosen = self.engines.select("select", key, self.slice_k, self.fusion,
                                     segments=segments)
        chosen.also = (pool.report,)  # the pool's pass saw the whole accumulator
        return chosen

    def select_slice(self, acc, k, offset):
        pool = min(acc.size, int(np.ceil(self.c * k)))
        if pool <= k:
            return self.topk(acc, pool, offset)
        xp = self.xp
        stored = self.priority.stored[offset:offset + acc.size]
        streamed = xp is np and pool > STREAM_ABOVE * acc.size and \
            not self._selectors[self._slice_index(offset)].exact
        # compiled except where the numpy way streams: there the compiled call, measured back
        # to back at 11M/1% (pool 4%), took 46 ms against the stream's 40
        if pool < acc.size and not streamed and host_compiled(acc, stored):  # one call
            return self._compiled(acc, stored, k, pool)
        if streamed:
            chosen = self._streamed(acc, stored, k, pool)
            if chosen is not None:
                return chosen
        if xp is np and LITTLE_ENDIAN and pool < acc.size and \
                self._selectors[self._slice_index(offset)].exact:
            return self._listed(acc, stored, k, pool)
        candidates = self.topk(acc, pool, offset)
        return candidates[self._best(stored[candidates], xp.abs(acc[candidates]), k)]

    def _compiled(self, acc, stored, k, pool):
        """``select_kernels.frequency_top_k``: the pool collected by the top-k pass, its k best
        keys by a radix select; the numpy ways below are its reference."""
        out = np.empty(k, np.int64)
        status = select_kernels.frequency_top_k(acc, stored, pool, k, out)
        if status < 0:
            raise selection.NonFiniteError("the accumulator holds NaN or inf (first at index "
                                         f"{-1 - status})")
        self._selectors[0].fallbacks += status
        return out

    def _listed(self, acc, stored, k, pool):
        """The plain way on a small host slice, in fewer steps: the pool from |acc| by one
        ``argpartition`` (its indices come out listed: ``flatnonzero`` of a mask mispredicts a
        branch per pool entry, 4k of them), each pool entry's key written straight into place
        (two gathers into the halves of 64-bit words), the k best by a second one, sorted.
        ``argpartition`` orders NaN above everything and inf above every number, so the pool
        holds any there are: its magnitudes are the ones checked. When an edge is tied (the
        value just outside equals the value just inside), ties are settled by index as the
        plain way does."""
        n = acc.size
        mag = self._buffer(n)
        np.abs(acc, out=mag)
        order = np.argpartition(mag, n - pool - 1)  # one k-th: several cost 6x here
        candidates = order[n - pool:]
        halves = np.empty(2 * pool, np.uint32)  # little-endian: the low word, then the high
        low = halves[0::2]
        np.take(mag.view(np.uint32), candidates, out=low, mode="clip")
        in_pool = low.view(np.float32)  # the pool's magnitudes
        if not math.isfinite(in_pool.max()):  # NaN if any is, else inf if any is
            raise selection.NonFiniteError("the accumulator holds NaN or inf")
        if mag[order[n - pool - 1]] == in_pool.min():  # ties across the pool's edge
            candidates = sparsify.topk_exact(mag, pool, nonnegative=True)  # the lowest indices
            np.take(mag.view(np.uint32), candidates, out=low, mode="clip")
        np.take(stored.view(np.uint32), candidates, out=halves[1::2], mode="clip")
        key = halves.view(np.uint64)
        best = np.argpartition(key, pool - k)
        kth = key[best[pool - k]]
        chosen = best[pool - k:]
        tied = np.count_nonzero(key == kth)
        if tied > 1 and np.count_nonzero(key[chosen] == kth) < tied:
            # ties in both, some left out: the lowest indices, as the plain way
            keep = key > kth
            tied = np.flatnonzero(key == kth)
            tied = tied[np.argsort(candidates[tied], kind="stable")]
            keep[tied[:k - int(np.count_nonzero(keep))]] = True
            chosen = keep
        return np.sort(candidates[chosen])

    def _buffer(self, n):
        if self._mag is None or self._mag.size < n:
            self._mag = np.empty(n, np.float32)
        return self._mag[:n]

    def _key(self, prio, mag):
        """One sort key per candidate: priority, then magnitude (non-negative float32 bits
        order as the values do)."""
        xp = self.xp
        key = prio.view(xp.uint32).astype(xp.uint64) << 32
        key |= mag.view(xp.uint32)
        return key

    def _best(self, prio, mag, k):
        """Mask of the k best candidates: highest priority first, then largest magnitude, then
        lowest index (candidates are sorted): the k largest keys, by one partition."""
        return self._ranked(self._key(prio, mag), k)

    def _ranked(self, key, k):
        """Mask of the k largest keys, ties to the lowest positions."""
        xp = self.xp
        kth = xp.partition(key, key.size - k)[key.size - k]
        keep = key > kth
        short = k - int(xp.count_nonzero(keep))
        if short:  # ties in both: the lowest indices
            keep[xp.flatnonzero(key == kth)[:short]] = True
        return keep

    def _streamed(self, acc, stored, k, pool):
        """The same answer from one pass over a large host slice, or None when the sample's
        bounds missed (then the plain way).

        From a strided sample, each bound 3 standard deviations of the sample count wide:
        a_lo <= (the pool's smallest magnitude) < a_hi, and a key (p_w, m_w) that at least k
        pool entries reach. The pass counts the entries with |acc| >= a_lo and collects those
        that are also below a_hi (the pool's edge, all of them: it fixes the edge exactly) or
        may reach the key (priority >= p_w; when p_w is 0, priority > 0 or |acc| >= m_w). Every
        pool entry that reaches the key is collected; the k best of the pool are among them
        when at least k are."""
        bounds = self._sample_bounds(acc, stored, k, pool)
        if bounds is None:
            return None
        a_lo, a_hi, key_w, p_w, m_w = bounds
        found = self._collect(acc, stored, a_lo, a_hi, p_w, m_w)
        if found is None:
            return None
        idx, mag, prio, n_lo = found
        edge = mag < a_hi
        above = n_lo - int(np.count_nonzero(edge))  # entries with |acc| >= a_hi: all in the pool
        edge_mag = mag[edge]
        need = pool - above  # pool entries on the edge
        if not 0 < need <= edge_mag.size:  # the pool's smallest magnitude is outside [a_lo, a_hi)
            return None
        kth = np.partition(edge_mag, edge_mag.size - need)[edge_mag.size - need]
        in_pool = mag > kth
        short = pool - above - int(np.count_nonzero(edge_mag > kth))
        if short:  # ties at the pool's smallest magnitude (all on the edge): the lowest indices
            in_pool[np.flatnonzero(mag == kth)[:short]] = True
        in_pool &= self._key(prio, mag) >= key_w
        if int(np.count_nonzero(in_pool)) < k:
            return None
        idx, prio, mag = idx[in_pool], prio[in_pool], mag[in_pool]
        return idx[self._best(prio, mag, k)]

    def _sample_bounds(self, acc, stored, k, pool):
        """(a_lo, a_hi, the key, its priority p_w and magnitude m_w) from the strided sample,
        or None when the sample cannot bound the pool."""
        n = acc.size
        mag_s = np.abs(acc[::selection.SAMPLE_STRIDE])
        prio_s = stored[::selection.SAMPLE_STRIDE]
        m = mag_s.size
        expect, expect_k = pool * m / n, k * m / n
        lo_rank = int(expect + 3 * np.sqrt(expect)) + 1  # sample entries at or above a_lo
        hi_rank = int(expect - 3 * np.sqrt(expect))  # sample entries at or above a_hi
        if lo_rank >= m:
            return None
        inf = np.float32(np.inf)
        kths = [m - lo_rank] + ([m - hi_rank] if hi_rank >= 1 else [])
        part = np.partition(mag_s, kths)
        a_lo, a_hi = part[m - lo_rank], part[m - hi_rank] if hi_rank >= 1 else inf
        surely = mag_s >= a_hi  # a sample of pool entries
        keys = self._key(prio_s[surely], mag_s[surely])
        want = int(expect_k + 3 * np.sqrt(expect_k)) + 1
        if keys.size > want:
            key_w = np.partition(keys, keys.size - want)[keys.size - want]
        else:
            key_w = np.uint64(0)
        p_w = np.uint32(key_w >> np.uint64(32)).view(np.float32)
        m_w = np.uint32(key_w & np.uint64(0xFFFFFFFF)).view(np.float32) if p_w == 0 else inf
        return a_lo, a_hi, key_w, p_w, m_w

    def _collect(self, acc, stored, a_lo, a_hi, p_w, m_w):
        """The one pass, block by block in cache-sized scratch: (indices, magnitudes,
        priorities) of the entries collected, and how many reach a_lo; None if none was."""
        n = acc.size
        block = sparsify.BLOCK
        if self._scratch is None or self._scratch[0].size != block:
            self._scratch = (np.empty(block, np.float32), np.empty(block, bool),
                             np.empty(block, bool), np.empty(block, bool))
        mag_buf, lo_buf, take_buf, also_buf = self._scratch
        n_lo, parts = 0, []
        for start in range(0, n, block):
            size = min(block, n - start)
            mag = np.abs(acc[start:start + size], out=mag_buf[:size])
            if not np.isfinite(mag.max()):  # in cache; NaN and inf propagate through max
                raise selection.NonFiniteError("the accumulator holds NaN or inf (first near "
                                             f"index {start})")
            lo = np.greater_equal(mag, a_lo, out=lo_buf[:size])
            n_lo += int(np.count_nonzero(lo))
            prio = stored[start:start + size]
            if p_w > 0:
                take = np.greater_equal(prio, p_w, out=take_buf[:size])
            else:
                take = np.greater(prio, 0, out=take_buf[:size])
                take |= np.greater_equal(mag, m_w, out=also_buf[:size])
            take |= np.less(mag, a_hi, out=also_buf[:size])
            take &= lo
            hits = np.flatnonzero(take)
            if hits.size:
                parts.append((hits + start, mag[hits], prio[hits]))
        if not parts:
            return None
        idx, mag, prio = (np.concatenate(p) for p in zip(*parts))
        return idx, mag, prio, n_lo

    def observe(self, indices, values, iteration):
        self.priority.decay(self.gamma)
        self.priority.add(indices, None, 1.0)

    def state_dict(self):
        return self.priority.state_dict()

    def load_state_dict(self, state):
        self.priority.load_state_dict(state)
