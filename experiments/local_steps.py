"""Issue 55: psparse's local steps against DiLoCo and local SGD, time to 98% on LeNet-5/MNIST
and to 85% (and 80%) on ResNet-20/CIFAR-10.

    python -m experiments.local_steps                              # every stage, in order
    python -m experiments.local_steps --stage accuracy --seeds 0   # this machine, ~3 min a run
    python -m experiments.local_steps --model resnet20 --stage accuracy   # ~40 min a run (bf16)
    python -m experiments.local_steps --stage timing --rates 25mbit,5mbit   # emulated cluster
    python -m experiments.local_steps --stage report   # local-steps.json from the runs, then page
    python -m experiments.local_steps --stage page     # local-steps.md and figures from the JSON
    python -m experiments.local_steps --stage torchft  # the peer against torchft's (make torchft)

Composed as experiments/time_to_accuracy.py composes (the same run folders, arguments and
functions): synchronisations to the target, from full-length runs on this machine (as many
training steps as the per-step runs: 1,000), times the emulated cluster's steady time per
synchronisation (H local steps and one exchange). The comparison is made on one machine and
float-kernel set: DDP, its bf16 hook and psparse's per-step ``core`` are run here again beside
the local-steps runs (time-to-accuracy.md's recorded runs came from other kernels).

The runs (experiments/cluster_sweep.py): ``local{H}-core-int4`` (psparse: core at 1%, int4
values, the outer step local SGD's; ``-d10``: at 10% density), ``diloco-h{H}`` / ``-bf16`` (DiLoCo over allreduce with
its defaults, outer lr 0.7 and Nesterov 0.9; the pseudo-gradient in bf16) and
``localsgd-h{H}`` (parameter averaging), H in {4, 16, 64}: DiLoCo's H chosen on seed 0.

The peers run over torch.distributed in psparse's loop (``--baseline ddp --local-steps H``),
where the emulated cluster times them like DDP. That they are DiLoCo and local SGD as PyTorch's
``torchft`` 0.2.0 computes them is the ``torchft`` stage: both trainings, two workers, the same
shards and seed, evaluation by evaluation (experiments/diloco_peer.py runs torchft's; its
quantisation needs triton and a GPU, see there).

ResNet-20 (``--model resnet20``): time_to_accuracy's ResNet-20 arguments (30 epochs of 8 x 32
images, bf16 autocast, cosine schedule; a CPU with AVX512-BF16 or AMX, ~40 minutes a run on 2
cores) and targets. Its grid is H = 16 only (LeNet's and the transformer's best H): psparse's
every-entry int4 local steps, local SGD and DiLoCo at H 16, and the ResNet-20 grid's recorded
DDP and per-step ``vote2-int4`` (time_to_accuracy's, made on another machine's float kernels:
the page names each run's machine); timed at 25 and 5 Mbit/s, the issue's goal rates.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from experiments import time_to_accuracy as tta
from experiments.cluster_sweep import PEER_RUNS, local_steps_of
from experiments.figures import pyplot, save
from experiments.harness import RESULTS, ROOT, md_table, mean_sd
from psparse.provenance import float_kernels, provenance
from psparse.training.loop import native_bf16

MODEL, TARGET = "lenet", 0.98
RUNS = ["ddp", "ddp-bf16", "core", "local4-core-int4", "local16-core-int4", "local64-core-int4",
        "local16-core-d10-int4", "local64-core-d10-int4", "local16-dense-int4", "diloco-h4", "diloco-h16",
        "diloco-h64", "diloco-h16-bf16", "localsgd-h4", "localsgd-h16", "localsgd-h64"]
RATES = ["25mbit", "5mbit", "80mbit"]
JSON, PAGE = "local-steps.json", "local-steps.md"
# per model: the targets (the first is the headline's), the grid's runs and link rates, files
MODELS = {
    "lenet": {"targets": [TARGET], "runs": RUNS, "rates": RATES, "json": JSON, "page": PAGE,
              "length": "1,000 steps", "name": "LeNet-5/MNIST", "ylim": (90, 100)},
    "resnet20": {"targets": [0.85, 0.8], "rates": ["25mbit", "5mbit"],
                 "runs": ["ddp", "vote2-int4", "local16-dense-int4", "localsgd-h16", "diloco-h16"],
                 "json": "local-steps-resnet20.json", "page": "local-steps-resnet20.md",
                 "length": "30 epochs (5,850 steps, 5,856 at H 16)", "name": "ResNet-20/CIFAR-10", "ylim": (40, 90)},
}
TORCHFT_CHECK = "local-steps-torchft.json"
TORCHFT_TIMING = "local-steps-torchft-timing.json"  # experiments/torchft_cluster.py
# the cross-check's trainings: 2 workers, H 16, 320 steps of SGD (lr 0.05, momentum 0.9)
CHECK = {"workers": 2, "sync_every": 16, "steps": 320, "eval_every": 32}


def collect(names: list[str], rates: list[str], model: str = MODEL) -> dict:
    """What the page needs, from the run folders: each accuracy run's evaluations and
    synchronisations to the targets, and each cluster run's steady time per synchronisation. A
    run whose folder is gone (made on another machine's disk) keeps what the model's JSON
    recorded of it."""
    spec = MODELS[model]
    path = RESULTS / spec["json"]
    recorded = json.loads(path.read_text()) if path.is_file() else {"runs": [], "timing": {}}
    runs = []
    for name in names:
        for seed in range(3):
            rec = tta.accuracy_record(model, name, seed)
            if rec is None:
                runs += [r for r in recorded["runs"] if r["run"] == name and r["seed"] == seed]
                continue
            runs.append({"run": name, "seed": seed, "code": rec["code"],
                         "machine": run_machine(model, name, seed),
                         "local_steps": local_steps_of(name),
                         "syncs_to_target": rec["to"][f"{spec['targets'][0]:g}"],
                         "syncs_to": {t: rec["to"][f"{t:g}"] for t in spec["targets"]},
                         "final_acc": rec["final_acc"], "best_acc": rec["best_acc"],
                         "evals": [[e["iter"], e["test_acc"]] for e in rec["evals"]]})
    timing = {}
    for rate in dict.fromkeys([*recorded["timing"], *rates]):  # recorded rates, then new ones
        steady, rows = tta.timings(model, rate)
        timing[rate] = {n: t for n, t in recorded["timing"].get(rate, {}).items() if n in names}
        timing[rate].update({n: {"steady_ms": steady[n], "compute_ms": rows[n]["compute_ms"],
                                 "wait_ms": rows[n]["wait_ms"], "code": rows[n].get("code_id"),
                                 "syncs_timed": rows[n]["iterations"]}
                             for n in names if n in steady})
        if not timing[rate]:
            del timing[rate]  # not timed at this rate
    return {"model": model, "target": spec["targets"][0], "targets": spec["targets"],
            "machine": tta.this_machine(), "float_kernels": float_kernels(),
            "report_commit": provenance()["code_id"], "runs": runs, "timing": timing}


def run_machine(model: str, name: str, seed: int) -> str:
    """The machine an accuracy run was made on: this one for a run under runs/tta/, else its
    record's (time_to_accuracy's ``record`` stage keeps it)."""
    if tta.accuracy_record_at(tta.accuracy_dir(model, name, seed), name, seed, model):
        return tta.this_machine()
    machine = tta.recorded_dir(model, name, seed) / "machine.json"
    if not machine.is_file():
        return "not recorded"
    m = json.loads(machine.read_text())
    isa = m["float_kernels"].get("onednn_isa", "?")
    if m["cpu"] == tta.this_machine() and isa == float_kernels().get("onednn_isa"):
        return tta.this_machine()  # recorded here: the page's own machine, not "another"
    return f"{m['cpu']} (oneDNN: {isa})"


def syncs_to(run: dict, target: float, data: dict) -> int | None:
    """A run's synchronisations to ``target`` (runs recorded before several targets were kept
    have the headline target's alone)."""
    if "syncs_to" in run:
        return run["syncs_to"].get(f"{target:g}", run["syncs_to"].get(target))
    return run["syncs_to_target"] if target == data["target"] else None


