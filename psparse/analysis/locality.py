"""Locality of large gradient entries (the thesis's section 6.2 observation), measured on a run.

Recording (``psparse/worker/selections.py``): with ``--record-selections``, every worker saves, per
iteration, the top-k indices of its raw gradient |g| and the indices it actually sent, to
RUN_DIR/selections-rank-R.npz, and two measures of its error-feedback accumulator a (before the
push): ``captured``, the squared norm of a at the sent indices over that of a's own k largest
entries (1 for top-k: how much of what is most due a policy sends), and ``backlog``, ||a|| / ||g||
(the residual carried, in units of one gradient: it grows when a policy leaves large entries
waiting).

Analysis: ``psparse-locality RUN_DIR`` reads them and reports
  * recurrence: of the top-k gradient indices at iteration t, the fraction that are in the top-k
    again within the next h iterations (h = 1..horizon), per layer and overall, against
    1 - (1 - k/n)^h, the chance that an index of a random k-set is drawn again within h
    independent random k-sets (k/n at h = 1, about 18% at h = 20 for k/n = 1%);
  * agreement: the Jaccard overlap |A∩B|/|A∪B| of two workers' top-k sets at the same
    iteration, averaged over worker pairs, per layer and over iterations; also for the sets sent;
and writes locality.json and locality.png (both panels) into RUN_DIR.

``--shards S``: the key-range boundaries that give S server shards about the same load
(``--shard-edges``), from the recorded pushes: a key's load is the entries it made, pushed by
a worker or broadcast to the N workers at the union (``shard_load``), and the boundaries split
its running sum in S equal parts (``keyranges.balanced_edges``); printed beside the busiest
shard's share of the load under equal ranges and under the proposed ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import combinations
from pathlib import Path

import numpy as np


def load(path: Path) -> dict:
    with np.load(path) as z:
        def unpack(values, offsets):
            return [values[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]

        return {"grad_topk": unpack(z["grad_topk"], z["grad_offsets"]),
                "sent": unpack(z["sent"], z["sent_offsets"]),
                "topk_energy": z["topk_energy"] if "topk_energy" in z else None,
                # recorded from the accumulator since issue 16 (empty before)
                "captured": z["captured"] if "captured" in z else np.empty(0),
                "backlog": z["backlog"] if "backlog" in z else np.empty(0),
                "layer_sizes": z["layer_sizes"].tolist(),
                "layer_names": [str(n) for n in z["layer_names"]]}


def recurrence(sets: list[np.ndarray], numel: int, horizon: int,
               layer_of: np.ndarray, n_layers: int) -> np.ndarray:
    """[layer+1, horizon]: fraction of an iteration's set seen again within h iterations.

    Row 0 is over all indices, row 1+l over layer l. Iterations closer than h to the end are
    left out of the h-th column so every column has a full window.
    """
    T = len(sets)
    next_seen = np.full(numel, np.iinfo(np.int64).max // 2, dtype=np.int64)
    hits = np.zeros((n_layers + 1, horizon))
    totals = np.zeros((n_layers + 1, horizon))
    for t in range(T - 1, -1, -1):  # backwards: next_seen[i] = next iteration holding i
        idx = sets[t]
        lag = next_seen[idx] - t
        layers = layer_of[idx]
        for h in range(1, horizon + 1):
            if t + h >= T:
                continue
            ok = lag <= h
            hits[0, h - 1] += ok.sum()
            totals[0, h - 1] += idx.size
            hits[1:, h - 1] += np.bincount(layers[ok], minlength=n_layers)
            totals[1:, h - 1] += np.bincount(layers, minlength=n_layers)
        next_seen[idx] = t
    with np.errstate(invalid="ignore", divide="ignore"):
        return hits / totals


def random_recurrence(k: int, numel: int, horizon: int) -> list[float]:
    """What ``recurrence`` gives for independent uniformly random k-sets of n indices: an index
    is in each later set with probability k/n, so within h sets with 1 - (1 - k/n)^h."""
    return [1 - (1 - k / numel) ** h for h in range(1, horizon + 1)]


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    inter = np.intersect1d(a, b, assume_unique=True).size
    union = a.size + b.size - inter
    return inter / union if union else 1.0


def analyse(run_dir: Path, horizon: int = 20) -> dict:
    files = sorted(run_dir.glob("selections-rank-*.npz"),
                   key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    if not files:
        raise FileNotFoundError(f"no selections-rank-*.npz in {run_dir}: run psparse-launch "
                                "with --record-selections")
    ranks = [load(f) for f in files]
    sizes, names = ranks[0]["layer_sizes"], ranks[0]["layer_names"]
    numel = sum(sizes)
    layer_of = np.repeat(np.arange(len(sizes)), sizes)
    k = int(np.median([s.size for s in ranks[0]["grad_topk"]]))
    rec = np.nanmean([recurrence(r["grad_topk"], numel, horizon, layer_of, len(sizes))
                      for r in ranks], axis=0)
    T = min(len(r["grad_topk"]) for r in ranks)
    pairs = list(combinations(range(len(ranks)), 2))
    agree_grad = [np.mean([jaccard(ranks[a]["grad_topk"][t], ranks[b]["grad_topk"][t])
                           for a, b in pairs]) if pairs else 1.0 for t in range(T)]
    agree_sent = [np.mean([jaccard(ranks[a]["sent"][t], ranks[b]["sent"][t])
                           for a, b in pairs]) if pairs else 1.0 for t in range(T)]
    share = np.bincount(np.concatenate([layer_of[s] for r in ranks for s in r["grad_topk"]]),
                        minlength=len(sizes)) / max(1, sum(s.size for r in ranks
                                                             for s in r["grad_topk"]))
    per_layer_jaccard = []
    for layer in range(len(sizes)):
        vals = [jaccard(ranks[a]["grad_topk"][t][layer_of[ranks[a]["grad_topk"][t]] == layer],
                        ranks[b]["grad_topk"][t][layer_of[ranks[b]["grad_topk"][t]] == layer])
                for t in range(0, T, max(1, T // 50)) for a, b in pairs]
        per_layer_jaccard.append(float(np.mean(vals)) if vals else None)
    energy = [r["topk_energy"] for r in ranks if r["topk_energy"] is not None]
    captured = np.concatenate([r["captured"] for r in ranks])
    backlog = np.concatenate([r["backlog"] for r in ranks])
    return {
        "workers": len(ranks), "iterations": T, "numel": numel, "k": k, "horizon": horizon,
        # mean share of a worker's squared gradient norm held by its top-k entries
        "topk_energy_mean": float(np.mean(np.concatenate(energy))) if energy else None,
        # the accumulator at each push (None for recordings made before it was recorded)
        "captured_mean": float(captured.mean()) if captured.size else None,
        "backlog_mean": float(backlog.mean()) if backlog.size else None,
        "random_recurrence_1": k / numel,
        # the same measure for independent random k-sets: 1 - (1 - k/n)^h, h = 1..horizon
        "random_recurrence": random_recurrence(k, numel, horizon),
        "recurrence": rec[0].tolist(),
        "layers": [{"name": n, "size": s, "share_of_numel": s / numel,
                    "share_of_topk": float(share[i]), "recurrence": rec[i + 1].tolist(),
                    "jaccard_between_workers": per_layer_jaccard[i]}
                   for i, (n, s) in enumerate(zip(names, sizes))],
        "jaccard_topk_mean": float(np.mean(agree_grad)),
        "jaccard_sent_mean": float(np.mean(agree_sent)),
        "jaccard_topk": [float(v) for v in agree_grad],
        "jaccard_sent": [float(v) for v in agree_sent],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    h = np.arange(1, result["horizon"] + 1)
    a.plot(h, result["recurrence"], "k-", lw=2, label="all layers")
    for layer in result["layers"]:
        a.plot(h, layer["recurrence"], lw=1, label=layer["name"])
    random = result.get("random_recurrence") or random_recurrence(
        result["k"], result["numel"], result["horizon"])
    a.plot(h, random, color="grey", ls=":", label="random k-sets: 1 - (1 - k/n)^h")
    a.set_xlabel("window h (iterations)")
    a.set_ylabel("fraction of top-k seen again within h")
    a.set_title("Recurrence of a worker's top-k gradient indices")
    a.set_ylim(0, 1)
    a.legend(fontsize=7)
    t = np.arange(len(result["jaccard_topk"]))
    b.plot(t, result["jaccard_topk"], lw=1, label="top-k of |gradient|")
    b.plot(t, result["jaccard_sent"], lw=1, label="sets sent")
    b.set_xlabel("iteration")
    b.set_ylabel("mean Jaccard between workers")
    b.set_title("Agreement between workers at the same iteration")
    b.set_ylim(0, 1)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def summary_text(result: dict) -> str:
    """The analysis as a short text table (what psparse-locality prints)."""
    rec = result["recurrence"]
    lines = [f"{result['workers']} workers, {result['iterations']} iterations, k = "
             f"{result['k']} of {result['numel']} (k/n = {result['random_recurrence_1']:.2%})"]
    if result.get("topk_energy_mean") is not None:
        lines.append(f"share of the squared gradient norm in the top-k entries: "
                     f"{result['topk_energy_mean']:.1%}")
    if result.get("captured_mean") is not None:
        lines.append(f"share of the accumulator's top-k energy that the pushes carried: "
                     f"{result['captured_mean']:.1%}; backlog ||accumulator|| / ||gradient||: "
                     f"{result['backlog_mean']:.2f}")
    rnd = result.get("random_recurrence") or random_recurrence(
        result["k"], result["numel"], result["horizon"])
    five = min(4, len(rec) - 1)
    lines += [f"top-k gradient indices seen again within 1 / 5 / {result['horizon']} "
              f"iterations: {rec[0]:.1%} / {rec[five]:.1%} / {rec[-1]:.1%} (random k-sets: "
              f"{rnd[0]:.1%} / {rnd[five]:.1%} / {rnd[-1]:.1%})",
              f"mean Jaccard between workers: top-k {result['jaccard_topk_mean']:.3f}, "
              f"sent {result['jaccard_sent_mean']:.3f}",
              f"{'layer':<16}{'size':>8}{'share of n':>12}{'share of top-k':>16}"
              f"{'again in 1':>12}{'Jaccard':>9}"]
    for layer in result["layers"]:
        jac = layer["jaccard_between_workers"]
        lines.append(f"{layer['name']:<16}{layer['size']:>8}{layer['share_of_numel']:>12.1%}"
                     f"{layer['share_of_topk']:>16.1%}{layer['recurrence'][0]:>12.1%}"
                     f"{jac if jac is not None else float('nan'):>9.3f}")
    return "\n".join(lines)


def shard_load(ranks: list[dict], numel: int) -> np.ndarray:
    """Per key, the entries it made over the recorded iterations: once per worker that pushed
    it, and N times (one broadcast per worker) per round whose union held it."""
    load = np.zeros(numel, dtype=np.int64)
    for t in range(min(len(r["sent"]) for r in ranks)):
        sent = [r["sent"][t] for r in ranks]
        for s in sent:
            np.add.at(load, s, 1)
        load[np.unique(np.concatenate(sent))] += len(ranks)
    return load


def shard_split(run_dir: Path, count: int) -> dict:
    """``--shards S``: balanced boundaries for S shards, and the busiest shard's share of the
    recorded load with equal ranges and with them (1/S is perfect balance)."""
    from ..wire import keyranges

    files = sorted(run_dir.glob("selections-rank-*.npz"))
    if not files:
        raise FileNotFoundError(f"no selections-rank-*.npz in {run_dir}: run psparse-launch "
                                "with --record-selections")
    ranks = [load(f) for f in files]
    load_per_key = shard_load(ranks, sum(ranks[0]["layer_sizes"]))
    total = max(1, int(load_per_key.sum()))
    edges = keyranges.balanced_edges(load_per_key, count)

    def busiest(bounds) -> float:
        return max(int(load_per_key[a:b].sum()) for a, b in zip(bounds, bounds[1:])) / total
    equal = keyranges.bounds(load_per_key.size, count).tolist()
    return {"shards": count, "shard_edges": edges,
            "busiest_share_equal": busiest(equal),
            "busiest_share_balanced": busiest([0, *edges, load_per_key.size])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="psparse-locality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="a run made with --record-selections")
    p.add_argument("--horizon", type=int, default=20, help="largest window h (default 20)")
    p.add_argument("--shards", type=int, default=None, metavar="S",
                   help="also propose --shard-edges for S server shards that balances the "
                        "recorded load (written to locality.json as shard_split)")
    args = p.parse_args(argv)
    if args.shards is not None and args.shards < 2:
        p.error("--shards must be at least 2")
    try:
        result = analyse(args.run_dir, args.horizon)
        if args.shards is not None:
            result["shard_split"] = shard_split(args.run_dir, args.shards)
    except (FileNotFoundError, ValueError) as exc:
        print(f"psparse-locality: error: {exc}", file=sys.stderr)
        return 1
    (args.run_dir / "locality.json").write_text(json.dumps(result, indent=1))
    plot(result, args.run_dir / "locality.png")
    print(summary_text(result))
    if args.shards is not None:
        split = result["shard_split"]
        print(f"{args.shards} shards: the busiest carries {100 * split['busiest_share_equal']:.0f}% "
              f"of the recorded load with equal ranges, "
              f"{100 * split['busiest_share_balanced']:.0f}% with\n  --shard-edges "
              + ",".join(map(str, split["shard_edges"])))
    print(f"wrote {args.run_dir / 'locality.json'} and {args.run_dir / 'locality.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
