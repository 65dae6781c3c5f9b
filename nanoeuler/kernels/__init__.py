"""Hand-written CUDA kernels, loaded at run time with `cupy.RawModule`.

`*.cu` here are the float32 kernels that `kernels.ops` wraps behind the layers' own names and
signatures (`dispatch.ops_for(cupy)` hands it to the model); `bf16/` holds the bf16 training engine
(`bf16/engine.py`), its kernel families and their launchers, `decode/` the decode engine's. Each file's
header names its NumPy reference; `nanoeuler selftest` checks every kernel against it. CuPy is imported
only when a kernel is first asked for, so a CPU-only install never needs it. A module is compiled once
per process and device (NVRTC; CuPy also caches binaries on disk) from its text with the headers it
includes inlined (`source`). On a compute-capability-9.0 GPU (H100, H200) modules are built for sm_90a,
whose warpgroup instructions sit behind `#if defined(__CUDA_ARCH_FEAT_SM90_ALL)`; `has_sm90a()` tells the
host.

    >>> fn = kernel("elementwise", "swiglu_fwd")        # doctest: +SKIP
    >>> launch_per_item(fn, n, (g, u, h, np.int64(n)))  # doctest: +SKIP
"""

from __future__ import annotations

import re
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
# No fast-math: fp32 kernels are checked against float64 at 1e-5.
COMPILE_OPTIONS = ("-std=c++17",)

_MODULES: dict = {}
_FUNCTIONS: dict = {}
_INCLUDE = re.compile(r'^#include "([\w./]+\.cuh)"\s*$')


def sources() -> list[Path]:
    """Every .cu file of the package, the bf16 engine's in `bf16/` included (CI compiles each with nvcc)."""
    return sorted(KERNEL_DIR.rglob("*.cu"))


def source(name: str) -> str:
    """The text of `<name>.cu` with every `#include "x.cuh"` inlined (once each; the path relative to the
    including file, as nvcc reads it), so that the text CuPy compiles, and keys its cache by, holds the
    headers too."""
    path = KERNEL_DIR / f"{name}.cu"
    seen: set = set()

    def expand(p: Path) -> str:
        out = []
        for line in p.read_text(encoding="utf-8").splitlines():
            m = _INCLUDE.match(line)
            if line.strip() == "#pragma once":  # the inliner keeps headers single; NVRTC would warn
                continue
            if m is None:
                out.append(line)
            else:
                header = (p.parent / m.group(1)).resolve()
                if header not in seen:
                    seen.add(header)
                    out.append(expand(header))
        return "\n".join(out)

    return expand(path) + "\n"


def module(name: str, options: tuple = ()):
    """The compiled RawModule of `<name>.cu` (headers inlined: `source`) for the current device, with
    extra compiler `options` (the decode kernels' -D shape constants)."""
    import cupy

    dev = cupy.cuda.Device().id
    key = (name, dev, options)
    mod = _MODULES.get(key)
    if mod is None:
        code = source(name)
        # CuPy appends its own -arch=sm_90; NVRTC then builds for the sm_90a named here
        extra = ("-arch=sm_90a",) if has_sm90a() else ()
        mod = cupy.RawModule(code=code, options=COMPILE_OPTIONS + tuple(options) + extra)
        _MODULES[key] = mod
    return mod


def has_sm90a() -> bool:
    """Whether kernels are built for sm_90a (the current device has compute capability 9.0)."""
    import cupy

    return cupy.cuda.Device().compute_capability == "90"


def kernel(file: str, name: str, options: tuple = ()):
    """The kernel `name` of `<file>.cu` (`file` relative to this folder, e.g. "bf16/norms")."""
    import cupy

    key = (file, name, cupy.cuda.Device().id, options)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        fn = _FUNCTIONS[key] = module(file, options).get_function(name)
    return fn


def device_arch() -> str:
    """'sm_90' for an H100/H200: what NVRTC compiles for on the current device."""
    import cupy

    return "sm_" + cupy.cuda.Device().compute_capability


KERNEL_PATHS = ("auto", "portable")


def kernel_path_options(path: str = "auto") -> dict:
    """The bf16 `TrainEngine`'s keyword arguments for a kernel path (config key `<stage>.kernels`; the
    environment variable NANOEULER_KERNELS, when set, wins).

    "auto" takes the fastest kernels the GPU runs: on Hopper (sm_90a) the warpgroup (wgmma) attention
    and the TMA-fed GEMMs with SwiGLU and RoPE inside. "portable" uses only what every GPU from sm_80
    on has (mma.sync, ldmatrix, cp.async; SwiGLU and RoPE as kernels of their own), which is what an
    RTX 4070 (sm_89) runs; on a Hopper GPU it measures that path.

        >>> kernel_path_options("portable")   # with NANOEULER_KERNELS unset   # doctest: +SKIP
        {'attention': 'ldm', 'fuse_swiglu': False, 'fuse_rope': False}
    """
    import os

    from nanoeuler.errors import UserError

    choice = os.environ.get("NANOEULER_KERNELS") or path
    if choice not in KERNEL_PATHS:
        raise UserError(
            f"kernel path {choice!r} is not one of {', '.join(KERNEL_PATHS)}"
            + (" (from NANOEULER_KERNELS)" if os.environ.get("NANOEULER_KERNELS") else "")
        )
    return {} if choice == "auto" else {"attention": "ldm", "fuse_swiglu": False, "fuse_rope": False}


def launch_per_item(fn, n: int, args: tuple, threads: int = 256) -> None:
    """Run `fn` with one thread per item of `n` (a 1-D grid of `threads`-wide blocks)."""
    if n <= 0:
        return
    fn(((n + threads - 1) // threads,), (threads,), args)
