"""threshold: every entry with |accumulator| >= lam (hard-threshold sparsification).

Sahu et al. (NeurIPS 2021) show a fixed threshold with error feedback communicates less than
top-k for the same accuracy, because the number sent adapts to the gradient: k varies per
worker and per round, and ``--density`` is ignored (apart from sizing messages and ``cap``).

Its push cap (what the server enforces) is the whole model, or with ``cap=C`` C·k entries: when
more entries pass the threshold, the C·k of largest magnitude are sent and the rest stays in the
accumulator. With ``--granularity layer`` the cap is split across the layers as k is (each
layer's share), and each layer keeps its own share's largest (the GPU selects every layer at
once, so the rule is per layer there and here alike).

On the host (``HostEngines``) |accumulator| >= lam is found by the compiled
``select_kernels.at_least`` (64 entries per vector compare), or block by block in numpy
(``selection.at_least``, its oracle) where the compiled kernels are off; the same indices
either way.
"""

from ..ops.select import radix
from .base import Param, SelectionPolicy


class Threshold(SelectionPolicy):
    name = "threshold"
    device_graph = True  # its device select is one engine run
    params = {
        "lam": Param(float, 0.01, "send entries with |accumulator| >= lam",
                     lambda v: v > 0, "> 0"),
        "cap": Param(float, 0.0, "send at most cap x k entries, the largest (0: no cap)",
                     lambda v: v >= 0, ">= 0"),
    }

    # select_kernels.at_least against kernels.at_least, measured back to back on the bench's
    # accumulator (benchmarks/bench_select.py's workload): 11M at 0.1% / 1%, 7.3 / 6.4 ms
    # against 11.9 / 14.5 (top-k: 6.5 / 13.3); 61,706: 0.025 against 0.029-0.033 ms; so the
    # host engines run the compiled one wherever the kernels take the arrays

    @property
    def max_push(self):
        if self.cap == 0:
            return self.layout.numel
        return min(self.layout.numel, max(1, int(round(self.cap * self.k))))

    def select(self, accumulator, iteration, group=None):
        # per slice: |acc| >= lam, the share's largest if more (on the host block by block,
        # with no model-sized |accumulator| or mask: HostEngines)
        return self.engines.select("select", radix.Key(radix.KEY_THRESHOLD, accumulator,
                                                       p0=self.lam),
                                   self.layout.split(self.max_push), self.fusion,
                                   exclude_zero=True)
