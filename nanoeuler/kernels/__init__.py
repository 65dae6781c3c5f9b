"""Hand-written CUDA kernels for the GPU engine, loaded at run time with `cupy.RawModule`.

Each `*.cu` file in this folder is one module of `extern "C"` kernels; its header comment names the
NumPy layer in `nanoeuler.model.layers` (or `nanoeuler.optim`) that is its reference. `nanoeuler.kernels.ops`
wraps them behind the same function names and signatures as the layers, and `nanoeuler selftest` checks
every kernel against its reference.

CuPy is imported only when a kernel is first asked for, so importing this package on a CPU-only install
costs nothing. Modules are compiled once per process and device (NVRTC, for the device's own
architecture; CuPy also keeps compiled binaries in its on-disk kernel cache). On a Hopper GPU
(compute capability 9.0) they are built for sm_90a, the target that has the warpgroup instructions
(wgmma); code that needs them sits behind `#if defined(__CUDA_ARCH_FEAT_SM90_ALL)`, and
`has_sm90a()` tells the host whether it was built.

    >>> fn = kernel("elementwise", "swiglu_fwd")        # doctest: +SKIP
    >>> launch(fn, n, (g, u, h, np.int64(n)))           # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
# No fast-math: fp32 kernels are checked against float64 at 1e-5.
COMPILE_OPTIONS = ("-std=c++17",)

_MODULES: dict = {}


def sources() -> list[Path]:
    """Every .cu file of the package (CI compiles each with nvcc)."""
    return sorted(KERNEL_DIR.glob("*.cu"))


def module(name: str):
    """The compiled RawModule of `<name>.cu` for the current device."""
    import cupy

    dev = cupy.cuda.Device().id
    key = (name, dev)
    mod = _MODULES.get(key)
    if mod is None:
        code = (KERNEL_DIR / f"{name}.cu").read_text(encoding="utf-8")
        # CuPy appends its own -arch=sm_90; NVRTC then builds for the sm_90a named here
        extra = ("-arch=sm_90a",) if has_sm90a() else ()
        mod = cupy.RawModule(code=code, options=COMPILE_OPTIONS + extra)
        _MODULES[key] = mod
    return mod


def has_sm90a() -> bool:
    """Whether kernels are built for sm_90a (the current device has compute capability 9.0)."""
    import cupy

    return cupy.cuda.Device().compute_capability == "90"


def kernel(file: str, name: str):
    """The kernel `name` of `<file>.cu`."""
    return module(file).get_function(name)


def device_arch() -> str:
    """'sm_90' for an H100/H200: what NVRTC compiles for on the current device."""
    import cupy

    return "sm_" + cupy.cuda.Device().compute_capability


KERNEL_PATHS = ("auto", "portable")


def kernel_path_options(path: str = "auto") -> dict:
    """The bf16 `Engine`'s keyword arguments for a kernel path (config key `<stage>.kernels`; the
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
        raise UserError(f"kernel path {choice!r} is not one of {', '.join(KERNEL_PATHS)}"
                         + (" (from NANOEULER_KERNELS)" if os.environ.get("NANOEULER_KERNELS") else ""))
    return {} if choice == "auto" else {"attention": "ldm", "fuse_swiglu": False, "fuse_rope": False}


def launch(fn, n: int, args: tuple, threads: int = 256) -> None:
    """Run `fn` with one thread per item of `n` (a 1-D grid of `threads`-wide blocks)."""
    if n <= 0:
        return
    fn(((n + threads - 1) // threads,), (threads,), args)
