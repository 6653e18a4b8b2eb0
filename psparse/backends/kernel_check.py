"""The GPU-less kernel gate: build every CuPy kernel psparse defines and compile its CUDA C.

A GPU kernel that fails to build fails on its first launch, on the GPU machine, in the middle of
a run. This gate finds such faults on a machine with no GPU and no driver (CI):

1. every kernel object is constructed the way the runtime constructs it
   (``kernels.build_cupy_kernels``): CuPy checks names and parameter lists there, e.g. it
   refuses an ElementwiseKernel parameter named ``i``, ``n`` or ``_ind`` (reserved names);
2. every CUDA C source the package can launch is compiled to PTX with NVRTC for each
   architecture claimed (``ARCHS``), and each kernel must appear as an entry in the PTX.
   NVRTC needs neither a GPU nor a driver; CuPy's own compile helpers do, so NVRTC is called
   through ``cupy_backends.cuda.libs.nvrtc`` directly;
3. no CuPy kernel is constructed anywhere in the package except through the registry above,
   so nothing can escape steps 1 and 2.

Errors name the kernel (an NVRTC message is mapped to the kernel whose body holds the line).

    python -m psparse.backends.kernel_check          # or: make check-kernels (installs CuPy and NVRTC)
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..ops import sources

# compute_90: the H100/H200 machines; compute_75 (Turing): the oldest CUDA 13 supports
ARCHS = ("compute_75", "compute_90")
PACKAGE = Path(__file__).resolve().parents[1]  # psparse/: the gate scans the whole package
# the one place a CuPy kernel object may be constructed (see step 3)
REGISTRY = ("sources.py", "build_cupy_kernels")
_CONSTRUCTOR = re.compile(r"\b(ElementwiseKernel|ReductionKernel|RawKernel|RawModule)\s*\(")
_KERNEL_START = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(')


@dataclass
class CudaSource:
    """A CUDA C text and the kernels (``extern "C" __global__``) launched from it."""

    name: str
    code: str
    kernels: tuple[str, ...]


@dataclass
class ElementwiseSpec:
    """An ``ElementwiseKernel``'s arguments, for kernels CuPy generates the CUDA C of."""

    name: str
    in_params: str
    out_params: str
    operation: str
    preamble: str = ""


@dataclass
class Report:
    errors: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    def ok(self, text: str) -> None:
        self.lines.append(f"ok    {text}")

    def fail(self, text: str) -> None:
        self.errors.append(text)
        self.lines.append(f"FAIL  {text}")


def package_sources() -> list[CudaSource]:
    """Every CUDA C source in the package with the kernels the runtime launches from it (the
    backends build exactly these: psparse.backends.cuda.SOURCES)."""
    from ..ops.sources import RADIX_SOURCE, VALUES_SOURCE
    return [CudaSource("psparse/ops/feedback/elementwise.cu", sources.CUDA_SOURCE,
                       tuple(sources.CUDA_KERNELS)),
            CudaSource("psparse/ops/select/radix.cu", RADIX_SOURCE,
                       tuple(sources.kernel_signatures(RADIX_SOURCE))),
            CudaSource("psparse/ops/values/values.cu", VALUES_SOURCE,
                       tuple(sources.kernel_signatures(VALUES_SOURCE)))]


def package_elementwise() -> list[ElementwiseSpec]:
    """ElementwiseKernels the package defines: none today (all kernels are raw CUDA C, so NVRTC
    compiles all of them); the gate still checks any that are added here."""
    return []


def kernel_of_line(code: str, line: int) -> str:
    """The kernel whose definition holds 1-based ``line`` of ``code`` ("" before the first)."""
    owner = ""
    for number, text in enumerate(code.splitlines(), 1):
        if number > line:
            break
        match = _KERNEL_START.search(text)
        if match:
            owner = match.group(1)
    return owner


def _nvrtc_errors(code: str, log: str) -> list[str]:
    """NVRTC's log as one message per error, each prefixed with the kernel it is in."""
    out = []
    for text in log.splitlines():
        match = re.match(r".*?\((\d+)\): (error|catastrophic error)\b.*", text)
        if match:
            kernel = kernel_of_line(code, int(match.group(1))) or "(outside any kernel)"
            out.append(f"{kernel}: {text.strip()}")
    return out or [f"(unknown kernel): {log.strip()}"]


def compile_ptx(code: str, arch: str, filename: str = "psparse_kernels.cu") -> tuple[str, list]:
    """NVRTC: (PTX, []) on success, ("", [error, ...]) naming the kernels on failure."""
    from cupy_backends.cuda.libs import nvrtc
    program = nvrtc.createProgram(code, filename, [], [])
    try:
        try:
            nvrtc.compileProgram(program, [f"--gpu-architecture={arch}"])
        except nvrtc.NVRTCError:
            return "", _nvrtc_errors(code, nvrtc.getProgramLog(program))
        ptx = nvrtc.getPTX(program)
        return (ptx.decode() if isinstance(ptx, bytes) else ptx).rstrip("\0"), []
    finally:
        nvrtc.destroyProgram(program)


