"""The emulated-cluster sweep's results, read back from its run directories: per run, the time
split, link bytes, time to each target accuracy and the cost model's prediction (``measure``);
per model, the table, the ratios against the peers, the summary over seeds and the figures
(``report``: experiments/results/cluster-<model>.{md,json}, cluster-<model>-<rate>.png)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from experiments.cluster_sweep import MODELS, PEER_RUNS, PSPARSE_RUNS, RUNS, WORKERS
from experiments.figures import pyplot, save
from experiments.harness import RESULTS, ROOT, RunDir, md_table, mean_sd
from psparse.analysis.costmodel import WIRE_OVERHEAD, Setting, predict
from psparse.training.ddp import powersgd_sizes
from psparse.wire.transport import parse_rate


def run_dir(model: str, rate: str, name: str, seed: int) -> Path:
    return ROOT / "runs" / "cluster" / f"{model}-{rate}" / f"{name}-s{seed}"


def cpu_per_iteration(samples: list[dict], iterations: int, eval_every: int) -> dict | None:
    """Server and worker CPU milliseconds per iteration from cpu-samples.jsonl, over stretches
    between evaluations (an evaluation stops the round on rank 0, not part of an iteration)."""
    server = worker = 0.0
    its, per_worker, threads = 0, {}, {}
    for lo in range(1, iterations, eval_every):
        hi = min(lo + eval_every - 3, iterations - 2)
        inside = [x for x in samples if lo <= x["iters"] <= hi]
        if len(inside) < 2 or inside[-1]["iters"] == inside[0]["iters"]:
            continue
        a, b = inside[0]["procs"], inside[-1]["procs"]
        for pid, (role, cpu) in b.items():
            if pid in a:
                d = cpu - a[pid][1]
                if role == "server":
                    server += d
                elif role == "worker":
                    per_worker[pid] = per_worker.get(pid, 0.0) + d
        ta, tb = inside[0].get("server_threads") or {}, inside[-1].get("server_threads") or {}
        for key in tb.keys() & ta.keys():
            threads[key] = threads.get(key, 0.0) + tb[key] - ta[key]
        its += inside[-1]["iters"] - inside[0]["iters"]
    if not its:
        return None
    worker = [1e3 * v / its for v in per_worker.values()]
    return {"iterations": its, "server_ms": 1e3 * server / its,
            "worker_ms_mean": statistics.mean(worker) if worker else None,
            "worker_ms_max": max(worker) if worker else None,
            # the server's CPU by thread (main / ZeroMQ's I/O / other) and user / system, where
            # the samples have it
            "server_threads_ms": {k: 1e3 * v / its for k, v in sorted(threads.items())}}


def numel_and_shapes(model: str) -> tuple[int, list[tuple[int, ...]]]:
    from psparse.data import IN_SHAPES, NUM_CLASSES
    from psparse.training.models import build_model

    dataset = {"lenet": "mnist", "gpt": "text"}.get(model, "cifar10")
    net = build_model(model, IN_SHAPES[dataset], NUM_CLASSES[dataset])
    shapes = [tuple(p.shape) for p in net.parameters() if p.requires_grad]
    return sum(p.numel() for p in net.parameters() if p.requires_grad), shapes


def measure(out: Path, name: str, rate: str, targets: list[float], shapes) -> dict:
    """One table row: time split, link bytes, time to each target accuracy (the first is the
    headline), accuracy, model prediction."""
    run = RunDir(out)
    summary = run.summary() or {"status": "no summary"}
    row = {"run": name, "rate": rate, "dir": str(out.relative_to(ROOT))}
    if summary.get("status") != "ok":
        row["failed"] = summary.get("error") or summary["status"]
        return row
    config = run.config()
    metrics, evals = run.metrics(), run.evals()
    iters = len(metrics)
    ranks = run.ranks(WORKERS)
    # rank 0 also evaluates (in its compute time): the others show the training iteration
    others = ranks[1:]
    split = {k: 1e3 * statistics.mean(r[k] for r in others) / iters
             for k in ("compute_s", "select_s", "wait_s")}
    if config.get("baseline"):
        # DDP and PowerSGD: rank 0's median iteration (metrics.jsonl has its split). The other
        # ranks' totals hold rank 0's evaluation stalls when the model has BatchNorm
        # (ResNet-20): DDP broadcasts its buffers at every forward, so ranks 1-7 wait in
        # forward, which the split counts as compute (1.6 s mean against a 1.0 s median).
        split = {k: 1e3 * statistics.median(m[k] for m in metrics[2:])
                 for k in ("compute_s", "select_s", "wait_s")}
    steps = [b["time_s"] - a["time_s"] for a, b in zip(metrics, metrics[1:])]
    median_ms = 1e3 * statistics.median(steps)
    # rank 0's evaluations stop every round (4-6 s each on a 2/9-core host, longer in DDP,
    # whose waiting ranks poll): the training time at each evaluation, those stalls taken out
    stalls, train_times = 0.0, []
    for e in evals:
        i = min(e["iter"], iters - 1)
        train_times.append(metrics[i]["time_s"] - stalls)
        if i + 1 < iters:
            stalls += max(0.0, steps[i] - statistics.median(steps))
    links = run.json("links.json")
    worker_links = [links[f"h{i}"] for i in range(1, WORKERS + 1)]
    row.update(
        code_id=run.code_id(), iterations=iters,
        # the first iteration, cold (its kernels' and buffers' first use), from the clock's
        # start: every worker connected (psparse: registered; DDP: its process group ready)
        first_iteration_ms=1e3 * metrics[0]["time_s"],
        ms_per_iteration=1e3 * summary["wall_s"] / iters, median_ms=median_ms,
        compute_ms=split["compute_s"], select_ms=split["select_s"], wait_ms=split["wait_s"],
        server_link_mb={k: links["h0"][k] / 1e6 for k in ("rx_bytes", "tx_bytes")},
        worker_link_mb={k: statistics.mean(w[k] for w in worker_links) / 1e6
                        for k in ("rx_bytes", "tx_bytes")},
        test_acc=summary["test_acc"], best_acc=max(e["test_acc"] for e in evals),
        target_acc=targets[0],
        to_target={f"{t:g}": {
            "time_to_target_s": next((e["time_s"] for e in evals if e["test_acc"] >= t), None),
            "train_time_to_target_s": next((x for x, e in zip(train_times, evals)
                                            if e["test_acc"] >= t), None)} for t in targets},
        evals=[[e["time_s"], e["test_acc"]] for e in evals])
    # psparse-model: the run's own compute (and selection) time, the scheme's bytes at the rate;
    # "link only" (the model before issue 15's check) against the model with the exchange's CPU
    # on the hosts' CPU shares and the slowest host's compute
    share = links.get("cpu_share", (os.cpu_count() or 1) / (WORKERS + 1))
    # a two-phase policy (vote) counts its proposal round trip as selection time: that is
    # exchange, which the model predicts (its bytes and server CPU are in the round's), so only
    # compute is given (the local proposal's top-k, ~3 ms, goes with it)
    local = ("compute_s",) if any(m.get("proposed") is not None for m in metrics) \
        else ("compute_s", "select_s")
    compute = sum(split[k] for k in local) / 1e3
    slowest = max(sum(r[k] for k in local) for r in others) / iters
    if config.get("baseline"):  # no per-rank iterations: rank 0's median split (above)
        slowest = compute
    s = Setting(numel=summary["numel"], k=summary["k"], workers=WORKERS, union=1.0,
                compute_s=compute)
    samples = run.jsonl("cpu-samples.jsonl")
    cpu = cpu_per_iteration(samples, iters, config.get("eval_every") or iters) \
        if samples else None
    baseline = config.get("baseline")
    if baseline == "powersgd":
        s.powersgd_entries = sum(powersgd_sizes(shapes, config["powersgd_rank"]))
        scheme = "PowerSGD"
    elif baseline in ("ddp", "fp16", "bf16"):  # DDP's own hooks: the ring in 2-byte floats
        s.ring_value_bytes = 4 if baseline == "ddp" else 2
        scheme = "dense ring allreduce"
    else:
        s.up_bytes = statistics.mean(m["upload_bytes"] for m in metrics)
        s.down_bytes = statistics.mean(m["broadcast_bytes"] for m in metrics)
        s.k = statistics.mean(m["budget"] for m in metrics)
        s.union = statistics.mean(m["broadcast_entries"] for m in metrics)
        scheme = "sparse PS"
    pred = predict(s, parse_rate(rate), wire_overhead=WIRE_OVERHEAD)
    row.update(scheme=scheme, link_only_ms=1e3 * pred[scheme],
               link_only_error=pred[scheme] / (median_ms / 1e3) - 1)
    if cpu is not None:
        s.compute_s = slowest
        s.cpu_share = share
        s.server_cpu_s = cpu["server_ms"] / 1e3
        # a worker's exchange CPU: its CPU per iteration less what its compute and selection
        # used (throttled to the share throughout, as the CPU counters show)
        s.worker_comm_cpu_s = max(0.0, cpu["worker_ms_mean"] / 1e3 - share * compute)
        # the per-step latency on the CPU shares, from the tiny-allreduce probe (--probe-steps)
        probe = RESULTS / "cluster-step-probe.json"
        step = json.loads(probe.read_text())["per_ring_step_s"] if probe.is_file() else 0.0
        pred = predict(s, parse_rate(rate), latency_s=step, wire_overhead=WIRE_OVERHEAD)
        row.update(cpu_share=share, step_latency_ms=1e3 * step, server_cpu_ms=cpu["server_ms"],
                   server_threads_ms=cpu["server_threads_ms"],
                   worker_cpu_ms=cpu["worker_ms_mean"],
                   worker_comm_cpu_ms=1e3 * s.worker_comm_cpu_s,
                   slowest_compute_ms=1e3 * slowest, predicted_ms=1e3 * pred[scheme],
                   model_error=pred[scheme] / (median_ms / 1e3) - 1)
    row.update(row["to_target"][f"{targets[0]:g}"])
    return row


def table(model: str, rows: list[dict], commit: str) -> str:
    target, second = MODELS[model]["targets"][:2]
    lines = [f"Commit `{commit}`. Wall times from the first iteration (start-up excluded); ms per "
             "iteration: mean over the run (evaluations included: rank 0's evaluation stops "
             "every round) and median iteration; the split is the mean per iteration over ranks "
             "1-7 for psparse (rank 0 also evaluates; a two-phase policy's proposal round "
             "counts as select) and rank 0's median iteration for DDP and PowerSGD (their other "
             "ranks wait for rank 0's evaluations inside forward when the model has BatchNorm; "
             "select: the comm hook's synchronous part). Link MB: what the host's eth0 "
             "received / sent over the run, headers included. CPU: CPU ms per iteration between evaluations, the PS server's and a "
             "worker's for its exchange (its CPU less its compute's). Models against the "
             "median iteration: link only (compute + bytes / rate) and with the CPU terms "
             "(psparse/analysis/costmodel.py).", ""]
    header = ["rate", "run", "first it. ms", "ms/it mean", "ms/it median", "compute", "select",
              "wait",
              "server link MB in/out", "worker link MB in/out", f"s to {100 * target:g}%",
              f"s to {100 * target:g}% net of evaluations", f"s to {100 * second:g}% net",
              "final acc %", "server CPU ms", "worker exch. CPU ms", "model link only", "error",
              "model with CPU", "error"]
    body = []
    for r in rows:
        if "failed" in r:
            body.append([r["rate"], r["run"], f"failed: {str(r['failed'])[:80]}"] + [""] * 16)
            continue
        net2 = r["to_target"][f"{second:g}"]["train_time_to_target_s"]
        to_target = [f"{r['time_to_target_s']:.1f}", f"{r['train_time_to_target_s']:.1f}"] \
            if r["time_to_target_s"] is not None else ["not reached", "not reached"]
        with_cpu = [f"{r['server_cpu_ms']:.1f}", f"{r['worker_comm_cpu_ms']:.1f}"] \
            if "model_error" in r else ["-", "-"]
        model = [f"{r['predicted_ms']:.1f}", f"{r['model_error']:+.1%}"] \
            if "model_error" in r else ["-", "-"]
        first = f"{r['first_iteration_ms']:.0f}" if "first_iteration_ms" in r else "-"
        body.append([r["rate"], r["run"], first, f"{r['ms_per_iteration']:.1f}",
                     f"{r['median_ms']:.1f}",
                     f"{r['compute_ms']:.1f}", f"{r['select_ms']:.1f}", f"{r['wait_ms']:.1f}",
                     f"{r['server_link_mb']['rx_bytes']:.1f} / "
                     f"{r['server_link_mb']['tx_bytes']:.1f}",
                     f"{r['worker_link_mb']['rx_bytes']:.1f} / "
                     f"{r['worker_link_mb']['tx_bytes']:.1f}",
                     *to_target, f"{net2:.1f}" if net2 is not None else "not reached",
                     f"{100 * r['test_acc']:.2f}", *with_cpu, f"{r['link_only_ms']:.1f}",
                     f"{r['link_only_error']:+.1%}", *model])
    return "\n".join(lines + [md_table(header, body)])


def ratios(rows: list[dict], target: float, key: str = "train_time_to_target_s") -> list[str]:
    """Per rate: time to target of psparse's best policy over DDP's and PowerSGD's best."""
    notes = []
    at = lambda r: r["to_target"][f"{target:g}"][key]  # noqa: E731
    for rate in dict.fromkeys(r["rate"] for r in rows):
        ok = [r for r in rows if r["rate"] == rate and "failed" not in r and at(r) is not None]
        best = lambda names: min((r for r in ok if r["run"] in names),  # noqa: E731
                                 key=at, default=None)
        ps, ddp = best(PSPARSE_RUNS), best(["ddp"])
        psgd = best([n for n in PEER_RUNS if n.startswith("powersgd")])
        label = (f"to {100 * target:g}%, "
                 + ("net of evaluations" if key == "train_time_to_target_s" else "wall"))
        if ps is None:
            notes.append(f"{rate} ({label}): no psparse run reached the target")
            continue
        parts = [f"{rate} ({label}): best psparse `{ps['run']}` {at(ps):.1f} s"]
        for name, ref in (("DDP", ddp), ("PowerSGD", psgd)):
            parts.append(f"/ {name} ({ref['run']}, {at(ref):.1f} s) = {at(ps) / at(ref):.2f}"
                         if ref else f"/ {name}: target not reached")
        notes.append(" ".join(parts))
    return notes


