"""Selection speed, as ratios against baselines measured in the same run.

Part 1, top-k: for each size n and density, our ``Selector.topk`` (sampled threshold + streaming
compaction) versus one memory copy of n floats (``numpy.copyto``: how many "memory passes"
selection costs), versus ``numpy.argpartition`` on |x| (the exact baseline), and versus
``torch.topk(x.abs(), k)``. Target: at 11.2M floats, selection within 3 memory passes.

Part 2, per policy (issue 18, item 3): one worker's whole per-round selection work for every
built-in policy -- ``propose`` (two-phase policies), ``select`` and ``observe`` -- against
top-k's, measured in the same run, at LeNet's size (61,706) and at 11M parameters. Target:
every policy within 1.5x of top-k. The inputs are a synthetic but realistic round
(``Workload``): a heavy-tailed gradient with per-entry scales, so the same entries are large
round after round; error feedback (what is sent is zeroed, the rest accumulates); and the
aggregate every worker observes is the union of this worker's push and 7 other workers' pushes
(half from the 4k entries of largest scale, half from the 16k largest), each other worker
pushing where this one does as often as the policy aligns workers: the union's size is the
policy's union/k measured on LeNet (``UNION``: 6.2 k for top-k, 1.8 k for core). So
history-based policies carry a realistic state: at LeNet's size, after 1000 rounds of history,
``core``'s priority has ~12k nonzeros and several hundred subnormal values, as in a simulation
of 8 workers each running core on such gradients (at 11M, 8 rounds of history). Policies run
interleaved in blocks of 8 rounds (one ``cltk`` leader turn each), so load drift hits all
alike; the figure is the median over blocks of the mean time per round, and ``observe``'s part
of it is shown apart. What every policy shares (accumulating, gathering the pushed values, the
server's part) is not timed.

``--part topk`` / ``--part policies`` runs one part; ``--quick`` shortens part 2. Both write
their figures into benchmarks/results/bench.json (``common.record``): ``host_topk_copy_passes``
(per size and density; the target at 11.2M, 0.1%: <= 1.5) and ``policy_vs_topk`` (per policy,
size and density, x top-k; with the memory floors measured beside them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import median_time, record, table  # noqa: E402

from psparse.ops import jit  # noqa: E402
from psparse.ops.select.selection import sorted_union  # noqa: E402
from psparse.ops.select.sparsify import Selector, density_to_k, topk_exact  # noqa: E402
from psparse.policies import REGISTRY, Layout, build_policy  # noqa: E402

SIZES = [61_706, 11_200_000, 25_000_000]
DENSITIES = [0.001, 0.01]

POLICY_CASES = [(61_706, 0.01), (61_706, 0.001), (11_000_000, 0.01), (11_000_000, 0.001)]
WORKERS = 8
# union/k of each policy on LeNet/MNIST, 8 workers, density 1% (docs/policies.md, "Measured");
# two-phase policies and randomk: every worker pushes the same indices
UNION = {"topk": 6.20, "threshold": 7.43, "frequency": 5.09, "ema": 4.25, "penalty": 3.22,
         "core": 1.81}
TARGET = 1.5  # every policy's selection time within 1.5x of top-k's
# Part 2 times CPU seconds of this thread, not wall time: on a shared machine whose CPU share
# is capped, wall time counts the waits for the next slice, which hit policies at random.
CLOCK = time.thread_time


def topk_table() -> tuple[str, dict]:
    rng = np.random.default_rng(0)
    rows, passes = [], {}
    for n in SIZES:
        # gradient-like: mostly small, a heavy tail of large entries
        x = (rng.standard_normal(n) * rng.standard_normal(n) ** 3).astype(np.float32)
        dst = np.empty_like(x)
        dst[:] = 1.0  # touch the pages before timing
        reps = 21 if n < 1_000_000 else 5
        t_copy = median_time(lambda: np.copyto(dst, x), reps)
        xt = torch.from_numpy(x)
        for density in DENSITIES:
            k = max(1, int(round(density * n)))
            sel = Selector(n)
            got = sel.topk(x, k)
            assert np.array_equal(got, topk_exact(x, k)), "selection is not exact"
            t_ours = median_time(lambda: sel.topk(x, k), reps)
            t_part = median_time(lambda: np.argpartition(np.abs(x), n - k), reps)
            t_torch = median_time(lambda: torch.topk(xt.abs(), k), max(3, reps // 2))
            passes[f"{n}@{density:g}"] = round(t_ours / t_copy, 3)
            rows.append([f"{n:,}", f"{density:.1%}", f"{k:,}", f"{t_ours * 1e3:.2f}",
                         f"{t_ours / t_copy:.2f}", f"{t_part / t_ours:.1f}x",
                         f"{t_torch / t_ours:.1f}x", "numpy" if jit.REFERENCE else "compiled"])
    return "\n".join([
        "Top-k selection (median ms; ratios measured in this run)",
        table(rows, ["n", "density", "k", "ours ms", "copy passes", "vs argpartition",
                     "vs torch.topk", "path"]),
        "copy passes = our time / one numpy.copyto of n float32 (target at 11.2M, 0.1%: <= 1.5)"]), \
        passes


# --------------------------------------------------------------------- part 2: per policy
class Workload:
    """The rounds one worker of 8 sees at n parameters and one density: its gradients, the other
    7 workers' pushes, the values of the aggregate. The same for every policy."""

    def __init__(self, n: int, density: float, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.n, self.k = n, density_to_k(density, n)
        big = n > 1_000_000
        # per-entry scale, heavy-tailed (|N(0,1)|^3): the same entries are large every round
        self.scale = np.abs(rng.standard_normal(n, dtype=np.float32)) ** 3
        self.grads = [self.scale * rng.standard_normal(n, dtype=np.float32)
                      for _ in range(2 if big else 16)]
        # the others push half from the 4k entries of largest scale, half from the 16k largest
        by_scale = np.argsort(self.scale)[::-1]
        hot, warm = by_scale[:min(n, 4 * self.k)], by_scale[:min(n, 16 * self.k)]
        self.others, self.leader = [], []  # per round: the 7 others' union; one other's push
        for _ in range(8 if big else 32):
            pushes = [sorted_union([rng.choice(hot, self.k // 2, replace=False),
                                    rng.choice(warm, self.k - self.k // 2, replace=False)])
                      for _ in range(WORKERS - 1)]
            self.others.append(sorted_union(pushes))
            self.leader.append(pushes[0])
        self.draw = rng.random(max(o.size for o in self.others))
        self.noise = rng.standard_normal(n, dtype=np.float32) / np.float32(WORKERS)
        # threshold's lambda: about k entries of a fresh gradient reach it
        self.lam = float(np.partition(np.abs(self.grads[0]), n - self.k)[n - self.k])

    def aggregate(self, pushed, it: int, share: float):
        """The union of this worker's push and the others', who push ``share`` of their k
        entries on their own and the rest where this worker pushes (the policy aligns them)."""
        others = self.others[it % len(self.others)]
        indices = sorted_union([pushed, others[self.draw[:others.size] < share]])
        return indices, self.scale[indices] * self.noise[:indices.size]

    def group(self, policy, proposal, it: int):
        """What the server sends back in a two-phase round (computed here, not timed)."""
        g = it % len(self.others)
        if policy.name == "cltk":
            return proposal if proposal is not None else self.leader[g]
        # vote: the group_k proposed indices of largest mean |value| (scale stands for it)
        proposed = sorted_union([proposal, self.others[g]])
        keep = policy.group_k
        if proposed.size <= keep:
            return proposed
        return np.sort(proposed[np.argpartition(-self.scale[proposed], keep)[:keep]])


class Round:
    """One policy's worker (rank 0 of 8) running through a workload's rounds."""

    def __init__(self, name: str, work: Workload):
        args = [f"lam={work.lam}"] if name == "threshold" else []
        self.policy = build_policy(name, args, Layout([work.n]), work.k, rank=0,
                                   world_size=WORKERS, seed=0)
        self.work, self.it = work, 0
        # the others' own share, so that the union is the policy's measured union/k
        self.share = min(1.0, (UNION.get(name, 1.0) - 1) / (UNION["topk"] - 1))
        self.acc = np.zeros(work.n, dtype=np.float32)

    def step(self) -> tuple[float, float]:
        """One round; the seconds spent in the policy's propose, select and observe, and in
        observe alone."""
        work, policy, acc, it = self.work, self.policy, self.acc, self.it
        acc += work.grads[it % len(work.grads)]  # error feedback: the accumulator grows
        spent, group = 0.0, None
        if policy.two_phase:
            t = CLOCK()
            proposal = policy.propose(acc, it)
            spent += CLOCK() - t
            group = work.group(policy, proposal, it)
        t = CLOCK()
        pushed = policy.select(acc, it, group=group)
        spent += CLOCK() - t
        acc[pushed] = 0.0  # sent
        indices, values = work.aggregate(pushed, it, self.share)
        t = CLOCK()
        policy.observe(indices, values, it)
        observed = CLOCK() - t
        self.it += 1
        return spent + observed, observed


def policy_times(n: int, density: float, history: int, blocks: int,
                 names=tuple(REGISTRY)) -> dict[str, tuple[float, float]]:
    """Per policy, after ``history`` untimed rounds: the median over blocks of the seconds per
    round (propose + select + observe), and of observe's seconds per round."""
    work = Workload(n, density)
    rounds = {name: Round(name, work) for name in names}
    for r in rounds.values():
        for _ in range(history):
            r.step()
    per_round = {name: [] for name in names}
    for _ in range(blocks):  # interleaved: load drift hits every policy alike
        for name, r in rounds.items():
            per_round[name].append(np.mean([r.step() for _ in range(WORKERS)], axis=0))
    return {name: tuple(float(statistics.median(col)) for col in zip(*ts))
            for name, ts in per_round.items()}


def memory_floor(n: int, density: float,
                 union_k: float = UNION["ema"]) -> tuple[float, float, float]:
    """What a round must cost in memory traffic inside the selection's timing boundary, at
    numpy's fastest, a compiled kernel's order of cost: a top-k reads the accumulator once (one
    reduction over it); a policy that ranks by a model-sized state (ema) also reads that state,
    and updates it at the aggregate's entries (the faster of ``numpy.add.at`` and a gather-add-
    scatter over a sorted union of ``union_k`` times k, ema's union/k at 1% on LeNet). Seconds
    of thread CPU, medians: (top-k's read, ema's two reads, ema's update)."""
    rng = np.random.default_rng(0)
    acc = rng.standard_normal(n, dtype=np.float32)
    state = np.abs(rng.standard_normal(n, dtype=np.float32))
    k = density_to_k(density, n)
    union = np.sort(rng.choice(n, min(n, int(union_k * k)), replace=False))
    add = rng.random(union.size, dtype=np.float32)

    def gather_add_scatter():
        state[union] += add

    reps = _calls_per_sample(n)

    def timed(fn):
        ts = []
        for _ in range(9):
            t = CLOCK()
            for _ in range(reps):
                fn()
            ts.append((CLOCK() - t) / reps)
        return statistics.median(ts)

    read_acc = timed(acc.max)
    update = min(timed(lambda: np.add.at(state, union, add)), timed(gather_add_scatter))
    return read_acc, read_acc + timed(state.max), update


def policy_table(quick: bool = False) -> tuple[str, dict]:
    names = list(REGISTRY)
    cases = POLICY_CASES[:1] + POLICY_CASES[2:3] if quick else POLICY_CASES
    ratios = {}
    lines = ["Per-policy selection, one worker of 8: propose + select + observe per round "
             "(median ms; x topk: against top-k in this run; observe: the state update's part)"]
    for n in dict.fromkeys(n for n, _ in cases):
        big = n > 1_000_000
        history = (4 if quick else 8) if big else (200 if quick else 1000)
        blocks = (2 if quick else 4) if big else (10 if quick else 30)
        medians = {d: policy_times(n, d, history, blocks, names) for m, d in cases if m == n}
        rows, ms = [], (lambda s: f"{s * 1e3:.1f}") if big else (lambda s: f"{s * 1e3:.3f}")
        for name in names:
            row = [name]
            for d, times in medians.items():
                (t, observe), base = times[name], times["topk"][0]
                ratios[f"{name}@{n}@{d:g}"] = round(t / base, 3)
                row += [ms(t), f"{t / base:.2f}" + (" !" if t > TARGET * base else ""),
                        ms(observe)]
            rows.append(row)
        header = ["policy"] + [h for d in medians
                               for h in (f"ms @ {d:.1%}", "x topk", "observe ms")]
        lines += ["", f"{n:,} parameters" + (" (LeNet-5)" if n == 61_706 else ""),
                  table(rows, header)]
    lines.append(f"target: every policy within {TARGET}x of top-k ('!' marks a miss)")
    for n, density in ([] if quick else cases):
        read, reads, update = memory_floor(n, density)
        ratios[f"floor_ema_reads@{n}@{density:g}"] = round(reads / read, 3)
        ratios[f"floor_ema_reads_and_update@{n}@{density:g}"] = round((reads + update) / read, 3)
        ms = (lambda sec: f"{sec * 1e3:.1f}") if n > 1_000_000 else (lambda sec: f"{sec * 1e3:.4f}")
        lines.append(f"memory floor at {n:,}, {density:.1%} (memory_floor): top-k reads the "
                     f"accumulator once, {ms(read)} ms; ema also reads its priority, "
                     f"{ms(reads)} ms ({reads / read:.1f}x), and updates it at its union, "
                     f"{ms(reads + update)} ms ({(reads + update) / read:.1f}x)")
        pool, gather = pool_floor(n, density)
        ratios[f"floor_frequency_pool@{n}@{density:g}"] = round(pool, 3)
        ratios[f"floor_penalty_gather@{n}@{density:g}"] = round(gather, 3)
        lines.append(f"pool floor at {n:,}, {density:.1%} (pool_floor): frequency ranks the "
                     f"c*k = 4k largest |acc|; selecting those alone takes {pool:.2f}x top-k's "
                     "time (Selector.topk of 4k against of k, same accumulator); penalty also "
                     "reads |acc| at the previous aggregate's entries: top-k and that gather, "
                     f"{gather:.2f}x")
        read, _, update = memory_floor(n, density, UNION["core"])
        ratios[f"floor_core_update@{n}@{density:g}"] = round((read + update) / read, 3)
        lines.append(f"update floor at {n:,}, {density:.1%}: core reads the accumulator and "
                     f"updates its model-sized state at its union ({UNION['core']}k): "
                     f"{(read + update) / read:.2f}x top-k's one read")
    return "\n".join(lines), ratios


def _calls_per_sample(n: int) -> int:
    """Calls timed together in one sample of the floors: a small model's take microseconds."""
    return 1 if n > 1_000_000 else 200


def pool_floor(n: int, density: float, c: float = 4.0) -> tuple[float, float]:
    """What frequency's and penalty's rules cost at least, as multiples of top-k. frequency's
    candidates are the c*k largest |acc| (its default c), so no selection of them is cheaper
    than a top-(c*k) of the accumulator; penalty's rule needs |acc| at every entry of the
    previous aggregate (its union/k times k of them) beside a top-k. Thread CPU medians of
    ``Selector.topk`` and of a numpy gather on the heavy-tailed bench accumulator,
    interleaved: (top-(c*k) / top-k, (top-k + gather) / top-k)."""
    rng = np.random.default_rng(0)
    acc = (np.abs(rng.standard_normal(n, dtype=np.float32)) ** 3
           * rng.standard_normal(n, dtype=np.float32))
    k = density_to_k(density, n)
    selector = Selector(n)
    previous = np.sort(rng.choice(n, min(n, int(UNION["penalty"] * k)), replace=False))
    times = {k: [], int(c * k): [], "gather": []}
    reps = _calls_per_sample(n)
    for _ in range(9):
        for size in times:
            t = CLOCK()
            for _ in range(reps):
                if size == "gather":
                    np.abs(acc[previous])
                else:
                    selector.topk(acc, size)
            times[size].append((CLOCK() - t) / reps)
    top = statistics.median(times[k])
    return (statistics.median(times[int(c * k)]) / top,
            (top + statistics.median(times["gather"])) / top)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["all", "topk", "policies"], default="all")
    ap.add_argument("--quick", action="store_true", help="part 2: fewer rounds and cases")
    args = ap.parse_args(argv)
    if args.part in ("all", "topk"):
        text, passes = topk_table()
        print(text, flush=True)
        record({"host_topk_copy_passes": {**passes, "target": 1.5}})
    if args.part in ("all", "policies"):
        if args.part == "all":
            print()
        text, ratios = policy_table(args.quick)
        print(text, flush=True)
        record({"policy_vs_topk": {**ratios, "target": TARGET, "quick": args.quick}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
