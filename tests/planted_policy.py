"""A user policy that reads a device value into Python every round (``float`` of the
accumulator's largest magnitude): harmless on the host, a hidden synchronisation on a GPU.
tests/test_device_round.py plants it to show the strict emulated backend refuses it."""

from psparse.policies import SelectionPolicy


class ReadsTheMaximum(SelectionPolicy):
    name = "reads-the-maximum"

    def select_slice(self, acc, k, offset):
        if float(self.xp.abs(acc).max()) == 0.0:  # the read a GPU path must not make
            return self.xp.arange(k, dtype=self.xp.int64)
        return self.topk(acc, k, offset)
