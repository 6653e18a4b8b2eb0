"""PyTorch Lightning with psparse as DDP's communication: ``PsparseStrategy``, a ``DDPStrategy``.

    import lightning as L
    from psparse.lightning import PsparseStrategy

    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]),
                        strategy=PsparseStrategy(process_group_backend="gloo"), max_steps=500)
    trainer.fit(model, loader)

under ``psparse-launch`` (or torchrun beside a ``psparse-server``): Lightning wraps the module
in DDP as always, and the strategy joins the psparse run with it (``psparse.ddp_hook.connect``)
and registers psparse's comm hook on the wrapped model, through DDP's public
``register_comm_hook``, on the CPU and on GPUs alike. The run is open-ended: when ``fit`` ends,
every rank's session closes after the same round, and the run ends there (summary.json's
``ended``: "closed by every rank after iteration T"). Values the module logs under the run's
evaluation keys (``test_acc``, ``test_loss``, ``train_loss``, ``epoch``: ``self.log(...)``,
e.g. in ``validation_step``) are the run's evaluation in the final report. With ``precision="16-mixed"`` Lightning's GradScaler is given
to psparse, so overflowed steps are skipped on every rank (docs/api.md, Mixed precision).

Trainer settings it needs (docs/api.md, "PyTorch Lightning"): ``devices`` = processes per node
and ``num_nodes`` as launched (``psparse-launch`` sets ``LOCAL_RANK``, so Lightning takes the
processes as they are and starts none), ``process_group_backend="gloo"`` on CPUs (DDP's
default, NCCL, on GPUs); DDP's own bucketing stays (``bucket_cap_mb`` and the other
``DDPStrategy`` keywords pass through). psparse's options are ``psparse=dict(policy=...,
density=...)``: what ``psparse.connect`` takes, else the launcher's configuration.
"""

from __future__ import annotations

import sys

from lightning.pytorch.strategies import DDPStrategy

from . import ddp_hook
from .rundir import EVAL_VALUES

__all__ = ["PsparseStrategy"]


class PsparseStrategy(DDPStrategy):
    """``DDPStrategy`` whose gradients go through the psparse run instead of the allreduce."""

    strategy_name = "psparse"

    def __init__(self, *, psparse: dict | None = None, **ddp_options):
        if "ddp_comm_hook" in ddp_options or "ddp_comm_state" in ddp_options:
            raise ValueError("PsparseStrategy registers psparse's comm hook itself: leave out "
                             "ddp_comm_hook and ddp_comm_state")
        super().__init__(**ddp_options)
        self.psparse_options = dict(psparse or {})
        self.state: ddp_hook.HookState | None = None

    @property
    def session(self):
        """The psparse ``Session`` (after ``fit`` has set the strategy up), else None."""
        return self.state.session if self.state is not None else None

    def configure_ddp(self) -> None:
        if self.state is not None:
            raise RuntimeError("PsparseStrategy: one fit() per psparse run (the first one's "
                               "end closed it); make a new Trainer and strategy under a new "
                               "psparse-launch")
        module = self.model  # the LightningModule, before DDP wraps it
        scaler = getattr(self.precision_plugin, "scaler", None)  # "16-mixed": GradScaler
        self.state = ddp_hook.connect(module, scaler=scaler, **self.psparse_options)
        super().configure_ddp()
        self.model.register_comm_hook(self.state, ddp_hook.hook)

    def teardown(self) -> None:
        """The end of fit (or its failure: Lightning tears down while handling the
        exception, which then goes to the server as this rank's cause)."""
        session = self.session
        if session is not None and not session.closed:
            failure = sys.exc_info()[1]
            if failure is not None:
                session.fail(failure)
            else:
                session.close(**self._logged_evaluation())
        super().teardown()

    def _logged_evaluation(self) -> dict:
        """What the module logged under the run's evaluation keys (test_acc, test_loss)."""
        try:
            logged = self.lightning_module.trainer.callback_metrics
        except (AttributeError, RuntimeError):  # no module, or not attached to a trainer
            return {}
        return {k: float(logged[k]) for k in EVAL_VALUES if k in logged}
