"""The bf16 engine's kernel path: config key `<stage>.kernels`, overridden by NANOEULER_KERNELS."""

import pytest

from nanoeuler.config import validate
from nanoeuler.errors import UserError
from nanoeuler.kernels import kernel_path_options


def test_auto_leaves_the_engine_its_defaults(monkeypatch):
    monkeypatch.delenv("NANOEULER_KERNELS", raising=False)
    assert kernel_path_options("auto") == {}


def test_portable_turns_off_every_hopper_only_kernel(monkeypatch):
    monkeypatch.delenv("NANOEULER_KERNELS", raising=False)
    assert kernel_path_options("portable") == {"attention": "ldm", "fuse_swiglu": False, "fuse_rope": False}


def test_the_environment_variable_wins(monkeypatch):
    monkeypatch.setenv("NANOEULER_KERNELS", "portable")
    assert kernel_path_options("auto")["attention"] == "ldm"
    monkeypatch.setenv("NANOEULER_KERNELS", "hopperish")
    with pytest.raises(UserError, match="NANOEULER_KERNELS"):
        kernel_path_options("auto")


def test_config_key_is_validated():
    assert validate({"pretrain": {"kernels": "portable"}})["pretrain"]["kernels"] == "portable"
    assert validate({})["sft"]["kernels"] == "auto"
    with pytest.raises(UserError):
        validate({"pretrain": {"kernels": "sm89"}})
