"""Every CUDA kernel file compiles with nvcc (CI has nvcc but no GPU), and every kernel the Python
wrappers launch exists in its file."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from nanoeuler.kernels import COMPILE_OPTIONS, KERNEL_DIR, sources

NVCC = shutil.which("nvcc")


def test_there_are_kernel_files():
    names = {p.stem for p in sources()}
    assert {"attention", "rmsnorm", "elementwise", "cross_entropy", "adamw"} <= names


def _targets():  # sm_90 and sm_89 (the portable kernel path's RTX 4070) for every file; also sm_90a
    for path in sources():  # (wgmma) for files with code behind its feature macro
        yield pytest.param(path, "sm_90", id=f"{path.name}-sm_90")
        yield pytest.param(path, "sm_89", id=f"{path.name}-sm_89")
        if "__CUDA_ARCH_FEAT_SM90_ALL" in path.read_text():
            yield pytest.param(path, "sm_90a", id=f"{path.name}-sm_90a")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("path,arch", list(_targets()))
def test_cu_file_compiles(path, arch, tmp_path):
    target = f"-gencode=arch=compute_{arch[3:]},code={arch}"
    out = subprocess.run(
        [NVCC, target, *COMPILE_OPTIONS, "-c", "-o", str(tmp_path / "k.o"), str(path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


# an entry point: extern "C" __global__ void, launch bounds or a macro of attributes (GEMV_BOUNDS), the name
_EXTERN = re.compile(r'extern "C" __global__ void (?:(?:__launch_bounds__\([^)]*\)|[A-Z][A-Z_]+) )*(\w+)\(')


def _extern_kernels(path: Path) -> set[str]:
    text = path.read_text()
    names = set(_EXTERN.findall(text))
    # macro-generated families: FLASH_KERNELS(D, ...) defines flash_{fwd,bwd_dkdv,bwd_dq}_d{D}
    for d in re.findall(r"^FLASH_KERNELS\((\d+),", text, flags=re.M):
        names |= {f"flash_fwd_d{d}", f"flash_bwd_dkdv_d{d}", f"flash_bwd_dq_d{d}"}
    # FLASH_MMA_KERNELS(D) (bf16/flash_mma.cu): flash_{fwd,bwd_dkdv,bwd_dq}_{mma,ldm}_d{D}
    for d in re.findall(r"^FLASH_MMA_KERNELS\((\d+)\)", text, flags=re.M):
        names |= {f"flash_{k}_{v}_d{d}" for k in ("fwd", "bwd_dkdv", "bwd_dq") for v in ("mma", "ldm")}
    # RMSNORM_BWD(name, DY) (bf16/norms.cu): one kernel per storage type of dy (NAME: the macro's own body)
    names.discard("NAME")
    names |= set(re.findall(r"^RMSNORM_BWD\((\w+),", text, flags=re.M))
    return names


def test_every_launched_kernel_is_defined():
    defined = {str(p.relative_to(KERNEL_DIR).with_suffix("")): _extern_kernels(p) for p in sources()}
    wanted = []
    for py in KERNEL_DIR.rglob("*.py"):
        wanted += re.findall(r'kernel\("([\w/]+)", "(\w+)"\)', py.read_text())
        for file, stem in re.findall(r'kernel\("(\w+)", f"(\w+)_d\{D\}"\)', py.read_text()):
            if file == "attention":  # the float32 kernels: every head size of ops.py's _FLASH
                ops_text = (KERNEL_DIR / "ops.py").read_text()
                sizes = re.findall(r"(\d+): \(", re.search(r"_FLASH = \{([^}]*)\}", ops_text).group(1))
            else:  # the tensor-core kernels of bf16/flash_*.cu: the engine's MMA_HEAD_DIMS
                plan_text = (KERNEL_DIR / "bf16" / "plan.py").read_text()
                sizes = re.findall(r"\d+", re.search(r"MMA_HEAD_DIMS = \(([^)]*)\)", plan_text).group(1))
            wanted += [(file, f"{stem}_d{d}") for d in sizes]
    assert len(wanted) > 10
    missing = [f"{f}.cu:{n}" for f, n in wanted if n not in defined.get(f, set())]
    assert not missing, missing


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_tma_kernels_acquire_their_tensor_maps(tmp_path):
    """Each sm_90a kernel that copies through a tensor map (cp.async.bulk.tensor) first fences its view of
    the map (fence.proxy.tensormap acquire): the maps are bytes the host wrote into global memory."""
    path = KERNEL_DIR / "bf16" / "gemm_tma.cu"
    ptx = tmp_path / "gemm_tma.ptx"
    out = subprocess.run(
        [NVCC, "-gencode=arch=compute_90a,code=sm_90a", *COMPILE_OPTIONS, "-ptx", "-o", str(ptx), str(path)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    entries = re.split(r"\.entry ", ptx.read_text())[1:]
    tma = {e.split("(", 1)[0]: e for e in entries if "cp.async.bulk.tensor" in e}
    assert {"swiglu_fwd_gemm", "swiglu_bwd_gemm"} <= set(tma)
    unfenced = [name for name, body in tma.items() if "fence.proxy.tensormap::generic.acquire" not in body]
    assert not unfenced, unfenced


def test_loader_inlines_each_included_header_once():
    """What NVRTC compiles (and CuPy's cache keys by) is a family's text with its headers inlined: no
    #include left, each header's text once, even where two headers include a third."""
    from nanoeuler.kernels import source

    text = source("bf16/flash_wg")
    assert "#include" not in text and "#pragma once" not in text
    common = (KERNEL_DIR / "bf16" / "common.cuh").read_text()
    assert text.count("typedef unsigned short bf16;") == 1 and "typedef unsigned short bf16;" in common
    for header in ("mma.cuh", "wgmma.cuh"):
        body = (KERNEL_DIR / "bf16" / header).read_text().split('#include "common.cuh"\n', 1)[1]
        assert text.count(body.strip()[:200]) == 1, header
    assert source("attention") == (KERNEL_DIR / "attention.cu").read_text().rstrip("\n") + "\n"


def test_every_decode_kernel_is_defined_and_launched():
    """decode.FAMILIES is exactly what each family's file defines, every name written out where grep finds
    it; every name a launcher of kernels/decode/ forms (`go.launch(f"gemv_{epi}_u{...}_{go.suffix}", ...)`)
    is in the table, and every kernel of the table has a launcher."""
    from nanoeuler.kernels.decode import FAMILIES

    folder = KERNEL_DIR / "decode"
    assert {p.stem for p in folder.glob("*.cu")} == set(FAMILIES)
    for family, names in FAMILIES.items():
        text = (folder / f"{family}.cu").read_text()
        assert _extern_kernels(folder / f"{family}.cu") == set(names), family
        assert all(f" {name}(" in text for name in names), family
    every = {name for names in FAMILIES.values() for name in names}
    templates = []
    for py in folder.glob("*.py"):
        templates += re.findall(r'go\.launch\(\s*f?"([^"]+)"', py.read_text())  # the name may start a new line
    assert len(templates) >= 15
    launched = set()
    for template in templates:  # each {...} of an f-string stands for one part: store2, u8, bf16, ...
        pattern = re.compile(re.sub(r"\\\{[^}]*\\\}", "[a-z0-9]+", re.escape(template)) + "$")
        hits = {n for n in every if pattern.match(n)}
        assert hits, template
        launched |= hits
    assert launched == every, every - launched