def compose(data: dict, target: float | None = None) -> list[dict]:
    """Per (rate, run): composed seconds to ``target`` (default the headline one) per seed, and
    the ratios the issue asks for: against DDP, against the best DiLoCo / local SGD run,
    against the best peer."""
    target = data["target"] if target is None else target
    out = []
    for rate, timed in data["timing"].items():
        seconds = {}
        for r in data["runs"]:
            n = syncs_to(r, target, data)
            if r["run"] in timed and n is not None:
                seconds.setdefault(r["run"], {})[r["seed"]] = n * timed[r["run"]]["steady_ms"] / 1e3
        mean = {n: float(np.mean(list(s.values()))) for n, s in seconds.items()}
        peers = [n for n in mean if n in PEER_RUNS]
        local_peers = [n for n in peers if local_steps_of(n) > 1]
        best_peer = min(peers, key=mean.get, default=None)
        best_local_peer = min(local_peers, key=mean.get, default=None)
        best_psparse = min((n for n in mean if n not in PEER_RUNS), key=mean.get, default=None)

        def ratio(name, other):
            common = [s for s in seconds[name] if other and s in seconds.get(other, {})]
            return [seconds[name][s] / seconds[other][s] for s in common]
        for name in seconds:
            runs = [r for r in data["runs"] if r["run"] == name]
            syncs = [syncs_to(r, target, data) for r in runs]
            out.append({
                "rate": rate, "target": target, "run": name, "peer": name in PEER_RUNS,
                "local_steps": local_steps_of(name), "syncs_to_target": syncs,
                "steps_to_target": [None if n is None else n * r["local_steps"]
                                    for n, r in zip(syncs, runs)],
                "final_acc": [r["final_acc"] for r in runs],
                "steady_ms_per_sync": timed[name]["steady_ms"],
                "compute_ms_per_step": timed[name]["compute_ms"] / local_steps_of(name),
                "composed_s": seconds[name], "vs_ddp": ratio(name, "ddp"),
                "vs_best_diloco": ratio(name, best_local_peer), "best_diloco": best_local_peer,
                "vs_best_peer": ratio(name, best_peer), "best_peer": best_peer,
                "best_psparse_run": name == best_psparse})
    return out


