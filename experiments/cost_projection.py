"""Issue 54, on paper: where psparse wins past one machine, from the cost model
(psparse.analysis.costmodel), every figure a model, not a measurement.

    python -m experiments.cost_projection        # experiments/results/cost-projection.{json,md}

Per model size (25.6M, 125M and 1B parameters), workers N (64, 256, 1024) and link (1, 10 and
100 Gbit/s), the predicted time per iteration of

* psparse with one server, and with a shard beside every worker (S = N, ``--colocated``),
  each with fp32 and int4 values;
* a dense ring allreduce in fp32 and in bf16 (DDP and its bf16 hook) and a sparse allgather
  of the same k pairs;
* psparse as built today, S = N in fp32 and int4, with the exchange's CPU per message measured
  on the emulated cluster (experiments/results/shards-cluster.json: the servers' and a worker's
  CPU per iteration over the messages they handle, at full speed): a shard handles 2N messages
  a round and a worker 2S, so at N = 1024 the messages' CPU, not the link, sets the time.

Assumptions, stated once: density 1% (k = n / 100) and an aligned union of 1.5 k (``vote
keep=1.5``'s, measured on LeNet-5 at 8 workers; a rule's union at N = 1024 is not measured);
full-duplex links; 0.05 ms of latency per dependent step; compute per iteration 100 ms at
25.6M parameters (a ResNet-50-sized model's step on one GPU, the figure issue 54 starts from),
scaled with the parameters at a fixed batch per worker; no overlap of compute and
communication; the exchange's own CPU not counted except in the "as built" columns (per
message, as measured; the per-entry work, numba's sums and codecs, is left out: at these sizes
it is milliseconds). The cost model with its shard, duplex, value-format and CPU terms was
checked against the emulated cluster's runs (experiments/results/shards-cluster.md: LeNet-5 at
25 Mbit/s, N = 4 and 8, S = 1, 2 and N); every figure here is still a model.
"""

from __future__ import annotations

import json
import sys

from experiments.harness import RESULTS, md_table
from psparse.analysis.costmodel import Setting, predict, value_bytes_of
from psparse.provenance import provenance

MODELS = {"25.6M": 25_600_000, "125M": 125_000_000, "1B": 1_000_000_000}
WORKERS = (64, 256, 1024)
LINKS = {"1 Gbit/s": 1e9, "10 Gbit/s": 10e9, "100 Gbit/s": 100e9}
DENSITY, UNION, LATENCY_S = 0.01, 1.5, 0.05e-3
COMPUTE_S_PER_PARAM = 0.1 / 25_600_000


def message_cpu_s() -> tuple[float, float] | None:
    """(a server's, a worker's) CPU seconds per message at full speed, from the emulated
    cluster's shard runs: a shard handles 2N messages a round (N pushes in, N aggregates out),
    a worker 2S; the mean over the runs with shards beside the workers (None: not measured)."""
    path = RESULTS / "shards-cluster.json"
    if not path.is_file():
        return None
    rows = [r for r in json.loads(path.read_text())["rows"]
            if r["placement"].startswith("beside") and r.get("worker_ps_cpu_ms") is not None]
    if not rows:
        return None
    server = [r["server_cpu_ms"] / r["servers"] / (2 * r["workers"]) / 1e3 for r in rows]
    worker = [r["worker_ps_cpu_ms"] / (2 * r["servers"]) / 1e3 for r in rows]
    return sum(server) / len(server), sum(worker) / len(worker)


def point(numel: int, workers: int, rate: float,
          per_message: tuple[float, float] | None = None) -> dict[str, float]:
    """Seconds per iteration of each exchange at one (model, N, link); ``per_message``: the
    measured CPU per message (server, worker), for the "as built" columns."""
    k = DENSITY * numel
    common = dict(numel=numel, k=k, workers=workers, union=UNION * k,
                  compute_s=COMPUTE_S_PER_PARAM * numel, full_duplex=True,
                  index_bytes=4 if numel < 2 ** 31 else 8)
    out = {}
    for values in ("fp32", "int4"):
        vb = value_bytes_of(values)
        out[f"psparse, one server, {values}"] = predict(
            Setting(**common, value_bytes=vb), rate, LATENCY_S)["sparse PS"]
        out[f"psparse, S = N beside the workers, {values}"] = predict(
            Setting(**common, value_bytes=vb, servers=workers, colocated=True), rate,
            LATENCY_S)["sparse PS"]
        if per_message is not None:  # every shard's 2N messages, every worker's 2S
            server_s, worker_s = per_message
            out[f"psparse as built, S = N, {values}"] = predict(
                Setting(**common, value_bytes=vb, servers=workers, colocated=True,
                        cpu_share=1.0, server_cpu_s=workers * 2 * workers * server_s,
                        worker_ps_cpu_s=2 * workers * worker_s), rate, LATENCY_S)["sparse PS"]
    fp32 = predict(Setting(**common), rate, LATENCY_S)
    out["ring allreduce, fp32"] = fp32["dense ring allreduce"]
    out["ring allreduce, bf16"] = predict(Setting(**common, ring_value_bytes=2), rate,
                                          LATENCY_S)["dense ring allreduce"]
    out["sparse allgather, fp32"] = fp32["sparse allgather"]
    return out


