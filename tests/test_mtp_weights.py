"""The output heads' loss weights on the CPU: the weighted loss and its gradients (finite differences; the
torch oracle is in test_torch_oracle.py), a head of weight 0, the schedule, its config keys and the
training loop that applies it step by step."""

import numpy as np
import pytest

from nanoeuler.checks import problem
from nanoeuler.config import validate
from nanoeuler.errors import UserError
from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig
from nanoeuler.optim import head_weights_at, lr_at
from nanoeuler.train import loop
from nanoeuler.train.config import PretrainConfig
from nanoeuler.train.stepper import make_stepper

CFG = problem.CHECK_CONFIG  # K = 3 heads


def _fd(params, batch, name, index, weights, h=3e-3):
    """Fourth-order central difference of the weighted loss in params[name][index] (float64)."""
    w = params[name]
    orig = w[index]

    def loss_at(value):
        w[index] = value
        return transformer.forward_loss(params, *batch, CFG, head_weights=weights)[0]

    try:
        return (8 * (loss_at(orig + h) - loss_at(orig - h)) - (loss_at(orig + 2 * h) - loss_at(orig - 2 * h))) / (
            12 * h
        )
    finally:
        w[index] = orig


@pytest.mark.parametrize("weights", [[1.0, 0.5, 0.25], [0.2, 0.0, 3.0]])
def test_weighted_loss_gradients_match_finite_differences(weights):
    params, inputs, targets = problem.random_problem(CFG, seed=4)
    loss, grads = transformer.loss_and_grads(params, inputs, targets, CFG, head_weights=weights)
    assert loss == pytest.approx(
        transformer.forward_loss(params, inputs, targets, CFG, head_weights=weights)[0], rel=1e-12
    )
    rng = np.random.default_rng(0)
    for name in (
        "lm_head.weight",
        "mtp_heads.1.weight",
        "mtp_heads.2.weight",
        "norm.weight",
        "layers.0.self_attn.q_proj.weight",
        "embed_tokens.weight",
    ):
        flat = np.abs(grads[name]).ravel()
        for i in {int(flat.argmax()), *rng.integers(0, flat.size, 3).tolist()}:
            index = np.unravel_index(i, grads[name].shape)
            num, ana = _fd(params, (inputs, targets), name, index, weights), grads[name][index]
            assert abs(ana - num) <= 1e-7 * max(abs(ana) + abs(num), 1e-9), (name, index, ana, num)


def test_weights_of_one_are_the_plain_mean_and_scale_free():
    """All-ones weights give the unweighted loss and gradients bit for bit; weights only count relative to
    each other (times 3: the same loss)."""
    params, inputs, targets = problem.random_problem(CFG, seed=1)
    plain = transformer.loss_and_grads(params, inputs, targets, CFG)
    ones = transformer.loss_and_grads(params, inputs, targets, CFG, head_weights=[1.0, 1.0, 1.0])
    assert plain[0] == ones[0] and all(np.array_equal(plain[1][n], ones[1][n]) for n in params)
    a = transformer.loss_and_grads(params, inputs, targets, CFG, head_weights=[1.0, 0.5, 0.25])
    b = transformer.loss_and_grads(params, inputs, targets, CFG, head_weights=[3.0, 1.5, 0.75])
    assert a[0] == pytest.approx(b[0], rel=1e-14)


def test_a_head_of_weight_zero_is_not_trained():
    """Weight 0: a zero gradient for the head, nothing from it in the trunk, and the loss the weighted mean
    of the others' mean cross-entropies (forward_loss's per-head values)."""
    params, inputs, targets = problem.random_problem(CFG, seed=2)
    loss, grads = transformer.loss_and_grads(params, inputs, targets, CFG, head_weights=[2.0, 0.0, 1.0])
    assert not grads["mtp_heads.1.weight"].any() and grads["mtp_heads.2.weight"].any()
    _, heads = transformer.forward_loss(params, inputs, targets, CFG)
    assert loss == pytest.approx((2.0 * heads[0] + heads[2]) / 3.0, rel=1e-12)
    # the trunk sees heads 0 and 2 only: the same gradients as a target-less head 1
    no_targets = targets.copy()
    no_targets[..., 1] = -1
    _, ref = transformer.loss_and_grads(params, inputs, no_targets, CFG, head_weights=[2.0, 5.0, 1.0])
    for name in params:
        np.testing.assert_allclose(grads[name], ref[name], rtol=1e-12, atol=1e-15, err_msg=name)
    assert transformer.head_loss_scales([3, 0, 2], [0.0, 1.0, 0.0]) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="2 head weights for 3 output heads"):
        transformer.head_loss_scales([1, 1, 1], [1.0, 1.0])


def test_micro_batches_step_as_the_whole_batch_with_weights():
    params, inputs, targets = problem.random_problem(CFG, seed=5, batch=4)
    w = [1.0, 0.3, 0.0]
    whole = transformer.loss_and_grads(params, inputs, targets, CFG, head_weights=w)
    totals = transformer.step_totals([targets[:1], targets[1:]])
    parts = [
        transformer.loss_and_grads(params, inputs[s], targets[s], CFG, totals=totals, head_weights=w)
        for s in (slice(0, 1), slice(1, 4))
    ]
    assert parts[0][0] + parts[1][0] == pytest.approx(whole[0], rel=1e-12)
    for name in params:
        np.testing.assert_allclose(parts[0][1][name] + parts[1][1][name], whole[1][name], rtol=1e-10, atol=1e-14)


