"""DiLoCo / LocalSGD peers with PyTorch's torchft, on psparse's LeNet-5 + MNIST, over gloo.

A reference point for psparse's own ``--local-steps`` (worker/local_steps.py): the same model,
data shards and seed, trained by torchft's fault-tolerant ``DiLoCo`` or ``LocalSGD``
(``torchft.local_sgd``) instead of through the psparse server.

One process starts a torchft lighthouse (the Rust ``LighthouseServer``, in-process) and N worker
processes on localhost. Each worker is its own replica group of world size 1: it runs a TCPStore
for its group, a ``ProcessGroupGloo`` (reconfigured by the Manager on every new quorum) and a
``torchft.Manager`` (synchronous quorum, as DiLoCo requires). Every --sync-every inner steps the
optimizer's post-step hook that DiLoCo/LocalSGD installs asks the lighthouse for a quorum,
allreduces over gloo and commits:

* diloco: pseudo-gradient (last global weights - local weights) averaged, then the outer
  optimizer SGD(lr=--outer-lr, momentum 0.9, nesterov) steps the global weights;
  --fragments K syncs K parts of the model in turn (Streaming DiLoCo);
* localsgd: the weights themselves are averaged.

torchft is not a psparse dependency: ``make torchft`` installs it into .torchft/ beside the
project's torch (torchft 0.2.0 with --no-deps, plus its opentelemetry requirements), then:
    PYTHONPATH=.torchft:. .venv/bin/python experiments/diloco_peer.py --workers 2 --out /tmp/d
Outputs in --out: eval.jsonl (rank 0's test accuracy every --eval-every steps), syncs.jsonl
(every rank's wall time of each sync) and summary.json.

On separate hosts (experiments/torchft_cluster.py, the emulated cluster): ``--serve-lighthouse
ADDR:PORT`` runs the lighthouse alone until every rank has reported, and ``--rank R
--lighthouse http://ADDR:PORT --hostname THIS_HOSTS_ADDRESS`` runs one replica group, which
writes its syncs and commits to --out/rank-R.json (rank 0 also eval.jsonl, unless --no-eval).

Caveat: --quantize is passed to DiLoCo as ``should_quantize``; torchft 0.2.0 only quantizes when
``import triton`` works (torchft.manager.IS_TRITON_AVAILABLE) and otherwise falls back, silently,
to a full-precision allreduce (summary.json's quantize_mode); with triton but no accelerator its
quantized allreduce raises at every sync and nothing is committed, so that is refused here.
LocalSGD has no such option. DiLoCo's outer SGD at lr 0.7 (nesterov, m=0.9) over an inner SGD
(lr 0.05, m=0.9) diverges on this problem; the default inner AdamW(1e-3) does not.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import multiprocessing as mp
import os
import queue
import time
from datetime import timedelta
from pathlib import Path

import torch

# torchft's Rust side (lighthouse, ManagerServer) logs every quorum at INFO; RUST_LOG=info shows it
os.environ.setdefault("RUST_LOG", "warn")
try:
    import torchft.manager as tf_manager
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo, LocalSGD
except ImportError as exc:  # not a psparse dependency
    raise SystemExit(f"torchft is not importable ({exc}); make torchft installs it into "
                     ".torchft/: run with PYTHONPATH=.torchft:."
                     ) from None

from psparse.data import Shard, load_dataset
from psparse.training.loop import evaluate_model
from psparse.training.models import build_model


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="replica groups (one process each)")
    p.add_argument("--algorithm", choices=["diloco", "localsgd"], default="diloco")
    p.add_argument("--sync-every", type=int, default=16, help="H: inner steps between syncs")
    p.add_argument("--steps", type=int, default=320,
                   help="inner steps per worker (rounded up to a multiple of --sync-every)")
    p.add_argument("--quantize", action="store_true",
                   help="DiLoCo's should_quantize (needs triton; see summary's quantize_mode)")
    p.add_argument("--fragments", type=int, default=1, help="Streaming DiLoCo model fragments")
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="adamw",
                   help="inner optimizer: AdamW, or SGD with momentum 0.9")
    p.add_argument("--lr", type=float, default=None, help="inner lr (default: sgd 0.05, adamw 1e-3)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo outer SGD lr (nesterov, m=0.9)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=32,
                   help="rank 0 evaluates every this many steps (a multiple of H sees the synced model)")
    p.add_argument("--timeout", type=float, default=60.0, help="Manager/gloo/quorum timeout, seconds")
    p.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[1] / "data"))
    p.add_argument("--out", required=True, help="output folder")
    # on separate hosts (experiments/local_steps.py's torchft-timing stage, the emulated cluster)
    p.add_argument("--serve-lighthouse", metavar="ADDR:PORT", default=None,
                   help="only run the lighthouse, bound there, until every rank has written "
                        "its rank-R.json to --out")
    p.add_argument("--rank", type=int, default=None,
                   help="only run this rank's replica group (its results: --out/rank-R.json)")
    p.add_argument("--lighthouse", default=None,
                   help="with --rank: the lighthouse's address (http://ADDR:PORT)")
    p.add_argument("--hostname", default="localhost",
                   help="the address this rank's ManagerServer and store are reached at")
    p.add_argument("--no-eval", action="store_true",
                   help="no evaluation (timing runs: rank 0's evaluations would stall every peer)")
    args = p.parse_args(argv)
    if args.rank is not None and not args.lighthouse:
        p.error("--rank needs --lighthouse")
    args.lr = args.lr if args.lr is not None else (0.05 if args.optimizer == "sgd" else 1e-3)
    args.steps = -(-args.steps // args.sync_every) * args.sync_every
    if args.algorithm == "localsgd" and (args.quantize or args.fragments != 1):
        p.error("--quantize and --fragments are DiLoCo options (torchft's LocalSGD has neither)")
    if args.sync_every % args.fragments:
        p.error("--sync-every must be a multiple of --fragments")
    if args.quantize and tf_manager.IS_TRITON_AVAILABLE and not torch.accelerator.is_available():
        # torchft 0.2.0 manager.py:459-463 calls allreduce_quantized(..., torch.accelerator
        # .current_stream()), which raises here; the Manager catches it, should_commit() is False
        # at every sync and DiLoCo resets the weights: the run "succeeds" without ever training.
        p.error("--quantize with triton importable but no accelerator: torchft's quantized "
                "allreduce fails at every sync (no accelerator for torch.accelerator.current_stream)")
    args.quantize_mode = ("off" if not args.quantize else "triton fp8/int8"
                          if tf_manager.IS_TRITON_AVAILABLE else "ignored: no triton, fp32 allreduce")
    return args


def sync_period(args: argparse.Namespace) -> int:
    """Inner steps between two syncs: H, or H/K with K DiLoCo fragments synced in turn."""
    return args.sync_every // args.fragments


def model_fragments(model: torch.nn.Module, k: int) -> list[torch.nn.Module]:
    """The model's top-level layers in k contiguous groups (LeNet-5: conv1 conv2 fc1 fc2 fc3)."""
    layers = list(model.children())
    if not 1 <= k <= len(layers):
        raise ValueError(f"--fragments must be between 1 and {len(layers)}")
    bounds = [round(i * len(layers) / k) for i in range(k + 1)]
    return [torch.nn.ModuleList(layers[a:b]) for a, b in zip(bounds, bounds[1:])]