def seed_summary(model: str, by_seed: dict[tuple[str, str], list[dict]]) -> str:
    """Runs made with several seeds: mean ± sample SD of the median iteration, the time to
    each target net of evaluations, the final accuracy; and, per seed, the time to target of
    each psparse run over DDP's and PowerSGD's with the same seed."""
    multi = {key: [r for r in rows if "failed" not in r] for key, rows in by_seed.items()
             if len(rows) > 1}
    if not multi:
        return ""
    targets = MODELS[model]["targets"]
    net = lambda r, t: r["to_target"][f"{t:g}"]["train_time_to_target_s"]  # noqa: E731
    body = []
    for (rate, name), rows in multi.items():
        cells = [rate, name, mean_sd([r["median_ms"] for r in rows], ".1f", count=True)]
        for t in targets:
            got = [net(r, t) for r in rows if net(r, t) is not None]
            cells.append(mean_sd(got, ".1f", count=True) + (
                f", {len(rows) - len(got)} not reached" if len(got) < len(rows) else ""))
        cells.append(mean_sd([100 * r["test_acc"] for r in rows], ".2f", count=True))
        body.append(cells)
    lines = ["", "Over seeds (mean ± sample SD (runs)); times to target net of evaluations, "
             "over the runs that reached it:", "",
             md_table(["rate", "run", "ms/it median", *(f"s to {100 * t:g}%" for t in targets),
                       "final acc %"], body),
             "", "Time to target, psparse run ÷ peer, per seed (same seed), mean ± sample SD:",
              ""]
    for t in targets:
        for rate in dict.fromkeys(rate for rate, _ in multi):
            for name in PSPARSE_RUNS:
                for peer in ("ddp", "powersgd-r1", "powersgd-r4"):
                    mine, theirs = multi.get((rate, name), []), multi.get((rate, peer), [])
                    peer_of = {r["seed"]: r for r in theirs}
                    q = [net(r, t) / net(peer_of[r["seed"]], t) for r in mine
                         if r["seed"] in peer_of and net(r, t) is not None
                         and net(peer_of[r["seed"]], t) is not None]
                    if len(q) > 1:
                        lines.append(f"- {rate}, to {100 * t:g}%: `{name}` ÷ `{peer}` = "
                                     f"{mean_sd(q, '.2f', count=True)}")
    return "\n".join(lines) + "\n"