def page(data: dict) -> str:
    spec, targets = MODELS[data["model"]], data.get("targets", [data["target"]])
    commits = sorted({r["code"] for r in data["runs"]} |
                     {t["code"] or "?" for rate in data["timing"].values() for t in rate.values()})
    lines = [f"Made by `{data['report_commit']}` from `{spec['json']}`; runs made by "
             f"{', '.join(f'`{c[:12]}`' for c in commits)} on {data['machine']} "
             f"({data['float_kernels']['torch_capability']} float kernels). {spec['name']}, 8 "
             f"workers, to {' and '.join(f'{100 * t:g}%' for t in targets)} test accuracy "
             "(whole test set); composed "
             "time = synchronisations to the target x the emulated cluster's steady "
             "synchronisation (8 worker hosts and the server, each a CPU share; section 6.1's "
             "method). Baseline: DDP's time (vs DDP), the best DiLoCo or local SGD run (vs "
             "DiLoCo).", ""]
    elsewhere = {f"{r['run']} seed {r['seed']}": r["machine"] for r in data["runs"]
                 if r.get("machine", data["machine"]) != data["machine"]}
    if elsewhere:  # accuracy runs recorded on another machine: other float kernels
        lines += ["Accuracy runs made on another machine (their iterations to a target come "
                  "from other float kernels; the timing is this machine's): " +
                  "; ".join(f"{k}: {v}" for k, v in elsewhere.items()) + ".", ""]
    for rate, target in ((rate, t) for rate in data["timing"] for t in targets):
        body = []
        for r in (x for x in compose(data, target) if x["rate"] == rate):
            syncs = ", ".join("-" if s is None else str(s) for s in r["syncs_to_target"])
            body.append([r["run"] + (" (peer)" if r["peer"] else ""), r["local_steps"], syncs,
                         ", ".join("-" if s is None else str(s) for s in r["steps_to_target"]),
                         ", ".join(f"{100 * a:.2f}" for a in r["final_acc"]),
                         f"{r['steady_ms_per_sync']:.1f}", f"{r['compute_ms_per_step']:.1f}",
                         mean_sd(r["composed_s"].values(), ".1f"), mean_sd(r["vs_ddp"]),
                         mean_sd(r["vs_best_diloco"])])
        heading = rate if len(targets) == 1 else f"{rate}, to {100 * target:g}%"
        lines += [f"### {heading}", "", md_table(
            ["run", "H", "syncs to target", "steps to target", "final acc %", "ms per sync",
             "compute ms per step", "composed s", "vs DDP", "vs best DiLoCo/local SGD"], body), "",
            *what_decides([x for x in compose(data, target) if x["rate"] == rate])]
    for target in targets:
        missed = [r for r in data["runs"] if syncs_to(r, target, data) is None]
        if missed:
            lines += [f"Not at {100 * target:g}% within the runs' {spec['length']}: " +
                      ", ".join(f"{r['run']} seed {r['seed']} (best {100 * r['best_acc']:.2f}%, "
                                f"final {100 * r['final_acc']:.2f}%)" for r in missed) + ".", ""]
    if data["model"] != MODEL:  # the torchft check and timing are LeNet's
        return "\n".join(lines)
    check = RESULTS / TORCHFT_CHECK
    if check.is_file():
        c = json.loads(check.read_text())
        lines += ["### The peers against torchft", "",
                  f"torchft's `DiLoCo` and `LocalSGD` (experiments/diloco_peer.py) and psparse's "
                  f"`--baseline ddp --local-steps` with the same options ({c['options']}; SGD lr "
                  "0.05, momentum 0.9; DiLoCo's outer lr 0.7, Nesterov 0.9), test accuracy at "
                  "each evaluation (step: %):", ""]
        body = [[alg, ", ".join(f"{s}: {100 * a:.2f}" for s, a in v["torchft"]),
                 ", ".join(f"{100 * a:.2f}" for _, a in v["psparse_peer"]),
                 f"{v['identical_evaluations']} of {len(v['torchft'])}"]
                for alg, v in c["algorithms"].items()]
        lines += [md_table(["algorithm", "torchft", "psparse's peer", "identical"], body), ""]
    return "\n".join(lines + torchft_timing(data))


