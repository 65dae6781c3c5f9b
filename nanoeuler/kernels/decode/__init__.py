"""The decode engine's kernels (`infer/gpu.py` runs them): one `.cu` file per family over the shared
`decode.cuh`, and beside each a `.py` file of named launchers.

    >>> FAMILY_OF["attend_o_cluster_bf16"], FAMILY_OF["tgemv_rope_c4"], len(FAMILIES["gemv"])
    ('attend_o', 'tgemv', 24)

Families: `gemv` (a few rows on float FMAs: the products with their epilogues, RoPE and the cache write,
head 0 with its argmax), `tgemv` (2 to 16 rows on the tensor cores, bf16 weights), `attend` (attention of
rows over the cache), `attend_o` (the one-row step's attention with the o projection), `mlp` (the
one-row step's MLP in one kernel), `elementwise` (the embedding; the cuBLAS path's norm, RoPE and SwiGLU)
and `sampling` (argmax, the steps that feed themselves, sampling). Most kernels come per weight storage
(`_bf16`, `_f32`). `plan.py` owns the shape constants, which every module is compiled with (-D), and the
host's choices; it needs no GPU.
"""

from __future__ import annotations

import functools

from nanoeuler.kernels.decode.plan import STORAGES, UNROLLS, defines, smem_opt_in, suffix

_SUFFIXES = tuple(suffix(s) for s in STORAGES)


def _per_storage(*stems: str) -> tuple[str, ...]:
    return tuple(f"{stem}_{s}" for s in _SUFFIXES for stem in stems)


FAMILIES = {
    "gemv": _per_storage(
        *(
            f"{e}_u{u}"
            for u in UNROLLS
            for e in ("gemv_store", "gemv_store2", "gemv_add", "gemv_swiglu", "gemv_rope", "head_argmax")
        )
    ),
    "tgemv": ("tgemv_store_c4", "tgemv_add_c4", "tgemv_store_c8", "tgemv_add_c8", "tgemv_swiglu_c4", "tgemv_rope_c4"),
    "attend": _per_storage("attend", "attend_act", "attend_kv_act"),
    "attend_o": _per_storage("attend_o", "attend_o_cluster"),
    "mlp": _per_storage(*(f"swiglu_down_u{u}_r1" for u in UNROLLS)),
    "elementwise": _per_storage("embed", "rope_cache", "rmsnorm_act", "swiglu_act"),
    "sampling": ("argmax_rows", "argmax_chain", "accept_chain", "sample_rows"),
}
FAMILY_OF = {name: family for family, names in FAMILIES.items() for name in names}


def decode_kernel(name: str):
    """The kernel `name` from its family's file, compiled with the plan's shape constants."""
    from nanoeuler.kernels import kernel

    return kernel(f"decode/{FAMILY_OF[name]}", name, options=defines())


def kernel_names(dtype: str) -> list[str]:
    """Every kernel a backend of this weight storage may launch: its storage's, and those of none."""
    other = tuple(f"_{s}" for s in _SUFFIXES if s != suffix(dtype))
    return [n for n in FAMILY_OF if not n.endswith(other) and (dtype == "bf16" or FAMILY_OF[n] != "tgemv")]


class Launch:
    """Launches decode kernels on one stream: `launch(name, grid, block, args, shared_mem, pdl)`, with
    programmatic dependent launch where `pdl` (a `kernels.pdl.PdlLauncher`) is given. The launchers
    beside each family take one as their first argument; `dtype` names their kernels' storage."""

    def __init__(self, dtype: str, stream=None, pdl=None):
        self.dtype, self.suffix, self.stream, self.pdl = dtype, suffix(dtype), stream, pdl
        self._fns: dict = {}
        self._allowed: dict = {}  # name -> the most dynamic shared memory already checked (and allowed)

    def load(self) -> None:
        """Compile and look up every kernel of the storage now, not at the first launch."""
        for name in kernel_names(self.dtype):
            self.fn(name)

    def fn(self, name: str):
        fn = self._fns.get(name)
        if fn is None:
            fn = self._fns[name] = decode_kernel(name)
        return fn

    def launch(self, name: str, grid, block, args, shared_mem: int = 0, pdl: bool = True) -> None:
        if shared_mem > self._allowed.get(name, 0):
            self._allow_shared(name, shared_mem)
        if self.pdl is not None and pdl:
            self.pdl(self.fn(name), grid, block, args, shared_mem=shared_mem, stream=self.stream)
        else:
            self.fn(name)(grid, block, args, shared_mem=shared_mem, stream=self.stream)

    def _allow_shared(self, name: str, smem: int) -> None:
        """Let kernel `name` take `smem` bytes of dynamic shared memory where that is past the default 48 KB
        (a wide model: a few-row product over a hidden of 3072, `swiglu_down` past a width of ~1,800): a
        driver attribute of the kernel, set once per size before its first such launch (a graph capture sees
        it too); past the card's opt-in maximum, one UserError line."""
        fn = self.fn(name)
        allow = smem_opt_in(
            f"{name} ({smem:,} bytes of dynamic shared memory)", smem, fn.shared_size_bytes, card_max_smem()
        )
        if allow and fn.max_dynamic_shared_size_bytes < allow:
            fn.max_dynamic_shared_size_bytes = allow
        self._allowed[name] = smem


def card_max_smem() -> int:
    """The current GPU's most shared memory a block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin)."""
    import cupy

    return _opt_in_max(cupy.cuda.Device().id)


@functools.cache
def _opt_in_max(device: int) -> int:
    import cupy

    return cupy.cuda.Device(device).attributes["MaxSharedMemoryPerBlockOptin"]