def test_head_weights_at_is_a_straight_line_from_first_to_last_step():
    start, end = [1.0, 0.5, 0.25, 0.125], [1.0, 0.0, 0.0, 0.0]
    assert head_weights_at(0, 101, start, end) == start and head_weights_at(100, 101, start, end) == end
    assert head_weights_at(50, 101, start, end) == [1.0, 0.25, 0.125, 0.0625]
    assert head_weights_at(500, 101, start, end) == end  # past the end: the end
    assert head_weights_at(7, 101, start) == start and head_weights_at(0, 1, start, end) == start
    with pytest.raises(ValueError):
        head_weights_at(0, 10, start, [1.0])


def _settings(**kw):
    return PretrainConfig.from_section(validate({"pretrain": kw})["pretrain"])


def test_config_keys_are_checked_against_the_model():
    assert _settings().head_weight_schedule(3, "pretrain") is None
    fn = _settings(mtp_weights=[1, 0.5, 0.25]).head_weight_schedule(3, "pretrain")
    assert fn(0, 10) == fn(9, 10) == [1.0, 0.5, 0.25]
    assert _settings(mtp_weights_end=[1, 0, 0]).head_weight_schedule(3, "pretrain")(1, 3) == [1.0, 0.5, 0.5]
    with pytest.raises(UserError, match=r"pretrain\.mtp_weights has 2 weights, but the model has 3 output heads"):
        _settings(mtp_weights=[1, 0.5]).head_weight_schedule(3, "pretrain")
    with pytest.raises(UserError, match=r"pretrain\.mtp_weights_end has 4 weights"):
        _settings(mtp_weights_end=[1, 0, 0, 0]).head_weight_schedule(3, "pretrain")
    with pytest.raises(UserError, match=r"pretrain\.mtp_weights_end must give at least one output head a positive"):
        _settings(mtp_weights_end=[0, 0, 0]).head_weight_schedule(3, "pretrain")
    with pytest.raises(UserError, match=r"'pretrain\.mtp_weights\[1\]' must be >= 0"):
        validate({"pretrain": {"mtp_weights": [1, -0.5, 0]}})
    with pytest.raises(UserError, match=r"'pretrain\.mtp_weights_end' must be array or null"):
        validate({"pretrain": {"mtp_weights_end": 1.0}})


TINY = ModelConfig(vocab_size=24, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ctx_len=8, mtp_heads=2)


def _batch(step):
    rng = np.random.default_rng(step)
    w = rng.integers(0, TINY.vocab_size, size=(2, TINY.ctx_len + 2))
    return w[:, : TINY.ctx_len], np.stack([w[:, 1 + k : TINY.ctx_len + 1 + k] for k in range(2)], axis=-1)


def test_the_loop_trains_each_step_with_its_scheduled_weights(tmp_path):
    """A run with mtp_weights_end [1, 0] ends where steps with weights [1, 1], [1, 2/3], [1, 1/3], [1, 0]
    end, bit for bit; without the key it ends elsewhere."""

    def init():
        return {n: p.astype(np.float64) for n, p in transformer.init_params(TINY, seed=0).items()}

    def train(name, **keys):
        sec = validate(
            {
                "pretrain": dict(
                    batch_size=2,
                    lr=1e-2,
                    warmup_steps=1,
                    steps=4,
                    log_every=1,
                    eval_every=1000,
                    checkpoint_every=4,
                    **keys,
                )
            }
        )["pretrain"]

        class Batches:
            def batch(self, step, micro):
                return _batch(step)

            def state(self):
                return {}

            def load_state(self, state):
                pass

        run = loop.Run(
            stage="pretrain",
            cfg=TINY,
            section=sec,
            total_steps=4,
            batches=Batches(),
            init_params=init,
            tokenizer_json="{}",
            tokenizer_sha256="0" * 64,
            run_dir=tmp_path / name,
            out=tmp_path / name / "final.bin",
            xp=np,
            progress=False,
        )
        loop.train(run)
        from nanoeuler import checkpoint

        return checkpoint.load(tmp_path / name / "ckpt_00000004.bin")[0], run.settings

    got, s = train("faded", mtp_weights_end=[1, 0])
    plain, _ = train("plain")
    stepper = make_stepper(s, TINY, init(), np)
    for step0 in range(4):
        lr = lr_at(step0, max_lr=s.lr, min_lr=s.min_lr, warmup_steps=s.warmup_steps, total_steps=4)
        stepper.step([_batch(step0)], lr, head_weights=[1.0, 1.0 - step0 / 3])
    for name, p in stepper.params().items():
        np.testing.assert_array_equal(got[name], p, err_msg=name)
    assert not np.array_equal(got["mtp_heads.1.weight"], plain["mtp_heads.1.weight"])