GOAL = {"vs_best_diloco": 0.8, "vs_ddp": 0.5}  # the issue's: psparse's best against each


def what_decides(rows: list[dict]) -> list[str]:
    """One line under a section's table: psparse's fastest run against the best DiLoCo / local
    SGD run and against DDP, its composed-time ratio split into training steps to the target
    (paired by seed, as the ratio is) times time per step, and, where the goal is missed, which
    factor misses it: the steps if its time per step alone would meet the goal, the time per
    step if its steps alone would, else neither alone would."""
    ours = next((r for r in rows if r["best_psparse_run"]), None)
    if ours is None:
        return []
    by_name = {r["run"]: r for r in rows}
    parts = []
    for key, other in (("vs_best_diloco", ours["best_diloco"]), ("vs_ddp", "ddp")):
        theirs = by_name.get(other)
        if theirs is None or not ours[key]:  # not timed, or no seed reached it in both
            continue
        per_step = (ours["steady_ms_per_sync"] / ours["local_steps"]
                    / (theirs["steady_ms_per_sync"] / theirs["local_steps"]))
        # each seed's ratio is its steps' ratio x the one time per step's: so is their mean
        ratio, goal = float(np.mean(ours[key])), GOAL[key]
        steps = ratio / per_step
        verdict = ("meets the goal" if ratio <= goal else "misses it: " + (
            "steps decide" if per_step <= goal else "time per step decides" if steps <= goal
            else "neither alone would meet it"))
        parts.append(f"against `{other}` {ratio:.2f}× (goal ≤ {goal}×) = {steps:.2f}× the "
                     f"steps × {per_step:.2f}× the time per step, {verdict}")
    return [f"psparse's fastest, `{ours['run']}`: " + "; ".join(parts) + ".", ""] if parts else []


