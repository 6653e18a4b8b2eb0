"""What a worker's checkpoint holds and how a resumed worker takes it back (``Checkpointed``).

What a worker's checkpoint holds and how a resumed worker takes it back: ``Checkpointed``, the part
of ``Session`` (psparse/worker/session.py) that ``--checkpoint-every`` and ``--resume`` use.

A checkpoint is written at an iteration boundary (psparse/checkpoint.py): the parameters and
optimizer state after the last update, the model's buffers as they were after that
iteration's forward pass, the error-feedback memory, the policy's state, the key cache, the
byte and time totals, the evaluator's last report, the live ranks (an elastic run's) and,
with --local-steps, the outer step's momentum (written at a synchronisation). The session's
attributes it reads are those ``Session.__init__`` sets (``net``, ``optimizer``, ``memory``, ``policy``, ``client``,
``ctx``, ``dev``, ``out_dir``, ``cfg``, ``servers``, ``rank``).
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from .. import checkpoint
from .client import WorkerError


class Checkpointed:
    def state_dict(self, frozen: bool = False) -> dict:
        """Everything of this worker's exchange state a resume needs: model, optimizer,
        accumulator, policy state, key cache, byte and time totals, the last evaluation.
        ``frozen``: the optimizer's state copied too (it is written after more local steps)."""
        # clones: the parameters are views of one flat buffer, and pickling a view writes the
        # whole buffer once per parameter
        model = {name: t.detach().clone() for name, t in self.net.model.state_dict().items()}
        return {
            "iteration": self.iteration,
            "model": model,
            "optimizer": None if self.optimizer is None else copy.deepcopy(
                self.optimizer.state_dict()) if frozen else self.optimizer.state_dict(),
            "memory": {name: self.policy.host(a) for name, a in self.memory.state_dict().items()},
            "policy": {name: self.policy.host(v) if hasattr(v, "shape") else v
                       for name, v in self.policy.state_dict().items()},
            "cache": self.client.cache_state(),
            "stats": self.stats,
            "last_report": self.last_report,
            "live": list(self.live),
            # --local-steps: the outer step's momentum (the anchor is the weights, see there)
            **({"local_steps": self.local.state_dict()} if self.local is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():  # copies into the flat buffers the parameters view
            self.net.model.load_state_dict(state["model"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        for name, array in state["memory"].items():
            if self.dev is not None:
                self.dev.upload(f"restore-{name}", np.asarray(array), out=getattr(self.memory, name))
            else:
                getattr(self.memory, name)[...] = np.asarray(array)
        self.policy.load_state_dict(state["policy"])
        self.client.restore_cache(state["cache"])
        stats = state["stats"]
        self.client.sent_bytes = stats["push_bytes"]
        self.client.received_bytes = stats["aggregate_bytes"]
        self.ctx.clock.times.update({k: stats[k] for k in self.ctx.clock.times})
        if self.local is not None:  # after the weights: they are the anchor
            if "local_steps" not in state:
                raise WorkerError("the checkpoint was written without --local-steps: resume "
                                  "with the options the run started with")
            self.local.load_state_dict(state["local_steps"])
        self.last_report = state["last_report"]
        self.start = self.iteration = state["iteration"]
        live = state.get("live", self.live)
        if live != self.live:  # an elastic run that had lost workers by this checkpoint
            self.live = list(live)
            self.policy.set_live(self.live)

    def _checkpoint(self, iteration: int, state: dict | None = None) -> None:
        """Iteration ``iteration``'s checkpoint: the state now, or ``state`` (--local-steps:
        taken at the synchronisation) with the evaluator's report since."""
        if state is None:
            state = self.state_dict()
        state["last_report"] = self.last_report
        if self._buffers_at_checkpoint is not None:
            state["model"].update(self._buffers_at_checkpoint)
            self._buffers_at_checkpoint = None
        checkpoint.save(self.out_dir, f"rank-{self.rank}", iteration, {**state,
                                                                     "iteration": iteration})

    def _restore(self) -> None:
        if not self.out_dir:
            raise WorkerError("resume needs the run directory (--out)")
        point = checkpoint.resume_point(self.out_dir, self.cfg.workers, self.servers)
        if point is None:
            raise WorkerError(f"no checkpoint in {self.out_dir} that the server and every "
                              "worker live at it saved")
        if self.rank not in point.live:
            raise WorkerError(f"rank {self.rank} is not in the resumed run: the elastic run "
                              f"lost it before iteration {point.iteration}, the checkpoint it "
                              f"resumes from (live ranks {point.live}); start only those")
        self.load_state_dict(checkpoint.load(self.out_dir, f"rank-{self.rank}",
                                             point.iteration))
        self.say(f"resuming at iteration {point.iteration}")
