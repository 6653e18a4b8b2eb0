"""Check psparse-model against measured runs: predicted vs measured time per iteration.

    python -m experiments.run cost-model && python -m experiments.model_check

For each policy, the unpaced run gives the compute time and bytes per iteration; the model then
predicts the paced runs (--bandwidth), whose measured median time per iteration is compared.
Writes experiments/results/cost-model-check.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

from psparse.analysis.costmodel import predict, setting_from_run
from psparse.wire.transport import parse_rate

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    runs = ROOT / "runs" / "cost-model"
    lines = ["| policy | bandwidth | union/k | predicted ms/it | measured ms/it | error | "
             "dense ring (model) ms/it | allgather (model) ms/it |", "|---|---|---|---|---|---|---|---|"]
    worst = 0.0
    for policy in ("topk", "core"):
        base, _ = setting_from_run(runs / f"{policy}-s0")
        for rate in ("100Mbit", "1Gbit", "30Mbit"):
            run = runs / f"{policy}-{rate}-s0"
            if not run.is_dir():
                continue
            _, info = setting_from_run(run)
            pred = predict(base, parse_rate(rate))
            err = pred["sparse PS"] / info["measured_s"] - 1
            worst = max(worst, abs(err))
            lines.append(f"| {policy} | {rate} | {base.union / base.k:.2f} | "
                         f"{pred['sparse PS'] * 1e3:.1f} | {info['measured_s'] * 1e3:.1f} | "
                         f"{err:+.1%} | {pred['dense ring allreduce'] * 1e3:.1f} | "
                         f"{pred['sparse allgather'] * 1e3:.1f} |")
        lines.append(f"| {policy} | none | {base.union / base.k:.2f} | - | "
                     f"{base.compute_s * 1e3:.1f} | - | - | - |")
    text = "\n".join(lines) + f"\n\nlargest error: {worst:.1%}\n"
    (ROOT / "experiments" / "results" / "cost-model-check.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
