"""The package's layers, bottom to top: which folder or module is on which floor.

Each layer imports only from its own and lower ones, and no modules import each other in a
circle; ``tests/test_layers.py`` reads every module's imports (function-level ones included,
by their source, without running anything) and holds the package to this table, which
docs/architecture.md shows as its folder list. A module belongs to the entry that names it or
the nearest folder above it.
"""

from __future__ import annotations

# (layer, the modules and folders it holds, their job)
LAYERS = (
    ("base", ("psparse.xp", "psparse.plugin", "psparse.rundir", "psparse.checkpoint",
              "psparse.provenance", "psparse.layers"),
     "the array module (numpy or CuPy), `module:name` plug-ins, the run directory's names, "
     "checkpoint files, which code made a run, this table"),
    ("ops", ("psparse.ops",),
     "the hot steps, one folder each (select, aggregate, codec, values, feedback): its numpy "
     "reference, numba kernel and CUDA C side by side; the kernels' loaders and cache"),
    ("backends", ("psparse.backends",),
     "where a policy's and the memory's steps run: the host (numpy, numba), CUDA through CuPy, "
     "the strict emulator; the kernel emulator and the NVRTC gate"),
    ("wire", ("psparse.wire",),
     "ZeroMQ transport, index codecs, the messages, the run description, key ranges, "
     "CurveZMQ keys"),
    ("options", ("psparse.config", "psparse.options", "psparse.option_rules"),
     "every option declared once; flags and config files; what options refuse together"),
    ("server", ("psparse.server",),
     "the parameter server: membership, the rounds' arithmetic, records, its command line"),
    ("policies", ("psparse.policies",),
     "which k entries a worker pushes, one file each; error-feedback memory"),
    ("worker", ("psparse.worker",),
     "the PS client, a round's shapes on the host and the GPU, the session a training "
     "loop holds, `connect`"),
    ("training", ("psparse.training", "psparse.data"),
     "the built-in loop, the DDP baseline, models; data sets"),
    ("launch", ("psparse.launch",),
     "`psparse-launch`: plans, processes, supervision, restarts, clusters"),
    ("analysis", ("psparse.analysis",),
     "`psparse-report`, `psparse-model`, `psparse-locality`"),
    ("api", ("psparse", "psparse.ddp_hook", "psparse.lightning"),
     "what a user's script imports: `psparse.connect`, `psparse.ddp_hook`, "
     "`psparse.lightning`"),
)


def layer_of(module: str) -> int:
    """The index in LAYERS of ``module``'s layer (the longest entry that is it or a folder
    above it; ``psparse`` itself only by name); ValueError for a module the table does not
    place (a new top-level module must be given a layer here)."""
    best, best_len = None, -1
    for n, (_, members, _) in enumerate(LAYERS):
        for member in members:
            below = member != "psparse" and module.startswith(member + ".")
            if (module == member or below) and len(member) > best_len:
                best, best_len = n, len(member)
    if best is None:
        raise ValueError(f"{module} is in no layer of psparse/layers.py")
    return best
