"""examples/open_ended.py under every CPU float-kernel set this machine offers: the test's
arguments on 3 seeds, and a user's defaults, each with oneDNN capped at each ISA.

    python -m experiments.open_ended_isa                 # the test's arguments, 3 seeds x ISAs
    python -m experiments.open_ended_isa --user          # also the docstring's 4-worker defaults
    python -m experiments.open_ended_isa --isas default,AVX2 --seeds 0

Why: bf16 autocast takes other oneDNN kernels on CPUs with AMX / AVX512-BF16 than on older
ones, so a run's accuracy curve, and with it an early-stopping point, moves with the CPU
(issue 36). ``ONEDNN_MAX_CPU_ISA`` caps the kernels oneDNN may pick, so one machine can play
the older CPUs too; it cannot play a newer one (a cap above the machine's ISA is the machine's
ISA). The ISA each setting ran with is read from oneDNN's own verbose line. Runs land in
runs/open-ended-isa/, the table in experiments/results/open-ended-isa.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from experiments.harness import RESULTS, ROOT, md_table
from psparse.provenance import float_kernels, provenance

EXAMPLE = ROOT / "examples" / "open_ended.py"
# The arguments tests/test_examples.py runs the example with: 2 workers on 2,000 images, a
# OneCycle schedule of 4 epochs (124 steps), evaluated every 5 steps on 500 test images.
TEST_POLICY = ("--density", "0.1", "--policy", "vote", "--policy-arg", "keep=1.5")
TEST_ARGS = ("--train-samples", "2000", "--epochs", "4", "--max-lr", "0.05",
             "--eval-every", "5", "--eval-samples", "500", "--patience", "2",
             "--min-delta", "0.02")
TEST_STEPS = 124  # the schedule's length at TEST_ARGS with 2 workers (31 steps an epoch)
# The floor the test asserts on the stopped run's full-test-set accuracy (chance: 10%).
TEST_FLOOR = 0.5
# A user's run, as the example's docstring gives it (its own defaults).
USER_POLICY = ("--policy", "vote", "--policy-arg", "keep=1.5")
ISAS = ("default", "AVX512_CORE", "AVX2")


def isa_env(isa: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    if isa != "default":
        env["ONEDNN_MAX_CPU_ISA"] = isa
    return env


def kernels_in_use(isa: str) -> str:
    kernels = float_kernels(isa_env(isa))
    return f"oneDNN: {kernels['onednn_isa']}; torch capability {kernels['torch_capability']}"


def launch(out, workers: int, policy, args, isa: str) -> dict:
    cmd = [sys.executable, "-m", "psparse.launch", "--workers", str(workers), "--quiet",
           "--out", str(out), "--overwrite", *policy, str(EXAMPLE), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=isa_env(isa), timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout}{r.stderr}")
    summary = json.loads((out / "summary.json").read_text())
    return {"ended": summary["ended"], "iterations": summary["iterations"],
            "test_acc": summary["test_acc"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isas", default=",".join(ISAS),
                   help="ONEDNN_MAX_CPU_ISA settings, 'default' for none (default: %(default)s)")
    p.add_argument("--seeds", default="0,1,2", help="seeds at the test's arguments")
    p.add_argument("--user", action="store_true",
                   help="also the user's run: 4 workers, the example's defaults, seed 0")
    p.add_argument("--out", default=str(ROOT / "runs" / "open-ended-isa"))
    args = p.parse_args(argv)
    isas, seeds = args.isas.split(","), [int(s) for s in args.seeds.split(",")]
    rows = []
    for isa in isas:
        kernels = kernels_in_use(isa)
        print(f"[{isa}] {kernels}", flush=True)
        cases = [("test", 2, TEST_POLICY, TEST_ARGS, s) for s in seeds]
        if args.user:
            cases.append(("user", 4, USER_POLICY, (), 0))
        for form, workers, policy, run_args, seed in cases:
            out = ROOT / args.out / f"{form}-{isa}-s{seed}"
            result = launch(out, workers, policy, (*run_args, "--seed", str(seed)), isa)
            rows.append({"form": form, "isa": isa, "kernels": kernels, "seed": seed, **result})
            print(f"  {form} seed {seed}: {result['ended']}, test accuracy "
                  f"{result['test_acc']:.4f}", flush=True)
    commit = provenance()["code_id"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "open-ended-isa.json").write_text(json.dumps({"commit": commit, "runs": rows},
                                                            indent=1) + "\n")
    table = md_table(["form", "ONEDNN_MAX_CPU_ISA", "kernels (oneDNN's verbose line)", "seed",
                      "ended", "iterations", "test accuracy"],
                     [[r["form"], r["isa"], r["kernels"], r["seed"], r["ended"], r["iterations"],
                       f"{100 * r['test_acc']:.2f}%"] for r in rows])
    (RESULTS / "open-ended-isa.md").write_text(f"{table}\n\nMade by {commit}.\n")
    print(table)
    test_runs = [r for r in rows if r["form"] == "test"]
    early = all(r["iterations"] < TEST_STEPS for r in test_runs)
    floor = min(r["test_acc"] for r in test_runs)
    print(f"test form: every run stopped early: {early}; lowest accuracy {floor:.4f} "
          f"(the test's floor {TEST_FLOOR})")
    return 0 if early and floor > TEST_FLOOR else 1


if __name__ == "__main__":
    sys.exit(main())
