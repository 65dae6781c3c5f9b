"""The decode engine's kernels: each family has self-test rows (`checks/selftest_decode.py`) that launch
every one of its launchers, run here where a GPU is present."""

import re

import numpy as np
import pytest

from nanoeuler.checks.selftest_decode import CASES_DECODE
from nanoeuler.kernels import KERNEL_DIR
from nanoeuler.kernels.decode import FAMILIES


def test_every_family_and_launcher_has_a_selftest_row():
    tests = (KERNEL_DIR.parent / "checks" / "selftest_decode.py").read_text()
    cased = {fn.__name__[len("case_decode_") :] for fn, *_ in CASES_DECODE}
    assert cased == set(FAMILIES)
    for family in FAMILIES:
        launchers = re.findall(r"^def (\w+)\(go\b", (KERNEL_DIR / "decode" / f"{family}.py").read_text(), flags=re.M)
        assert launchers, family
        for name in launchers:  # called as <family>.<launcher>(go, ...) by a case
            assert re.search(rf"\b{family}\.{name}\(\s*go\b", tests), f"{family}.{name}"
    for fn, shape, label, _ in CASES_DECODE:  # every case names its shape
        assert label and len(shape) >= 2, fn.__name__


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES_DECODE, ids=lambda c: f"{c[0].__name__[12:]}-{c[2]}")
def test_decode_selftest_case(case):
    from nanoeuler.checks.selftest import poisoned_allocations, rel_err

    fn, shape, label, kwargs = case
    rng = np.random.default_rng()
    with poisoned_allocations():
        rows = fn(rng, shape, **kwargs)
    assert rows
    for name, got, ref, tol in rows:
        err = rel_err(got, ref)
        assert np.isfinite(err) and err <= tol, f"{name} {label}: {err:.2e} > {tol:.0e}"