def torchft_timing(data: dict) -> list[str]:
    """The page's section on torchft timed on the cluster (experiments/torchft_cluster.py):
    its steady synchronisation beside psparse's peer of the same algorithm, and local SGD's
    time to the target at torchft's synchronisation (the peer's synchronisations to it)."""
    path = RESULTS / TORCHFT_TIMING
    if not path.is_file():
        return []
    t = json.loads(path.read_text())
    rows = {(r["rate"], r["run"]): r for r in compose(data)}
    body = []
    for rate, algorithms in t["timing"].items():
        best = next((r for (rt, _), r in rows.items() if rt == rate and r["best_psparse_run"]),
                    None)
        for algorithm, timing in algorithms.items():
            peer = t["psparse_peer"][algorithm]
            ours = data["timing"].get(rate, {}).get(peer)
            composed = {r["seed"]: r["syncs_to_target"] * timing["steady_ms"] / 1e3
                        for r in data["runs"]
                        if r["run"] == peer and r["syncs_to_target"] is not None}
            vs = [best["composed_s"][s] / composed[s] for s in composed
                  if best and s in best["composed_s"]]
            body.append([rate, f"torchft {algorithm}", f"{timing['steady_ms']:.1f}",
                         f"{ours['steady_ms']:.1f} ({peer})" if ours else "-",
                         f"{timing['steady_ms'] / ours['steady_ms']:.2f}" if ours else "-",
                         mean_sd(composed.values(), ".1f") if composed else "not reached",
                         f"{mean_sd(vs)} ({best['run']})" if vs else "-"])
    return ["### torchft timed on the emulated cluster", "",
            f"torchft 0.2.0's own `DiLoCo` and `LocalSGD` on the same hosts and links "
            f"(experiments/torchft_cluster.py: {t['workload']}; the lighthouse on h0, one "
            f"replica group per worker host; made by `{_code(t)}` on {t['machine']}): the mean "
            "synchronisation (H local steps, a quorum, the allreduce, a commit) after the first "
            "three, against psparse's peer of the algorithm timed as above. Composed: the "
            "peer's synchronisations to the target (the same arithmetic, the check above) times "
            "torchft's synchronisation; vs: psparse's best configuration's composed time over "
            "it, paired by seed.", "",
            md_table(["rate", "run", "ms per sync", "psparse's peer, ms per sync",
                      "torchft / peer", "composed s", "psparse's best / it"], body), ""]


def _code(timing: dict) -> str:
    codes = sorted({a["code"][:12] for r in timing["timing"].values() for a in r.values()})
    return "`, `".join(codes)


