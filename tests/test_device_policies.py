"""Every built-in policy selects on the device exactly what it selects on the host.

The device side runs the policy's GPU path (the radix engine, the device-resident decayed
state, the masks) on the strict emulated backend (psparse/backends/cuda.py): the CUDA C kernels on
the CPU, arrays that refuse every implicit read to the host. Both sides see the same
accumulators (ties, zeros, runs of equal values, nearly empty rounds: the inputs of
tests/test_policy_equivalence.py) and the same aggregates, round after round, with a budget
change; the selections must be equal every round and the states' digests equal at the end. On
a machine with CUDA the same runs use the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_policy_equivalence import CASES, LAYERS, MODEL, aggregate, build, gradient, group_for

from psparse.backends.cuda import CudaBackend
from psparse.backends.device_engines import DeviceSelection
from psparse.backends.emulated import EmulatedBackend
from psparse.policies import Layout, PolicyError, build_policy, policy_class
from psparse.xp import cupy_or_none


@pytest.fixture(scope="module")
def dev():
    cupy = cupy_or_none()
    return CudaBackend(cupy) if cupy is not None else EmulatedBackend(strict=True)


def on_host(dev, selection) -> np.ndarray:
    """A device selection's indices on the host (outside a round: ``read``)."""
    if isinstance(selection, DeviceSelection):
        report = dev.read(selection.report)
        indices = dev.read(selection.indices)
        return np.concatenate([indices[s:s + c] for s, c in selection.host_parts(report)]
                              ).astype(np.int64)
    return dev.read(selection).astype(np.int64)


@pytest.mark.parametrize("granularity", ["model", "layer"])
@pytest.mark.parametrize("name, args", CASES,
                         ids=[f"{n}-" + ",".join(f"{a}={v}" for a, v in a.items())
                              for n, a in CASES])
def test_the_device_path_selects_what_the_host_selects(dev, name, args, granularity,
                                                       rounds=18, k=70):
    layout = Layout(MODEL if granularity == "model" else LAYERS, granularity)
    n = layout.numel
    if not policy_class(name).device_path:  # micro, exdyna: a GPU worker refuses them by name
        with pytest.raises(PolicyError, match=f"policy {name!r} runs on the host path only"):
            build_policy(name, [f"{a}={v}" for a, v in args.items()], layout, k, rank=0,
                         world_size=4, seed=3, dev=dev)
        return
    host = build(name, layout, k, args)
    device = build_policy(name, [f"{a}={v}" for a, v in args.items()], layout, k, rank=0,
                          world_size=4, seed=3, dev=dev)
    rng = np.random.default_rng(0)
    acc = np.zeros(n, np.float32)
    acc_dev = dev.xp.zeros(n, dtype=np.float32)
    for it in range(rounds):
        if it == rounds // 3:
            for p in (host, device):
                p.set_k(k // 2)
        acc += gradient(rng, n, it)
        if it % 11 == 5:  # fewer nonzero entries than k
            acc[rng.random(n) > 20 / n] = 0.0
        dev.upload("accumulator", acc, out=acc_dev)
        group = None
        if host.two_phase:
            proposal = host.propose(acc, it)
            proposed = device.propose(acc_dev, it)
            assert (proposal is None) == (proposed is None)
            if proposal is not None:
                np.testing.assert_array_equal(on_host(dev, proposed), proposal,
                                              err_msg=f"propose {it}")
            group = group_for(rng, host, proposal, n, it)
        chosen = host.select(acc, it, group=group)
        group_dev = None if group is None else dev.upload("group", group)
        np.testing.assert_array_equal(on_host(dev, device.select(acc_dev, it, group=group_dev)),
                                      chosen, err_msg=f"{name} {args} round {it}")
        acc[chosen] = 0.0
        indices, values = aggregate(rng, n, chosen, it)
        host.observe(indices, values, it)
        device.observe(dev.upload("indices", indices.astype(np.int64)),
                       dev.upload("values", values), it)
    assert host.state_digest() == device.state_digest()


@pytest.mark.parametrize("name", ["topk", "threshold", "frequency", "ema", "penalty", "core"])
def test_a_nan_in_the_accumulator_is_counted_by_the_selection(dev, name):
    """The round refuses to send when the engine counted a NaN or inf (``report``, and the
    candidate pool's for frequency, whose final selection never sees the NaN it ranked last)."""
    from psparse.backends.device_engines import Fusion
    from psparse.ops.select.radix import RP_W
    from psparse.policies.memory import Memory
    layout = Layout([5000, 3000], "layer")
    policy = build_policy(name, [], layout, 50, dev=dev)
    memory = Memory(8000, dev=dev)
    gradient = np.random.default_rng(1).standard_normal(8000).astype(np.float32)
    gradient[6001] = np.nan
    policy.fusion = Fusion(memory.accumulate_spec(dev.upload("gradient", gradient)),
                           memory.accumulator, memory.velocity)
    selection = policy.select(memory.accumulator, 0)
    bad = [int(dev.read(r).reshape(-1, RP_W)[:, 1].sum())
           for r in (selection.report, *selection.also)]
    assert sum(bad) == 1, bad