def figure(rows: list[dict], path) -> None:
    """Time per iteration against N at 10 Gbit/s, one panel per model size, log-log; every
    line a model, the emulated cluster's validation points named in the title."""
    from experiments.figures import pyplot, save
    plt = pyplot()
    models = list(MODELS)
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6))
    for ax, model in zip(axes, models):
        mine = [r for r in rows if r["model"] == model and r["link"] == "10 Gbit/s"]
        for name in mine[0]["seconds"]:
            ax.plot([r["workers"] for r in mine], [1e3 * r["seconds"][name] for r in mine],
                    marker="o", linestyle="--" if "as built" in name else "-", label=name)
        ax.set(xscale="log", yscale="log", xlabel="workers N", ylabel="ms per iteration",
               title=f"{model} parameters, 10 Gbit/s (model)")
        ax.set_xticks(list(WORKERS), [str(n) for n in WORKERS])
    axes[0].legend(fontsize=6)
    fig.suptitle("psparse-model's projection (validated within 15% on the emulated cluster, "
                 "N = 4 and 8: experiments/results/shards-cluster.md)", fontsize=8)
    save(fig, path)


def main() -> int:
    rows = []
    per_message = message_cpu_s()
    for model, numel in MODELS.items():
        for link, rate in LINKS.items():
            for workers in WORKERS:
                times = point(numel, workers, rate, per_message)
                best = min((v, n) for n, v in times.items() if n.startswith("psparse")
                           and "as built" not in n)
                built = [v for n, v in times.items() if "as built" in n]
                rows.append({"model": model, "numel": numel, "workers": workers, "link": link,
                             "seconds": times, "best_psparse": best[1],
                             "one_server_vs_ring": times["psparse, one server, fp32"]
                             / times["ring allreduce, fp32"],
                             "best_vs_ring": best[0] / times["ring allreduce, fp32"],
                             "best_vs_ring_bf16": best[0] / times["ring allreduce, bf16"],
                             "as_built_vs_ring": min(built) / times["ring allreduce, fp32"]
                             if built else None})
    result = {"what": "a model (psparse.analysis.costmodel), not a measurement: "
                      + __doc__.split("Assumptions, stated once: ")[1].split("\n\n")[0]
                      .replace("\n", " "),
              "per_message_cpu_ms": None if per_message is None else
              {"server": 1e3 * per_message[0], "worker": 1e3 * per_message[1]},
              "commit": provenance()["git_commit"], "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cost-projection.json").write_text(json.dumps(result, indent=1) + "\n")
    names = list(rows[0]["seconds"])
    table = md_table(["model", "link", "N", *[f"{n}, ms" for n in names],
                      "one server (fp32) vs ring", "best psparse vs ring (fp32 / bf16)",
                      "as built vs ring (fp32)"],
                     [[r["model"], r["link"], str(r["workers"]),
                       *[f"{1e3 * r['seconds'][n]:.0f}" for n in names],
                       f"{r['one_server_vs_ring']:.2f}x",
                       f"{r['best_vs_ring']:.2f}x / {r['best_vs_ring_bf16']:.2f}x",
                       "" if r["as_built_vs_ring"] is None else f"{r['as_built_vs_ring']:.2f}x"]
                      for r in rows])
    (RESULTS / "cost-projection.md").write_text(
        f"# Projected time per iteration (a model)\n\n{result['what']}\n\n"
        + ("" if per_message is None else
           f"CPU per message, measured on the emulated cluster at full speed: a server's "
           f"{1e3 * per_message[0]:.3f} ms, a worker's {1e3 * per_message[1]:.3f} ms.\n\n")
        + f"{table}\n\n![time per iteration against N at 10 Gbit/s](cost-projection.png)\n\n"
        f"Made by `python -m experiments.cost_projection` at {result['commit'][:7]}.\n")
    figure(rows, RESULTS / "cost-projection.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