def figure(data: dict, rate: str):
    """Test accuracy against composed time (seed 0) at one rate, DiLoCo and DDP dashed."""
    spec = MODELS[data["model"]]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    timed = data["timing"][rate]
    shown = [r for r in data["runs"] if r["seed"] == 0 and r["run"] in timed]
    for i, r in enumerate(shown):
        ms = timed[r["run"]]["steady_ms"]
        ax.plot([(it + 1) * ms / 1e3 for it, _ in r["evals"]], [100 * a for _, a in r["evals"]],
                label=r["run"], ls="--" if r["run"] in PEER_RUNS else "-",
                color=plt.cm.tab20(i % 20))
    fastest = min((r["syncs_to_target"] * timed[r["run"]]["steady_ms"] / 1e3 for r in shown
                   if r["syncs_to_target"]), default=None)
    if fastest:  # the race to the target; DDP's long tail is in the table
        ax.set_xlim(0, 4 * fastest)
    for target in data.get("targets", [data["target"]]):
        ax.axhline(100 * target, color="grey", lw=0.5)
    ax.set_ylim(*spec["ylim"])
    ax.set_xlabel(f"composed time, s (synchronisations x the {rate} cluster's steady one)")
    ax.set_ylabel("test accuracy, %")
    ax.set_title(f"{spec['name']}, 8 workers, {rate}: local steps, DiLoCo, DDP (seed 0)")
    ax.legend(fontsize=7)
    stem = "local-steps" if data["model"] == MODEL else f"local-steps-{data['model']}"
    return save(fig, RESULTS / f"{stem}-{rate}.png")


def write(data: dict) -> None:
    """The model's JSON and page, the figures, and the rows of time-to-accuracy.json (replacing
    this comparison's earlier rows of the model there; the other rows stay)."""
    spec = MODELS[data["model"]]
    (RESULTS / spec["json"]).write_text(json.dumps(data, indent=1) + "\n")
    (RESULTS / spec["page"]).write_text(page(data) + "\n")
    for rate in data["timing"]:
        figure(data, rate)
    tta_json = RESULTS / "time-to-accuracy.json"
    kept = [r for r in json.loads(tta_json.read_text())
            if r.get("comparison") != "local-steps" or r.get("model", MODEL) != data["model"]]
    new = [{"comparison": "local-steps", "model": data["model"], "target": t, **r,
            "composed_s": list(r["composed_s"].values()), "report_commit": data["report_commit"]}
           for t in data.get("targets", [data["target"]]) for r in compose(data, t)]
    tta_json.write_text(json.dumps(kept + new, indent=1))


