"""The training seam on the CPU: a stage's own loss, a gradient hook between backward and update
(a two-rank all-reduce double), gradient accumulation, non-finite steps and the state a checkpoint keeps."""

import numpy as np
import pytest

from nanoeuler.config import validate
from nanoeuler.errors import UserError
from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig
from nanoeuler.optim import AdamW, clip_grad_norm
from nanoeuler.train.config import PretrainConfig, SftConfig
from nanoeuler.train.stepper import NonFinite, XpStepper, make_stepper
from train_fixtures import step_in_threads, thread_mean_hooks

CFG = ModelConfig(vocab_size=40, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ctx_len=8, mtp_heads=2)


def _settings(**kw):
    return PretrainConfig.from_section(dict(validate({})["pretrain"], **kw))


def _params():
    return {n: p.astype(np.float64) for n, p in transformer.init_params(CFG, seed=0).items()}


def _micro(seed, B=2):
    rng = np.random.default_rng(seed)
    w = rng.integers(0, CFG.vocab_size, size=(B, CFG.ctx_len + CFG.mtp_heads))
    y = np.stack([w[:, 1 + k : CFG.ctx_len + 1 + k] for k in range(CFG.mtp_heads)], axis=-1)
    return w[:, : CFG.ctx_len], y


def test_settings_are_typed_from_the_validated_sections():
    s = _settings(lr=1, batch_size=3)
    assert isinstance(s.lr, float) and s.batch_size == 3 and s.steps == 20000
    sft = SftConfig.from_section(validate({"sft": {"too_long": "drop"}})["sft"])
    assert sft.too_long == "drop" and sft.epochs == 2 and sft.weight_decay == 0.0


def test_xp_stepper_is_loss_and_grads_then_clipping_then_adamw():
    stepper = make_stepper(_settings(grad_clip=0.5), CFG, _params(), np)
    ref, x = _params(), _micro(1)
    opt = AdamW(ref, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    loss, norm = stepper.step([x], lr=1e-2)
    ref_loss, grads = transformer.loss_and_grads(ref, *x, CFG)
    assert norm == clip_grad_norm(grads, 0.5) and loss == ref_loss
    opt.step(ref, grads, 1e-2)
    for n, p in stepper.params().items():
        np.testing.assert_array_equal(p, ref[n])
    assert stepper.t == 1 and set(stepper.state_tensors()) == set(opt.state_tensors())


def test_accumulated_micro_batches_equal_one_batch_of_their_rows():
    a, b = _micro(1), _micro(2)
    whole = (np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]]))
    one, two = make_stepper(_settings(), CFG, _params(), np), make_stepper(_settings(), CFG, _params(), np)
    loss1, norm1 = one.step([whole], lr=1e-2)
    loss2, norm2 = two.step([a, b], lr=1e-2)  # every row has all its targets: equal means
    assert loss2 == pytest.approx(loss1, rel=1e-12) and norm2 == pytest.approx(norm1, rel=1e-10)
    for n, p in one.params().items():
        np.testing.assert_allclose(two.params()[n], p, rtol=1e-9, atol=1e-13)


def test_a_stage_supplies_its_own_loss_on_the_final_normed_state():
    """A test double for a stage's objective: twice the default loss, seen through the hook on xn."""
    seen = []

    def doubled(xn, params, targets, cfg):
        seen.append(xn.shape)
        loss, dxn, grads = transformer.mtp_cross_entropy(xn, params, targets, cfg)
        return 2 * loss, 2 * dxn, {n: 2 * g for n, g in grads.items()}

    plain = make_stepper(_settings(grad_clip=0.0), CFG, _params(), np)
    own = make_stepper(_settings(grad_clip=0.0), CFG, _params(), np, head_loss=doubled)
    x = _micro(3)
    loss, norm = plain.step([x], lr=1e-3)
    loss2, norm2 = own.step([x], lr=1e-3)
    assert seen == [(2, CFG.ctx_len, CFG.dim)]
    assert loss2 == pytest.approx(2 * loss, rel=1e-12) and norm2 == pytest.approx(2 * norm, rel=1e-12)


def test_grad_hook_runs_between_backward_and_clipping_as_an_all_reduce():
    """Two ranks, each a stepper on its half of the batch, average their gradients in the hook (a
    thread barrier stands in for NCCL): both end where one stepper over the whole batch ends."""
    halves = [_micro(4), _micro(5)]
    reference = make_stepper(_settings(), CFG, _params(), np)
    ref_loss, ref_norm = reference.step(halves, lr=1e-2)  # accumulation: the mean of the halves' gradients

    hooks = thread_mean_hooks(2)
    ranks = [make_stepper(_settings(), CFG, _params(), np, grad_hook=hooks[r]) for r in range(2)]
    norms = [norm for _, norm in step_in_threads(ranks, halves, lr=1e-2)]
    assert norms[0] == norms[1] == pytest.approx(ref_norm, rel=1e-12)
    for n, p in reference.params().items():
        for rank in ranks:
            np.testing.assert_allclose(rank.params()[n], p, rtol=1e-12, atol=1e-15)


def test_non_finite_loss_stops_before_the_update():
    stepper = make_stepper(_settings(), CFG, _params(), np)
    before = {n: p.copy() for n, p in stepper.params().items()}
    stepper.params()["norm.weight"][0] = np.nan
    before["norm.weight"][0] = np.nan
    with pytest.raises(NonFinite) as exc:
        stepper.step([_micro(6)], lr=1e-2)
    assert exc.value.what == "loss" and stepper.t == 0
    for n, p in stepper.params().items():
        np.testing.assert_array_equal(p, before[n])


def test_state_round_trips_through_load_state_tensors():
    a = make_stepper(_settings(), CFG, _params(), np)
    for s in range(3):
        a.step([_micro(s)], lr=1e-2)
    b = make_stepper(_settings(), CFG, {n: p.copy() for n, p in a.params().items()}, np)
    b.load_state_tensors({n: t.copy() for n, t in a.state_tensors().items()}, a.t)
    x = _micro(9)
    assert a.step([x], lr=1e-2) == b.step([x], lr=1e-2) and b.t == 4
    assert isinstance(b, XpStepper)


def test_bf16_stepper_refusals_name_the_stage():
    with pytest.raises(UserError, match="sft.precision bf16 runs on the GPU engine"):
        make_stepper(_settings(precision="bf16"), CFG, _params(), np, stage="sft")
