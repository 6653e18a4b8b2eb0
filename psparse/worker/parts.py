"""A round in buckets of layers (``--bucket-mb``), overlapped with backward with ``--overlap``.

A round in buckets of layers (``--bucket-mb``), optionally overlapped with backward
(``--overlap``): docs/api.md, Overlap; the wire side is docs/protocol.md, Parts.

Buckets are contiguous groups of layers in reverse registration order (``psparse.worker.buckets``),
each a contiguous key range (a *part*). For each bucket the worker folds its gradient into the
accumulator, lets the policy select per layer (``select_slice``, with each layer's k as in an
ordinary ``--granularity layer`` round; on a GPU the engine over the bucket's layers) and
pushes the part. With ``overlap``, a ``register_post_accumulate_grad_hook`` on every parameter
starts that work as soon as backward has produced a bucket's last gradient, so while backward
computes the earlier layers the server already averages and returns the later ones (ZeroMQ's
I/O thread sends and receives meanwhile). Part 0 (the first layers, ready last) is pushed by
``exchange`` with the loss and the checksum; ``exchange`` then waits for every part's
aggregate and applies the merged aggregate exactly as a one-part round does (the policy
observes the whole aggregate once, in key order). Every selection, sum and update is the one
of the ordinary round, so results are identical; only timing (and a few header bytes) differ.
"""

from __future__ import annotations

import time

from ..config import DEFAULT_BUCKET_MB, ConfigError
from ..option_rules import bucket_refusal
from ..policies import SelectionPolicy
from . import buckets
from .client import WorkerError
from .exchange import RoundContext
from .round import Part, Round


class Parts:
    """The buckets of one worker's rounds and their timing; each bucket is taken and sent by
    ``round`` (``Round.send_part``), the merged aggregate applied by ``Round.finish``."""

    def __init__(self, ctx: RoundContext, round_: Round, servers: int):
        self.ctx, self.round = ctx, round_
        cfg, policy = ctx.cfg, ctx.policy
        why = bucket_refusal(
            two_phase=policy.two_phase, whole_model=policy.layout.granularity != "layer",
            overrides_select=type(policy).select is not SelectionPolicy.select,
            record_selections=cfg.record_selections, shards=servers > 1)
        if why is not None:
            raise ConfigError(f"{'--overlap' if cfg.overlap else '--bucket-mb'} {why}"
                              .replace("{policy}", type(policy).__name__))
        sizes = ctx.net.layer_sizes
        self.buckets = buckets.plan(sizes, cfg.bucket_mb or DEFAULT_BUCKET_MB)
        self.edges = buckets.boundaries(sizes, self.buckets)
        self.parts = [Part(b, first, end, self.edges[b], self.edges[b + 1])
                      for b, (first, end) in enumerate(self.buckets)]
        self.bucket_of = [b for b, (first, end) in enumerate(self.buckets)
                          for _ in range(first, end)]
        self.overlap = cfg.overlap
        ctx.client.use_parts(self.edges)
        self.hooks = []
        self.in_round = False
        self.accumulating = False  # inside Session.accumulating(): backward adds, no pushes
        self.iteration = 0  # the round under way (set by begin)
        self.ready = [0] * len(self.buckets)  # gradients produced this round, per bucket
        self.pushed: set[int] = set()
        self.trace: list[str] = []  # this round's events, in order (rank-R.json: last_round)
        self.last_trace: list[str] = []
        self.pushed_in_backward = 0
        if self.overlap:
            for layer, p in enumerate(ctx.net.parameters):
                self.hooks.append(p.register_post_accumulate_grad_hook(
                    lambda param, layer=layer: self.on_grad(layer)))

    def remove_hooks(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def report(self) -> dict:
        """rank-R.json's ``overlap``: the buckets, how many pushes left during backward, and
        the order of events in the last round."""
        return {"enabled": self.overlap, "parts": self.edges,
                "layers": [list(b) for b in self.buckets],
                "pushes_in_backward": self.pushed_in_backward, "last_round": self.last_trace}

    # ------------------------------------------------------------------------------ a round
    def begin(self, it: int) -> None:
        """The round's start (its first bucket, or exchange): what a one-part round does first,
        before any gradient is folded in."""
        ctx = self.ctx
        ctx.before(it)
        self.t_begin = ctx.clock.begin()
        ctx.set_budget(it)
        self.in_round = True
        self.iteration = it
        self.ready = [0] * len(self.buckets)
        self.pushed = set()
        self.trace = []
        self.select_s = 0.0

    def on_grad(self, layer: int) -> None:
        """A parameter's gradient is complete (autograd hook, during backward)."""
        if self.accumulating:
            return  # a micro-batch before the last: its gradient only accumulates
        if not self.in_round:
            self.begin(self.ctx.iteration())  # the session's next exchange
        b = self.bucket_of[layer]
        self.ready[b] += 1
        first, end = self.buckets[b]
        if self.ready[b] > end - first or b in self.pushed:
            raise WorkerError("with overlap, every exchange() follows exactly one backward "
                              "pass outside ps.accumulating() (a second one would change "
                              "gradients already sent): accumulate micro-batches in `with "
                              "ps.accumulating():` and do the last one's backward after it")
        if self.ready[b] == end - first:
            self.trace.append(f"ready {b}")
            if b != 0:  # part 0 is ready last; exchange() sends it with the loss
                self.push(b)
                self.pushed_in_backward += 1

    def push(self, b: int, staged=None) -> None:
        """Bucket b's gradients gathered, the bucket taken and sent (``staged``: part 0's
        loss, as the round's engine staged it)."""
        t0 = time.perf_counter()
        part = self.parts[b]
        self.ctx.net.gather_layers(part.first, part.end)
        self.round.send_part(self.iteration, part, staged)
        self.pushed.add(b)
        self.trace.append(f"push {b}")
        self.select_s += time.perf_counter() - t0

    def exchange(self, it: int, loss) -> None:
        """After backward: push what the hooks did not (all buckets without overlap), last of
        all part 0 with the loss and checksum; wait for every part; apply."""
        ctx = self.ctx
        if not self.in_round:
            self.begin(it)
        staged = self.round.stage_loss(it, loss)  # the host reads it now
        self.trace.append("exchange")
        for b in range(len(self.buckets) - 1, 0, -1):
            if b not in self.pushed:
                self.push(b)
        self.push(0, staged)
        t2 = time.perf_counter()
        agg = ctx.client.await_parts(it)
        t3 = time.perf_counter()
        self.trace.append("aggregate")
        self.in_round = False
        self.last_trace = self.trace
        self.round.finish(agg, it)  # applied, or skipped on every rank (an overflow anywhere)
        ctx.clock.add("select_s", self.select_s)
        ctx.clock.add("wait_s", t3 - t2)
        ctx.clock.add("compute_s", t2 - self.t_begin - self.select_s)  # between the pushes
        ctx.clock.end(t3)
