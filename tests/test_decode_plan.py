"""The decode engine's plan (`kernels/decode/plan.py`) on the CPU: the shape constants agree with the kernels'
header, the variants follow the model and the GPU, and the grids and shared memory it gives fit the kernels
that exist."""

import re

import pytest

from nanoeuler.errors import UserError
from nanoeuler.kernels import KERNEL_DIR
from nanoeuler.kernels.decode import FAMILIES, FAMILY_OF, Launch, kernel_names, plan
from nanoeuler.model.config import ModelConfig

HEADER = KERNEL_DIR / "decode" / "decode.cuh"


def test_header_defaults_equal_the_plans_constants():
    """Plain nvcc (CI, make compile-kernels) compiles with decode.cuh's #ifndef defaults, the runtime with
    plan.defines(): both must be the same numbers, for exactly the same names."""
    text = HEADER.read_text()
    defaults = dict(re.findall(r"^#ifndef (\w+)\n#define \1 (\d+)\b", text, flags=re.M))
    assert set(defaults) == set(plan.DEFINES)
    assert {name: int(v) for name, v in defaults.items()} == {name: getattr(plan, name) for name in plan.DEFINES}
    assert plan.defines() == tuple(f"-D{name}={getattr(plan, name)}" for name in plan.DEFINES)
    # no family file defines a constant of its own behind the header's back
    for cu in (KERNEL_DIR / "decode").glob("*.cu"):
        defined = set(re.findall(r"^#define (\w+)", cu.read_text(), flags=re.M))
        assert not defined & set(plan.DEFINES), cu.name


def test_every_constant_is_used_by_a_kernel_or_its_launcher():
    kernels = "".join(p.read_text() for p in (KERNEL_DIR / "decode").glob("*.cu"))
    for name in plan.DEFINES:
        assert re.search(rf"\b{name}\b", kernels), name


def _cfg(**kw):
    base = dict(vocab_size=300, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ctx_len=48, mtp_heads=4)
    return ModelConfig(**{**base, **kw})


def test_variants_follow_the_model_and_the_gpu():
    gpu = ModelConfig.named("gpu")  # head_dim 64, 12 query heads on 4 key/value heads
    v = plan.choose_variants(gpu, "bf16", cc=90)
    assert (v.tensor_cores, v.attend_cluster, v.fuse_argmax, v.attend_kv, v.flash) == (True, True, True, True, "wg")
    assert v.alone_keys == plan.ALONE_KEYS
    ada = plan.choose_variants(gpu, "bf16", cc=89)  # no clusters, no wgmma
    assert (ada.attend_cluster, ada.flash, ada.attend_kv) == (False, "ldm", True)
    assert plan.choose_variants(gpu, "fp32", cc=90).flash is None  # the tensor-core attention reads bf16
    # head_dim 16: neither the tensor-core attention (32, 64) nor wgmma (64)
    assert plan.choose_variants(_cfg(n_heads=8, n_kv_heads=2), "bf16", cc=90).flash is None
    # float32 cache, head_dim 256: 64 lanes a key, more than a warp; no cluster, no attend_kv
    wide = plan.choose_variants(_cfg(dim=512, n_heads=2, n_kv_heads=1), "fp32", cc=90)
    assert (wide.attend_cluster, wide.attend_kv) == (False, False)
    # 8 query heads a key/value head: more than attend_kv holds
    assert not plan.choose_variants(_cfg(dim=256, n_heads=8, n_kv_heads=1), "bf16", cc=90).attend_kv


@pytest.mark.parametrize(
    "kw,dtype,match",
    [
        ({}, "fp16", "dtype must be bf16 or fp32"),
        ({"vocab_size": 70000}, "bf16", "vocabularies of up to 65536"),
        ({"dim": 132, "n_heads": 2, "n_kv_heads": 1}, "bf16", "divisible by 8"),
    ],
)
def test_unsupported_models_are_one_clear_error(kw, dtype, match):
    with pytest.raises(ValueError, match=match):
        plan.choose_variants(_cfg(**kw), dtype, cc=90)


def test_gemv_unroll_covers_a_row_and_names_a_kernel():
    assert [plan.gemv_unroll(K, "bf16") for K in (768, 1024, 1025, 2048)] == [4, 4, 8, 8]
    assert [plan.gemv_unroll(K, "fp32") for K in (512, 513)] == [4, 8]
    for dtype in plan.STORAGES:
        s = plan.suffix(dtype)
        for K in (64, 341, 768, 2048, 4096):
            u = plan.gemv_unroll(K, dtype)
            assert u in plan.UNROLLS and f"gemv_store_u{u}_{s}" in FAMILY_OF and f"swiglu_down_u{u}_r1_{s}" in FAMILY_OF


def test_tensor_core_chunks_name_a_kernel_that_covers_k():
    """tgemv needs K % 32 == 0 and K <= 32 * TC_WARPS * chunks; the paired epilogues exist with 4 chunks only."""
    assert plan.tc_chunks(1, 768, "bf16") == 0 and plan.tc_chunks(17, 768, "bf16") == 0  # one row; cuBLAS rows
    assert plan.tc_chunks(4, 768, "fp32") == 0 and plan.tc_chunks(4, 770, "bf16") == 0
    assert plan.tc_chunks(4, 768, "bf16", tensor_cores=False) == 0
    assert plan.tc_chunks(4, 2048, "bf16", paired=True) == 0  # 8 chunks: the float GEMV
    for M in (2, 16):
        for K in range(32, 4096 + 1, 32):
            for paired, stem in ((False, "add"), (True, "swiglu")):
                ch = plan.tc_chunks(M, K, "bf16", paired=paired)
                if ch:
                    assert f"tgemv_{stem}_c{ch}" in FAMILIES["tgemv"] and K <= 32 * plan.TC_WARPS * ch
                else:
                    assert K > 32 * plan.TC_WARPS * (4 if paired else 8)


