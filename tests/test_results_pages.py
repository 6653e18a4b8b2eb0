"""The results pages (experiments/README.md, benchmarks/README.md) are generated from the
results JSON by ``python -m experiments.pages``: the committed pages match the committed JSON,
a changed figure changes the page, and every link on them and in docs/notes/ resolves."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import pages

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_pages_are_what_the_json_makes():
    proc = subprocess.run([sys.executable, "-m", "experiments.pages", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_pages_are_short():
    """A newcomer reads each page in two screens' worth of tables; detail lives in the notes."""
    for name, text in pages.pages().items():
        assert len(text.splitlines()) <= 300, name


@pytest.fixture
def copied_results(tmp_path, monkeypatch):
    """The results JSON and pages copied aside, the generator pointed at the copies."""
    results = tmp_path / "results"
    shutil.copytree(pages.RESULTS, results,
                    ignore=shutil.ignore_patterns("*.png", "metrics.jsonl.gz"))
    bench = tmp_path / "bench.json"
    shutil.copyfile(pages.BENCH, bench)
    out = {name: tmp_path / f"{name}.md" for name in pages.PAGES}
    for name, path in out.items():
        shutil.copyfile(pages.PAGES[name], path)
    monkeypatch.setattr(pages, "RESULTS", results)
    monkeypatch.setattr(pages, "BENCH", bench)
    monkeypatch.setattr(pages, "PAGES", out)
    return results, bench, out


def test_a_changed_figure_changes_the_page_and_check_says_so(copied_results, capsys):
    results, bench, out = copied_results
    assert pages.main(["--check"]) == 0
    records = json.loads((results / "values.json").read_text())
    for r in records:
        if r["run"] == "vote2-int4-d0.01":
            r["test_acc"] = 0.5  # every seed: the mean is 50.00, the SD 0
    (results / "values.json").write_text(json.dumps(records))
    assert pages.main(["--check"]) == 1
    assert "experiments.md" in capsys.readouterr().err
    assert pages.main([]) == 0
    assert "| `vote keep=2 --values int4` | 50.00 ± 0.00 |" in out["experiments"].read_text()
    assert pages.main(["--check"]) == 0


def test_a_benchmark_rerun_changes_its_row(copied_results):
    _, bench, out = copied_results
    data = json.loads(bench.read_text())
    data["loop_amp"]["speedup_vs_fp32"]["bf16-cl"] = 9.99
    data["loop_amp"]["commit"] = "abcdef0123"
    bench.write_text(json.dumps(data))
    assert pages.main([]) == 0
    row = next(line for line in out["benchmarks"].read_text().splitlines()
               if line.startswith("| `loop_amp`"))
    assert "9.99×" in row and "`abcdef0`" in row


def test_a_recorded_grid_run_joins_the_resnet20_table(copied_results):
    """A run recorded under tta-runs/resnet20/ (``--stage record``) appears with its seeds."""
    results, _, out = copied_results
    grid = results / "tta-runs" / "resnet20"
    shutil.copytree(grid / "topk-s0", grid / "topk-s1")
    pages.main([])
    row = next(line for line in out["experiments"].read_text().splitlines()
               if line.startswith("| `topk` |") and "to 85%" not in line
               and line.count("|") == 10)
    assert "0,1" in row and "± 0.00" in row  # two seeds (the same run twice: SD 0)


def test_a_local_steps_run_in_the_resnet20_table_counts_training_steps(copied_results):
    """A run with --local-steps 16 evaluates after synchronisations: the grid's table gives
    its training steps to a target (16 a synchronisation), comparable with the others'."""
    results, _, out = copied_results
    steps = []  # per recorded seed, in seed order: the first evaluation at 80%, in steps
    for run in sorted((results / "tta-runs" / "resnet20").glob("local16-dense-int4-s*")):
        evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
        steps.append(16 * next(e["iter"] + 1 for e in evals if e["test_acc"] >= 0.8))
    assert steps, "no recorded local16-dense-int4 run"
    pages.main([])
    row = next(line for line in out["experiments"].read_text().splitlines()
               if line.startswith("| `local16-dense-int4` |") and line.count("|") == 10)
    assert "| " + " / ".join(f"{n:,}" for n in steps) + " |" in row, row


def _links(path: Path) -> list[str]:
    return re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())


def test_every_link_on_the_pages_and_in_the_notes_resolves():
    docs = [*pages.PAGES.values(), *(ROOT / "docs" / "notes").glob("*.md")]
    broken = []
    for doc in docs:
        for target in _links(doc):
            if re.match(r"[a-z]+:", target):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken
    notes = {p.name for p in (ROOT / "docs" / "notes").glob("*.md")}
    linked = {Path(t).name for page in pages.PAGES.values() for t in _links(page)
              if "docs/notes/" in t}
    assert notes <= linked, f"notes no page links to: {sorted(notes - linked)}"


def test_the_transformer_time_table_names_the_runs_that_never_reached_a_target(
        tmp_path, monkeypatch):
    """A run no seed of which reached a target gets no row of dashes but is named once under
    the table (its accuracy runs are the same at every link rate); a run that did is a row."""
    import json

    def row(rate, target, run, iterations):
        return {"rate": rate, "target": target, "run": run, "iterations": iterations,
                "composed_s": iterations and iterations * 1.5, "vs_ddp": iterations and 0.5,
                "vs_ddp_bf16": None, "local_steps": 1}
    rows = [row(rate, target, run, n) for rate in ("25mbit", "5mbit") for target in (2.0, 1.8)
            for run, n in (("ddp", 250), ("adamw-topk", None if target == 1.8 else 600))]
    (tmp_path / "transformer-tta.json").write_text(json.dumps({
        "workload": "w", "machine": "m", "commit": "c" * 40, "timing": {}, "rows": rows}))
    monkeypatch.setattr(pages, "RESULTS", tmp_path)
    text = "\n".join(pages.transformer_tta_table())
    assert "not reached" not in text
    assert text.count("Not at 1.8 nats/char") == 1 and "Not at 2 nats" not in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 6  # the header; ddp at both targets and rates, topk at 2 twice