def torchft_check(site: str, runs_dir) -> dict:
    """torchft's DiLoCo and LocalSGD (experiments/diloco_peer.py, torchft from ``site``)
    beside psparse's allreduce peer with the same options: their evaluations side by side."""
    out = {"torchft_site": site, "options": CHECK, "algorithms": {}}
    for algorithm, outer in (("diloco", []), ("localsgd", ["--outer-lr", "1",
                                                           "--outer-momentum", "0"])):
        tf_dir, ps_dir = runs_dir / f"torchft-{algorithm}", runs_dir / f"psparse-{algorithm}"
        for d in (tf_dir, ps_dir):
            subprocess.run(["rm", "-rf", str(d)], check=True)
        env = {**os.environ, "PYTHONPATH": f"{site}:{ROOT}"}
        subprocess.run([sys.executable, str(ROOT / "experiments" / "diloco_peer.py"),
                        "--algorithm", algorithm, "--optimizer", "sgd", "--lr", "0.05",
                        "--workers", str(CHECK["workers"]), "--sync-every",
                        str(CHECK["sync_every"]), "--steps", str(CHECK["steps"]),
                        "--eval-every", str(CHECK["eval_every"]), "--out", str(tf_dir)],
                       check=True, env=env, cwd=ROOT)
        subprocess.run([sys.executable, "-m", "psparse.launch", "--out", str(ps_dir), "--quiet",
                        "--baseline", "ddp", "--density", "1", "--workers",
                        str(CHECK["workers"]), "--model", "lenet", "--dataset", "mnist",
                        "--local-steps", str(CHECK["sync_every"]), "--iterations",
                        str(CHECK["steps"] // CHECK["sync_every"]), "--eval-every",
                        str(CHECK["eval_every"] // CHECK["sync_every"]), "--lr", "0.05",
                        "--threads", "1", *outer], check=True, cwd=ROOT)
        tf = [[e["step"], e["test_acc"]] for e in map(json.loads, (tf_dir / "eval.jsonl")
                                                      .read_text().splitlines()) if e["step"]]
        ps = [[(e["iter"] + 1) * CHECK["sync_every"], e["test_acc"]] for e in map(
            json.loads, (ps_dir / "eval.jsonl").read_text().splitlines())]
        tf_summary = json.loads((tf_dir / "summary.json").read_text())
        out["algorithms"][algorithm] = {
            "torchft": tf, "psparse_peer": ps, "torchft_version": tf_summary.get("torchft_version"),
            "identical_evaluations": sum(a == b for a, b in zip(tf, ps))}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.local_steps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", default="accuracy,timing,report",
                   help="comma-separated: accuracy, timing, report (collect from the runs, "
                        "then the page), page (the page from local-steps.json alone), torchft "
                        "(the peer against torchft's DiLoCo and LocalSGD; torchft from "
                        "$PSPARSE_TORCHFT, default .torchft/: make torchft; LeNet's)")
    p.add_argument("--model", default=MODEL, choices=sorted(MODELS),
                   help="lenet (LeNet-5/MNIST to 98%%) or resnet20 (ResNet-20/CIFAR-10 to 85%% "
                        "and 80%%; its accuracy runs need a CPU with AVX512-BF16 or AMX)")
    p.add_argument("--runs", default=None, help="runs (default: the model's comparison)")
    p.add_argument("--seeds", default="0", help="accuracy stage seeds (default 0)")
    p.add_argument("--rates", default=None,
                   help="timing stage link rates (default LeNet 25mbit,5mbit,80mbit; "
                        "ResNet-20 25mbit,5mbit)")
    p.add_argument("--data-dir", default=None, help="passed to psparse-launch")
    args = p.parse_args(argv)
    spec, model = MODELS[args.model], args.model
    stages = args.stage.split(",")
    names = args.runs.split(",") if args.runs else spec["runs"]
    rates = args.rates.split(",") if args.rates else spec["rates"]
    why = "accuracy" in stages and tta.bf16_refusal([model], native_bf16())
    if why:
        print(f"[local-steps] {why}", file=sys.stderr)
        return 2
    if "accuracy" in stages:
        for seed in (int(s) for s in args.seeds.split(",")):
            for name in names:
                if tta.recorded_dir(model, name, seed).is_dir():  # e.g. the ResNet-20 grid's
                    print(f"[local-steps] {name} seed {seed}: recorded under "
                          f"{tta.recorded_dir(model, name, seed).relative_to(ROOT)}, not rerun")
                    continue
                tta.launch_local(tta.accuracy_dir(model, name, seed),
                                 tta.accuracy_args(model, name), seed, args.data_dir)
    if "timing" in stages:
        from experiments.cluster import emulated_cluster, run_one
        code_id = provenance()["code_id"]
        for rate in rates:
            with emulated_cluster(rate) as hosts:
                for name in names:
                    run_one(model, rate, name, hosts, code_id, False, args.data_dir,
                            base=tta.cluster_args(model), run_args=tta.timing_args(model, name))
    if "report" in stages:
        write(collect(names, rates, model))
    if "page" in stages:
        write(json.loads((RESULTS / spec["json"]).read_text()))
    if "torchft" in stages:
        site = os.environ.get("PSPARSE_TORCHFT", str(ROOT / ".torchft"))
        check = torchft_check(site, ROOT / "runs" / "local-steps")
        (RESULTS / TORCHFT_CHECK).write_text(json.dumps(check, indent=1) + "\n")
        print(json.dumps(check, indent=1))
    page_path = RESULTS / spec["page"]
    print(page_path.read_text() if page_path.is_file() else "no page yet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