def test_grids_and_shared_memory():
    assert plan.gemv_smem(1, 768) == 4 * 768 and plan.gemv_smem(16, 768) == 4 * plan.GEMV_ROWS * 768
    # attend_o: 8 splits of W_o while M * H * splits blocks fit 132 multiprocessors, then halves
    assert [plan.attend_o_splits(M, 12, 132) for M in (1, 2, 4, 16)] == [8, 4, 2, 1]
    assert plan.attend_smem(512, "bf16") == 4 * (512 + plan.ATTEND_THREADS * 9)
    # attend_kv, gpu preset: 8 warps' partials, 3 query heads of (64 outputs, max, sum)
    assert plan.kv_smem(12, 4, 64) == 4 * 3 * 8 * 66
    # swiglu_down at C 768, bf16: the row of x, then 256 rows of 16 W_down values past the block's 512 threads
    assert plan.mlp_smem(768, "bf16") == 4 * 768 + 256 * 16 * 2
    assert plan.mlp_smem(341, "fp32") == 4 * 344


def test_swiglu_down_opts_in_to_the_shared_memory_of_a_wide_model_and_refuses_past_the_card():
    """A block past the default 48 KB (static bytes included) needs its kernel's limit raised to what the launch
    asks; one past the card's opt-in maximum is refused in one line."""
    static, h100, rtx4090 = 192, 232448, 101376  # swiglu_down's own; cudaDevAttrMaxSharedMemoryPerBlockOptin
    widths = {
        dtype: [C for C in range(64, 4096, 8) if plan.mlp_smem(C, dtype) + static > plan.SMEM_DEFAULT]
        for dtype in plan.STORAGES
    }
    assert widths["bf16"][0] == 1816 and widths["fp32"][0] == 1208  # the first widths that need more
    assert plan.smem_opt_in("swiglu_down", plan.mlp_smem(1808, "bf16"), static, h100) == 0
    for dtype, need in (("bf16", 4 * 2048 + 1536 * 16 * 2), ("fp32", 4 * 2048 + 1536 * 16 * 4)):
        assert plan.mlp_smem(2048, dtype) == need
        assert plan.smem_opt_in("swiglu_down", need, static, h100) == need
    assert plan.smem_opt_in("swiglu_down", plan.mlp_smem(2048, "bf16"), static, rtx4090) == 57344
    with pytest.raises(UserError) as exc:
        plan.smem_opt_in("swiglu_down at width 2048 (fp32)", plan.mlp_smem(2048, "fp32"), static, rtx4090)
    msg = str(exc.value)
    assert "swiglu_down at width 2048 (fp32) needs 106,688 bytes" in msg and "allows 101,376" in msg
    assert "\n" not in msg


class _Kernel:
    """A CuPy RawKernel as `decode.Launch` sees it: its static shared bytes, the driver's limit on the dynamic
    ones (the default 48 KB less the static), and a call that records the limit at the moment of launch."""

    shared_size_bytes = 192
    max_dynamic_shared_size_bytes = 48 * 1024 - 192

    def __init__(self, launches):
        self.launches = launches

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        self.launches.append((shared_mem, self.max_dynamic_shared_size_bytes))


class _Launch(Launch):
    """`decode.Launch` over stand-in kernels (no GPU): the real `launch`, with its shared-memory opt-in."""

    def __init__(self, dtype):
        super().__init__(dtype)
        self.launches = []
        self.kernel = _Kernel(self.launches)

    def fn(self, name):
        return self.kernel


@pytest.mark.parametrize("card", [232448, 101376])  # an H100's opt-in maximum, an RTX 4090's
def test_a_launch_past_48_kb_raises_the_kernels_limit_first_and_refuses_past_the_card(monkeypatch, card):
    import nanoeuler.kernels.decode as decode
    from nanoeuler.kernels.decode import mlp

    monkeypatch.setattr(decode, "card_max_smem", lambda: card)
    for C, dtype in ((768, "bf16"), (2048, "bf16"), (2048, "fp32")):
        go, smem = _Launch(dtype), plan.mlp_smem(C, dtype)
        if smem + 192 > card:
            with pytest.raises(
                UserError, match=r"swiglu_down_u\d+_r1_f32 \(106,496 bytes of dynamic shared memory\) needs"
            ):
                mlp.swiglu_down(go, None, None, None, None, None, 4 * C, C, 1e-5)
            assert go.launches == []
            continue
        mlp.swiglu_down(go, None, None, None, None, None, 4 * C, C, 1e-5)
        mlp.swiglu_down(go, None, None, None, None, None, 4 * C, C, 1e-5)  # the second asks nothing new
        assert go.launches == [(smem, smem if C == 2048 else 48 * 1024 - 192)] * 2  # raised only where needed


def test_each_storage_loads_its_own_kernels():
    bf16, f32 = set(kernel_names("bf16")), set(kernel_names("fp32"))
    assert {"tgemv_rope_c4", "gemv_rope_u8_bf16", "sample_rows"} <= bf16 and not any(n.endswith("_f32") for n in bf16)
    assert "gemv_rope_u8_f32" in f32 and not f32 & set(FAMILIES["tgemv"]) and "sample_rows" in f32
    assert bf16 | f32 == set(FAMILY_OF)
