"""The GPU-less kernel gate (psparse/backends/kernel_check.py) passes on the package and catches faults.

Needs CuPy and NVRTC (no GPU): `make check-kernels` installs them and runs this file; without
them (plain `make test`) the tests that compile are skipped with that reason.
"""

from __future__ import annotations

import pytest

from psparse.backends import kernel_check
from psparse.backends.kernel_check import CudaSource, ElementwiseSpec
from psparse.ops import sources


def _nvrtc_or_none():
    try:
        import cupy  # noqa: F401
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
        return nvrtc
    except Exception:
        return None


needs_nvrtc = pytest.mark.skipif(
    _nvrtc_or_none() is None,
    reason="CuPy/NVRTC not installed (make check-kernels installs cupy-cuda13x and "
           "nvidia-cuda-nvrtc and runs these tests)")

PLANTED_FINE = r"""
extern "C" __global__ void psparse_planted_fine(float* x, long long n) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < n) x[j] = 0.0f;
}
"""
PLANTED_UNDEFINED = PLANTED_FINE + r"""
extern "C" __global__ void psparse_planted_undefined(float* x, long long n) {
    long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < n) x[j] = not_declared_anywhere;
}
"""

# the review's fault: the gather-and-zero kernel as it was, with CuPy's reserved name ``i``
PLANTED_RESERVED = ElementwiseSpec("psparse_planted_take", "int64 i",
                                   "raw float32 acc, float32 out",
                                   "out = acc[i]; acc[i] = 0.0f;")


@needs_nvrtc
def test_every_package_kernel_is_built_and_compiled_for_each_architecture():
    report = kernel_check.run()
    assert report.errors == [], "\n".join(report.lines)
    text = "\n".join(report.lines)
    for arch in kernel_check.ARCHS:
        assert f"{len(sources.CUDA_KERNELS)} kernels compiled to PTX for {arch}" in text


@needs_nvrtc
def test_the_gate_catches_an_undefined_identifier_and_names_its_kernel():
    source = CudaSource("planted", PLANTED_UNDEFINED,
                        ("psparse_planted_fine", "psparse_planted_undefined"))
    report = kernel_check.run(sources=[source], elementwise=[])
    assert report.errors, "\n".join(report.lines)
    assert all(e.startswith("psparse_planted_undefined: ") for e in report.errors), report.errors
    assert any("not_declared_anywhere" in e and "undefined" in e for e in report.errors)
    assert len(report.errors) == len(kernel_check.ARCHS)  # once per architecture


@needs_nvrtc
def test_the_gate_catches_a_reserved_parameter_name_and_names_its_kernel():
    fine = ElementwiseSpec("psparse_planted_scale", "float32 x, float32 w", "float32 y",
                           "y = x * w;")
    report = kernel_check.run(sources=[], elementwise=[fine, PLANTED_RESERVED])
    assert len(report.errors) == 1, report.lines
    assert report.errors[0].startswith("psparse_planted_take: ")
    assert "'i'" in report.errors[0]


@needs_nvrtc
def test_a_kernel_missing_from_its_source_is_caught():
    source = CudaSource("planted", PLANTED_FINE, ("psparse_planted_fine", "ghost"))
    report = kernel_check.run(sources=[source], elementwise=[])
    assert any(e.startswith("ghost: no extern") for e in report.errors), report.errors


def test_kernels_constructed_outside_the_registry_are_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "sources.py").write_text(
        "def build_cupy_kernels(cupy, source, names):\n"
        "    return {n: cupy.RawKernel(source, n) for n in names}\n")
    (package / "rogue.py").write_text(
        "import cupy\n\n"
        "def helper():\n"
        "    # cupy.RawKernel(...) in a comment is fine\n"
        "    return cupy.ElementwiseKernel('float32 x', 'float32 y', 'y = x', 'rogue')\n")
    found = kernel_check.constructions_outside_registry(package)
    assert found == ["pkg/rogue.py:5: return cupy.ElementwiseKernel('float32 x', 'float32 y', "
                     "'y = x', 'rogue')"]
    assert kernel_check.constructions_outside_registry() == []  # the package itself


def test_nvrtc_messages_are_mapped_to_the_kernel_holding_the_line():
    code = PLANTED_UNDEFINED
    line = code.splitlines().index("    if (j < n) x[j] = not_declared_anywhere;") + 1
    assert kernel_check.kernel_of_line(code, line) == "psparse_planted_undefined"
    assert kernel_check.kernel_of_line(code, 3) == "psparse_planted_fine"
    assert kernel_check.kernel_of_line(code, 1) == ""