def figure(model: str, rate: str, rows: list[dict]) -> Path:
    """Test accuracy against wall time, every run at one rate (the peers dashed)."""
    fig, ax = pyplot().subplots(figsize=(6.4, 4.2))
    for i, r in enumerate(x for x in rows if x["rate"] == rate and "failed" not in x):
        t, acc = zip(*r["evals"])
        ax.plot(t, [100 * a for a in acc], marker="o", ms=3, color=f"C{i}",
                ls="--" if r["run"] in PEER_RUNS else "-", label=r["run"])
    for t in MODELS[model]["targets"]:
        ax.axhline(100 * t, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("wall time since the first iteration (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"{model}, 8 workers, every host link {rate} (tbf)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save(fig, RESULTS / f"cluster-{model}-{rate}.png")


def report(model: str) -> str | None:
    """Every finished run of ``model`` in runs/cluster measured: the table (seed 0's runs),
    ratios and model errors, the summary over seeds of runs made with several, the figures;
    written to experiments/results and printed. None when no run is there."""
    _, shapes = numel_and_shapes(model)
    rows, by_seed = [], {}
    for rate in MODELS[model]["rates"]:
        for name in RUNS:
            for seed in range(10):
                out = run_dir(model, rate, name, seed)
                if (out / "links.json").is_file():
                    row = measure(out, name, rate, MODELS[model]["targets"], shapes)
                    row["seed"] = seed
                    by_seed.setdefault((rate, name), []).append(row)
                    if seed == 0:
                        rows.append(row)
    if not rows:
        return None
    RESULTS.mkdir(parents=True, exist_ok=True)
    commits = sorted({r.get("code_id") or "?" for r in rows if "failed" not in r})
    text = table(model, rows, ", ".join(commits))
    notes = [n for t in MODELS[model]["targets"]
             for n in ratios(rows, t) + ratios(rows, t, "time_to_target_s")]
    for key, label in (("link_only_error", "link only"), ("model_error", "with CPU")):
        errs = [r for r in rows if key in r]
        if errs:
            worst = max(errs, key=lambda r: abs(r[key]))
            notes.append(f"largest model error ({label}): {worst[key]:+.1%} "
                         f"({worst['rate']} {worst['run']})")
    text += "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    text += seed_summary(model, by_seed)
    (RESULTS / f"cluster-{model}.md").write_text(text)
    (RESULTS / f"cluster-{model}.json").write_text(json.dumps(rows, indent=1))
    print(text)
    for rate in dict.fromkeys(r["rate"] for r in rows):
        print(f"wrote {figure(model, rate, rows)}")
    return text