def worker(rank: int, args: argparse.Namespace, lighthouse_addr: str, report) -> None:
    """One replica group (world size 1): the same data/shard/model construction as psparse's
    built-in loop (``psparse.training.loop.setup``), then torchft's DiLoCo or LocalSGD."""
    torch.set_num_threads(1)  # N processes share the machine's cores
    data = load_dataset("mnist", args.data_dir)
    shard = Shard(data, rank, args.workers, args.batch_size, args.seed)
    torch.manual_seed(args.seed)  # same initial weights everywhere, so no init_sync is needed
    model = build_model("lenet", data.in_shape, data.num_classes, {})
    if args.optimizer == "sgd":
        inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=args.lr)

    timeout = timedelta(seconds=args.timeout)
    # This group's store: the Manager's rank 0 publishes its ManagerServer's address in it and the
    # reconfigured gloo groups rendezvous under the store address the lighthouse hands out.
    store = torch.distributed.TCPStore(args.hostname, 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        # what a recovering replica would fetch; the DiLoCo fragments register their own
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                    inner.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=args.workers,  # commit only when every peer took part
        use_async_quorum=False,  # DiLoCo refuses the async quorum
        init_sync=False,  # seeded identically: no weight transfer at step 0
        replica_id=f"peer_{rank}", rank=0, world_size=1,
        store_addr=args.hostname, store_port=store.port,
        lighthouse_addr=lighthouse_addr, hostname=args.hostname,
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
    )
    if args.algorithm == "diloco":
        # One outer optimizer per fragment, over that fragment's parameters only: at a fragment's
        # sync every other parameter still holds its inner gradient, which an outer optimizer
        # over the whole model would step with too (and diverge).
        fragments = model_fragments(model, args.fragments)
        outer = [torch.optim.SGD(f.parameters(), lr=args.outer_lr, momentum=0.9, nesterov=True)
                 for f in fragments]
        algo = DiLoCo(manager, fragments, inner, outer,
                      sync_every=args.sync_every, should_quantize=args.quantize)
    else:
        algo = LocalSGD(manager, model, inner, sync_every=args.sync_every)

    syncs, local_s, evals = [], [], []
    evaluating = rank == 0 and not args.no_eval
    eval_file = open(Path(args.out) / "eval.jsonl", "w") if evaluating else None

    def evaluate(step: int, start: float) -> None:
        loss, acc = evaluate_model(model, data, torch.device("cpu"))
        model.train()
        row = {"step": step, "test_acc": acc, "test_loss": loss,
               "elapsed_s": round(time.perf_counter() - start, 3)}
        evals.append(row)
        eval_file.write(json.dumps(row) + "\n")
        eval_file.flush()

    print(f"rank {rank}: training starts", flush=True)  # (the cluster stage waits for it)
    start = time.perf_counter()
    if evaluating:
        evaluate(0, start)
    with algo:
        for i in range(args.steps):
            t0 = time.perf_counter()
            x, y = shard.batch(i)
            inner.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            t1 = time.perf_counter()
            inner.step()  # the post-step hook syncs every H steps (quorum, allreduce, commit)
            t2 = time.perf_counter()
            step = i + 1
            if step % sync_period(args) == 0:
                # the sync's time: the whole optimizer.step() (the inner step itself is ~0.1 ms)
                syncs.append({"rank": rank, "step": step, "sync_s": round(t2 - t1, 5),
                              "at_s": round(t2 - start, 5),  # the sync's end, from the start
                              "manager_step": manager.current_step(),
                              "errored": manager.errored() is not None,
                              "loss": round(loss.item(), 4)})
            else:
                local_s.append(t2 - t0)
            if evaluating and step % args.eval_every == 0 and step != args.steps:
                evaluate(step, start)
    train_s = time.perf_counter() - start
    if evaluating:  # the final (synced) model
        evaluate(args.steps, start)
        eval_file.close()
    report({"rank": rank, "syncs": syncs, "train_s": train_s,
            "local_step_s": sum(local_s) / max(1, len(local_s)),
            "commits": manager.current_step(), "evals": evals})
    manager.shutdown(wait=False)