def check_source(source: CudaSource, report: Report, archs=ARCHS) -> None:
    import cupy
    signatures = sources.kernel_signatures(source.code)
    for name in source.kernels:
        if name not in signatures:
            report.fail(f"{name}: no extern \"C\" __global__ function of that name in "
                        f"{source.name}")
    for name, signature in signatures.items():
        unknown = [f"{ctype} {pname}" for ctype, pname in signature if ctype not in sources.C_TYPES]
        if unknown:  # launches are checked against these types (sources.check_launch)
            report.fail(f"{name}: parameter type not in sources.C_TYPES: {', '.join(unknown)}")
    try:
        sources.build_cupy_kernels(cupy, source.code, source.kernels)
        report.ok(f"{source.name}: constructed {', '.join(source.kernels)}")
    except Exception as exc:  # CuPy's checks at construction
        report.fail(f"{source.name}: constructing the kernels failed: {exc}")
    for arch in archs:
        ptx, errors = compile_ptx(source.code, arch)
        for error in errors:
            report.fail(f"{error} [{arch}]")
        if errors:
            continue
        entries = set(re.findall(r"\.entry\s+(\w+)\s*\(", ptx))
        missing = [name for name in source.kernels if name not in entries]
        for name in missing:
            report.fail(f"{name}: compiled for {arch} but not in the PTX's entries")
        if not missing:
            report.ok(f"{source.name}: {len(source.kernels)} kernels compiled to PTX for {arch} "
                      f"({len(ptx):,} characters)")


def check_elementwise(spec: ElementwiseSpec, report: Report) -> None:
    """Construct it as the runtime would (CuPy's parameter checks run here). Its body is only
    compiled by CuPy at the first launch, from code CuPy generates: this gate cannot reach that
    code without a device, so an ElementwiseKernel gets constructed, not compiled."""
    import cupy
    try:
        cupy.ElementwiseKernel(spec.in_params, spec.out_params, spec.operation, spec.name,
                               preamble=spec.preamble)
        report.ok(f"{spec.name}: ElementwiseKernel constructed (not compiled: CuPy generates "
                  f"its CUDA C at the first launch)")
    except Exception as exc:
        report.fail(f"{spec.name}: {exc}")


def constructions_outside_registry(root: Path = PACKAGE) -> list[str]:
    """file:line of every CuPy kernel constructed outside ``kernels.build_cupy_kernels``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.resolve() == Path(__file__).resolve():
            continue  # this file constructs what it checks
        function = ""
        for number, text in enumerate(path.read_text().splitlines(), 1):
            match = re.match(r"\s*def (\w+)", text)
            if match and not text.startswith(" " * 8):
                function = match.group(1)
            if _CONSTRUCTOR.search(text.split("#")[0]) and not text.lstrip().startswith(('"', "'")):
                if (path.name, function) != REGISTRY:
                    found.append(f"{path.relative_to(root.parent)}:{number}: {text.strip()}")
    return found


def run(sources=None, elementwise=None, archs=ARCHS, root: Path = PACKAGE) -> Report:
    report = Report()
    try:
        import cupy  # noqa: F401
        from cupy_backends.cuda.libs import nvrtc
        version = nvrtc.getVersion()
    except Exception as exc:
        report.fail(f"CuPy with NVRTC is needed ({exc}); `make check-kernels` installs "
                    f"cupy-cuda13x and nvidia-cuda-nvrtc")
        return report
    report.ok(f"NVRTC {version[0]}.{version[1]}")
    for source in package_sources() if sources is None else sources:
        check_source(source, report, archs)
    for spec in package_elementwise() if elementwise is None else elementwise:
        check_elementwise(spec, report)
    stray = constructions_outside_registry(root)
    for where in stray:
        report.fail(f"kernel constructed outside {'.'.join(REGISTRY)} (the gate cannot see "
                    f"it): {where}")
    if not stray:
        report.ok("no CuPy kernel constructed outside the registry")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m psparse.backends.kernel_check",
        description="Build every CuPy kernel psparse defines and compile its CUDA C to PTX "
                    "with NVRTC (no GPU or driver needed). Exit status 1 on any fault.")
    parser.add_argument("--arch", action="append", metavar="compute_XY",
                        help=f"virtual architecture to compile for (repeatable; default "
                             f"{' and '.join(ARCHS)})")
    args = parser.parse_args(argv)
    report = run(archs=tuple(args.arch) if args.arch else ARCHS)
    print("\n".join(report.lines))
    print(f"kernel check: {len(report.errors)} fault(s)")
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
