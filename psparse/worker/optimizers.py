"""Several optimizers for one model, as one object a session checkpoints and checks.

Several optimizers for one model (``connect(model, [opt_a, opt_b])``): one object that a
session saves in checkpoints, restores and checks, as it does a single ``torch.optim``
optimizer. Stepping them stays the loop's business."""

from __future__ import annotations


class Optimizers:
    """``members``, in order; their parameter groups and their state, together."""

    def __init__(self, members):
        self.members = list(members)

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.members for g in o.param_groups]

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.members]}

    def load_state_dict(self, state: dict) -> None:
        if len(state["optimizers"]) != len(self.members):
            raise ValueError(f"the checkpoint holds {len(state['optimizers'])} optimizers' "
                             f"state, this script has {len(self.members)}")
        for o, s in zip(self.members, state["optimizers"]):
            o.load_state_dict(s)


def as_optimizer(optimizer):
    """None, one optimizer as it is, or a list / tuple of them as one ``Optimizers``."""
    return Optimizers(optimizer) if isinstance(optimizer, (list, tuple)) else optimizer
