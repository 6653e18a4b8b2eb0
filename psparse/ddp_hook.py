"""psparse as a DistributedDataParallel communication hook (docs/api.md, "DDP comm hook").

A DDP user changes one line: after ``model = DistributedDataParallel(model)``,

    ps = psparse.ddp_hook.register(model, optimizer, iterations=N)

and DDP's buckets go through the parameter server instead of the allreduce: as backward hands
DDP a bucket, the hook copies its gradients into the session's flat gradient and pushes every
psparse bucket of layers (a *part*, ``--bucket-mb``, docs/protocol.md, Parts) that is then
complete, with error feedback and the chosen policy selecting per layer, exactly as
``--overlap`` does from autograd's hooks; so the server averages the later layers while
backward still computes the earlier ones, overlapped by DDP's own bucketing. When DDP hands
over the bucket that completes the model, the hook runs the rest of the round (``Session.
exchange``: part 0, the wait for every part's aggregate, the policy's observation) and
resolves every bucket's future with the aggregate at its parameters, which DDP writes into
``.grad``; ``optimizer.step()`` then applies the same bytes on every replica.

psparse's parts are keyed by parameter, not by DDP's buckets, so DDP may form its buckets as it
likes (and re-form them after the first iteration, as it does). The round is the session's own
round in parts: the same selections, bytes and weights as a ``psparse.connect`` loop with
``granularity="layer"`` and the same ``bucket_mb`` that calls ``exchange()`` without a loss.

For PyTorch Lightning: ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=psparse.ddp_hook.hook)``
with ``state = psparse.ddp_hook.connect(module, ...)``, made before ``trainer.fit``.
"""

import torch  # no "from __future__ import annotations": DDP checks hook()'s annotations

from .config import DEFAULT_BUCKET_MB, ConfigError

__all__ = ["HookState", "connect", "hook", "register"]


class HookState:
    """The comm hook's state: one worker's ``Session`` (exchanged in parts) and the DDP
    buckets handed over in the round under way."""

    def __init__(self, session):
        if session.parts is None or session.cfg.overlap:
            raise ConfigError("the DDP comm hook exchanges in buckets of layers handed over by "
                              "DDP: it needs bucket_mb and no overlap (DDP's buckets overlap)")
        if session.local is not None:
            raise ConfigError("the DDP comm hook is handed gradients during every backward "
                              "pass, and local_steps synchronises pseudo-gradients every H "
                              "steps: use psparse.connect(model, optimizer, local_steps=H) "
                              "with the model unwrapped (docs/api.md, Local steps)")
        self.session = session
        net = session.net
        self.layer_at = {p.data_ptr(): layer for layer, p in enumerate(net.parameters)}
        self.pending: list[tuple] = []  # (layers, their gradients, future, bucket buffer)
        self.seen = 0  # parameters handed over this round

    def bucket(self, bucket) -> torch.futures.Future:
        """One DDP bucket: its gradients in, its parts pushed once complete; the future
        resolves when the round's aggregate is in."""
        parts, net = self.session.parts, self.session.net
        layers = []
        for p, grad in zip(bucket.parameters(), bucket.gradients()):
            layer = self.layer_at.get(p.data_ptr())
            if layer is None:
                raise ConfigError("DDP handed the comm hook a parameter the psparse session "
                                  "does not exchange: connect the module DDP wraps "
                                  "(model.module), with the same trainable parameters")
            net.grad_views[layer].copy_(grad)
            net.parameters[layer].grad = net.grad_views[layer]
            layers.append(layer)
            parts.on_grad(layer)  # pushes a part of the round once all its layers are in
        future = torch.futures.Future()
        self.pending.append((layers, bucket.gradients(), future, bucket.buffer()))
        self.seen += len(layers)
        if self.seen == len(net.parameters):
            self._finish_round()
        return future

    def _finish_round(self) -> None:
        """Every parameter is in: the rest of the round, then every bucket's result."""
        pending, self.pending, self.seen = self.pending, [], 0
        self.session.exchange()  # part 0, every part's aggregate, applied into .grad
        views = self.session.net.grad_views
        for layers, grads, future, buffer in pending:
            for layer, grad in zip(layers, grads):
                grad.copy_(views[layer])
            future.set_result(buffer)


def hook(state: HookState, bucket) -> torch.futures.Future[torch.Tensor]:
    """The comm hook (``DistributedDataParallel.register_comm_hook(state, hook)``)."""
    return state.bucket(bucket)


def connect(module: torch.nn.Module, optimizer=None, **connect_options) -> HookState:
    """``psparse.connect`` for the hook: ``module`` is the model DDP wraps (or will wrap);
    exchanged in buckets of layers (``granularity="layer"``, ``bucket_mb`` default
    0.1 MB) unless told otherwise."""
    from .worker.connection import connect as ps_connect

    connect_options.setdefault("granularity", "layer")
    connect_options.setdefault("bucket_mb", DEFAULT_BUCKET_MB)
    session = ps_connect(module, optimizer, **connect_options)
    session.auto_close = True  # closed at the script's end if the script does not
    try:
        return HookState(session)
    except BaseException as exc:
        session.fail(exc)
        raise


def register(ddp_model, optimizer=None, **connect_options):
    """Join the psparse run and make it ``ddp_model``'s communication: returns the
    ``Session`` (``ps.close(test_acc=...)`` at the end, ``with ps:`` as with connect)."""
    state = connect(ddp_model.module, optimizer, **connect_options)
    try:
        ddp_model.register_comm_hook(state, hook)
    except BaseException as exc:
        state.session.fail(exc)  # summary.json names the cause
        raise
    return state.session