def one_rank(args: argparse.Namespace) -> int:
    """--rank R: this rank's replica group alone (its host's process), results to rank-R.json."""
    path = Path(args.out) / f"rank-{args.rank}.json"

    def report(result: dict) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result) + "\n")
        tmp.replace(path)  # whole or absent: the lighthouse and the stage wait for it
    worker(args.rank, args, args.lighthouse, report)
    return 0


def serve_lighthouse(args: argparse.Namespace) -> int:
    """--serve-lighthouse ADDR:PORT: the lighthouse alone, until every rank has reported."""
    out = Path(args.out)
    lighthouse = LighthouseServer(bind=args.serve_lighthouse, min_replicas=args.workers)
    print(f"lighthouse at {lighthouse.address()}", flush=True)
    deadline = time.monotonic() + 10 * args.timeout + 3600
    while len(list(out.glob("rank-*.json"))) < args.workers:
        if time.monotonic() > deadline:
            lighthouse.shutdown()
            raise SystemExit("the ranks did not all report within the time limit")
        time.sleep(0.5)
    lighthouse.shutdown()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.serve_lighthouse:
        return serve_lighthouse(args)
    if args.rank is not None:
        return one_rank(args)
    # The lighthouse forms a quorum once --workers replica groups have joined.
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.workers)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, lighthouse.address(), results.put))
             for r in range(args.workers)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    got, dead = [], []
    while len(got) < args.workers and not dead:  # collect results, watching for a dead worker
        try:
            got.append(results.get(timeout=1.0))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    if dead:
        for p in procs:
            if p.is_alive():
                p.terminate()
        lighthouse.shutdown()
        raise SystemExit(f"worker(s) {dead} failed (exit codes "
                         f"{[procs[r].exitcode for r in dead]}); see stderr")
    for p in procs:
        p.join()
    wall = time.perf_counter() - t0
    lighthouse.shutdown()

    got.sort(key=lambda r: r["rank"])
    syncs = [s for r in got for s in r["syncs"]]
    with open(out / "syncs.jsonl", "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in syncs)
    sync_s = sorted(s["sync_s"] for s in syncs)
    final = got[0]["evals"][-1] if got[0]["evals"] else \
        {"step": None, "test_acc": None, "test_loss": None}  # --no-eval
    summary = {
        "torchft_version": importlib.metadata.version("torchft"),  # no torchft.__version__
        "torch_version": torch.__version__,
        "options": vars(args),
        "quantize_mode": args.quantize_mode,  # torchft falls back to fp32 without triton
        "final_step": final["step"], "final_test_acc": final["test_acc"],
        "final_test_loss": final["test_loss"],
        "commits_per_rank": [r["commits"] for r in got],
        "syncs_expected": args.steps // sync_period(args),
        "errored_syncs": sum(s["errored"] for s in syncs),
        "local_step_s_mean": sum(r["local_step_s"] for r in got) / len(got),
        "sync_s_mean": sum(sync_s) / len(sync_s), "sync_s_median": sync_s[len(sync_s) // 2],
        "sync_s_max": sync_s[-1],
        "train_s_rank0": got[0]["train_s"], "wall_s": wall,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("final_test_acc", "commits_per_rank",
                      "local_step_s_mean", "sync_s_median", "wall_s", "quantize_mode")}))
    if min(summary["commits_per_rank"]) < summary["syncs_expected"]:  # discarded syncs
        print(f"only {summary['commits_per_rank']} of {summary['syncs_expected']} syncs committed")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
