"""The backend: device names, the one-line error without a GPU, the out-of-memory message, and that
nothing imports CuPy on a CPU-only install."""

import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

from nanoeuler import backend
from nanoeuler.errors import UserError


@pytest.fixture
def no_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError


def _fake_cupy(monkeypatch, count=None, error=None):
    def get_count():
        if error is not None:
            raise error
        return count

    runtime = types.SimpleNamespace(getDeviceCount=get_count)
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    monkeypatch.setitem(sys.modules, "cupy", fake)


def test_cpu_is_cpu_without_looking_for_cupy(no_cupy):
    assert backend.resolve_device("cpu") == "cpu"
    assert backend.get_xp("cpu") is np


def test_auto_falls_back_to_cpu(no_cupy):
    assert backend.resolve_device("auto") == "cpu"
    assert backend.get_xp("auto") is np


def test_unknown_device_is_a_user_error():
    with pytest.raises(UserError, match="auto, cpu or gpu"):
        backend.resolve_device("tpu")


def test_gpu_without_cupy_is_one_line_with_the_install_hint(no_cupy):
    with pytest.raises(UserError) as exc:
        backend.resolve_device("gpu")
    msg = str(exc.value)
    assert "\n" not in msg
    assert "CuPy is not installed" in msg and "pip install -e '.[gpu]'" in msg and "--device cpu" in msg


@pytest.mark.parametrize(
    "count, error, why",
    [
        (0, None, "no CUDA device is visible"),
        (None, RuntimeError("cudaErrorInsufficientDriver: driver too old\nmore"), "cannot reach a CUDA driver"),
        (None, RuntimeError(""), "cannot reach a CUDA driver (RuntimeError)"),
    ],
)
def test_gpu_without_a_device_says_why(monkeypatch, count, error, why):
    _fake_cupy(monkeypatch, count, error)
    with pytest.raises(UserError) as exc:
        backend.resolve_device("gpu")
    assert why in str(exc.value) and "\n" not in str(exc.value)
    assert backend.resolve_device("auto") == "cpu"


def test_array_module_and_to_numpy_on_numpy():
    a = np.arange(3.0)
    assert backend.array_module(a) is np
    assert backend.to_numpy(a) is a
    assert not backend.is_gpu_array(a)


def test_tf32_flag(monkeypatch):
    monkeypatch.delenv("CUPY_TF32", raising=False)
    assert not backend.tf32_enabled()
    monkeypatch.setenv("CUPY_TF32", "1")
    assert backend.tf32_enabled()


def _fake_oom():
    cls = type("OutOfMemoryError", (MemoryError,), {"__module__": "cupy.cuda.memory"})
    return cls("Out of memory allocating 8,589,934,592 bytes (allocated so far: 1,024 bytes).")


def test_oom_becomes_a_user_error_naming_batch_and_context():
    with pytest.raises(UserError) as exc:
        with backend.oom_guard(16, 512):
            raise _fake_oom()
    msg = str(exc.value)
    assert "batch size 16" in msg and "context 512" in msg and "8,589,934,592 bytes" in msg and "\n" not in msg


def test_oom_guard_lets_other_errors_through():
    with pytest.raises(ValueError):
        with backend.oom_guard(16, 512):
            raise ValueError("not memory")
    with pytest.raises(MemoryError):  # host memory errors are not GPU ones
        with backend.oom_guard(16, 512):
            raise MemoryError("host")


# A child interpreter with an import hook that records and refuses every `import cupy`.
BLOCKER = textwrap.dedent("""
    import sys, importlib.abc
    ATTEMPTS = []
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "cupy" or name.startswith(("cupy.", "cupyx", "cupy_backends")):
                ATTEMPTS.append(name)
                raise ImportError(f"blocked import of {name}")
            return None
    sys.meta_path.insert(0, Block())
""")

# Modules that exist only for the GPU and import CuPy at the top (reached through ops_for(cupy)).
GPU_ONLY = {"nanoeuler.kernels.ops", "nanoeuler.kernels.bf16.engine", "nanoeuler.kernels.cublas"}


def test_no_module_imports_cupy_on_a_cpu_install():
    script = BLOCKER + textwrap.dedent(f"""
        import importlib, pkgutil
        import nanoeuler
        from nanoeuler.cli import COMMANDS, main
        names = sorted(m.name for m in pkgutil.walk_packages(nanoeuler.__path__, "nanoeuler."))
        for name in names:
            if name not in {sorted(GPU_ONLY)!r} and not name.endswith("__main__"):
                importlib.import_module(name)
        for stage, (module, _) in COMMANDS.items():  # every stage's parser, as `nanoeuler <stage> --help` builds it
            try:
                main([stage, "--help"])
            except SystemExit:
                pass
            except ModuleNotFoundError as exc:  # a stage not written yet (test_cli reports those)
                if exc.name != module:
                    raise
        # CPU compute through the model on NumPy
        from nanoeuler.backend import get_xp
        from nanoeuler.model import transformer
        from nanoeuler.model.config import ModelConfig
        import numpy as np
        assert get_xp("cpu") is np
        cfg = ModelConfig(vocab_size=17, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ctx_len=8, mtp_heads=2)
        params = transformer.init_params(cfg, seed=0)
        ids = np.arange(12).reshape(2, 6) % 17
        tg = np.stack([ids, ids], axis=-1)
        loss, grads = transformer.loss_and_grads(params, ids, tg, cfg)
        assert ATTEMPTS == [], ATTEMPTS
        assert not any(m == "cupy" or m.startswith("cupy.") for m in sys.modules), "cupy in sys.modules"
        print("checked", len(names), "modules")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "checked" in out.stdout


def test_selftest_without_a_gpu_is_one_clear_line():
    script = BLOCKER + textwrap.dedent("""
        from nanoeuler.cli import main
        sys.exit(main(["selftest"]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(
        "nanoeuler selftest: error: the kernel self-test needs a CUDA GPU but CuPy is not installed"
    )
    assert "pip install -e '.[gpu]'" in lines[0]
