"""ZeRO-1 on the bf16 engine, its ranks emulated in one process on one GPU: N sharded engines (each its
region's moments) against the unsharded data-parallel step, the collectives done here between the
engine's phases (`forward_backward`, `recompute_grad_norm`, `optimizer_step`, `refresh_image`: the
calls of `TrainEngine._zero_update`) as sums over the ranks in rank order.

The runs are not bit for bit alike: the embedding's backward adds with float atomics (in any order, so
two unsharded runs differ too), the sharded norm adds the regions' sums of squares in another order, and
Muon's per-layer sums and batched GEMMs run over a rank's layers instead of all. The weights are compared
against how far training moved them, over the first 3 steps: there the runs agree to ~2e-8 (measured on an
H100), while a wrong moment or region would differ by far more from the second step on. Later, a last-bit
difference can round a bf16 image the other way and grow: two unsharded runs of this tiny model are
1.5e-3 (AdamW) and 3e-2 (Muon) apart after 10 steps, so a longer comparison would test the noise."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

CFG_ARGS = dict(vocab_size=256, dim=128, n_layers=4, n_heads=2, n_kv_heads=1, ctx_len=64, ffn_hidden=384, mtp_heads=2)
T, LR, MAX_NORM = 64, 3e-3, 0.1  # a norm limit every step's gradient exceeds: the global norm clips
STEPS, TOL = 3, 1e-5  # steps compared, and the weights' distance allowed, relative to the distance trained


def _cfg():
    from nanoeuler.model.config import ModelConfig

    return ModelConfig(**CFG_ARGS)


def _batches(seed: int, steps: int, rows: int):
    """Each step's global batch: token ids (rows, T) and every target valid (rows, T, K)."""
    rng, cfg = np.random.default_rng(seed), _cfg()
    return [
        (rng.integers(0, cfg.vocab_size, (rows, T)), rng.integers(0, cfg.vocab_size, (rows, T, cfg.mtp_heads)))
        for _ in range(steps)
    ]


def _engine(params, rows: int, optimizer: str, shards: int = 1, rank: int = 0, **kw):
    from nanoeuler.kernels.bf16.engine import TrainEngine

    return TrainEngine(
        _cfg(), params, batch=rows, seq=T, max_norm=MAX_NORM, optimizer=optimizer, shards=shards, rank=rank, **kw
    )


def _sum(arrays):
    """The sum over the ranks as a transport adds: rank 0's, then 1's, 2's, ..."""
    total = arrays[0].copy()
    for a in arrays[1:]:
        total += a
    return total


def _mean(arrays):
    return _sum(arrays) * np.float32(1.0 / len(arrays))


def plain_step(engine, micro, lr=LR):
    """The unsharded data-parallel step with a rank for each micro-batch: every rank holds the same weights,
    so one engine gives each rank's gradients in turn; their mean, its norm, clip and update."""
    import cupy as cp

    grads, losses = [], []
    for x, y in micro:
        engine.forward_backward(x, y)
        grads.append(engine.G.copy())
        losses.append(engine.last_loss())
    cp.copyto(engine.G, _mean(grads))
    engine.recompute_grad_norm()
    engine.optimizer_step(lr)
    return losses, engine.grad_norm()


def zero_step(engines, micro, lr=LR):
    """ZeRO-1's step on the ranks' sharded engines, rank r on micro-batch r, as `_zero_update` runs it."""
    import cupy as cp

    for e, (x, y) in zip(engines, micro):
        e.forward_backward(x, y)
    mean = _mean([e.G for e in engines])
    for e in engines:  # reduce-scatter: each rank gets its region of the mean
        cp.copyto(e.region(e.G), e.region(mean))
        e.recompute_grad_norm()  # the region's sum of squares
    total = _sum([e.sq for e in engines])
    for e in engines:  # all-reduce (sum): the global norm's square on every rank
        cp.copyto(e.sq, total)
        e.optimizer_step(lr)  # clip, and AdamW / Muon on the region
    gathered = cp.concatenate([e.region(e.P) for e in engines])
    for e in engines:  # all-gather the master weights, then each rank's whole bf16 image from them
        cp.copyto(e.P, gathered)
        e.refresh_image()
    return [e.last_loss() for e in engines], engines[0].grad_norm()


class Gather:
    """What `state_tensors` of a sharded engine asks of its transport, over engines of this process: the
    all-gather of a moment buffer (Mo or Vo) from every rank."""

    def __init__(self, engines, rank: int):
        self.engines, self.rank, self.size = engines, rank, len(engines)

    def all_gather(self, src, dst) -> None:
        import cupy as cp

        name = "Mo" if src is self.engines[self.rank].Mo else "Vo"
        cp.copyto(dst, cp.concatenate([getattr(e, name) for e in self.engines]))


def gathered_state(engines) -> tuple[dict, dict, int]:
    """(parameters, every tensor's moments, step count) as rank 0 of the sharded engines checkpoints them."""
    first = engines[0]
    first.set_zero(Gather(engines, 0))
    return {n: p.get() for n, p in first.params().items()}, first.state_tensors(), first.t


def _sharded(params, rows, optimizer, n, state=None, t=0):
    engines = [_engine(params, rows, optimizer, shards=n, rank=r) for r in range(n)]
    for e in engines if state is not None else ():
        e.load_state_tensors(state, t)
    return engines


def _host(tensors: dict) -> dict:
    return {k: v if isinstance(v, np.ndarray) else v.get() for k, v in tensors.items()}


def _assert_moved_alike(got: dict, want: dict, start: dict, tol: float) -> float:
    """Every tensor of `got` within tol of `want`, relative to how far training moved it from `start`; the
    largest such ratio."""
    worst = 0.0
    for n, w in want.items():
        moved = np.linalg.norm(w - start[n])
        assert moved > 0, n
        ratio = np.linalg.norm(got[n] - w) / moved
        assert ratio <= tol, (n, ratio)
        worst = max(worst, ratio)
    return worst


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_sharded_engines_train_as_the_unsharded_data_parallel_step(optimizer, n):
    """STEPS steps, rank r on rows r::n of a global batch of 2n: every rank's weights follow the unsharded run,
    its losses and the clipped norm too; the gathered state is the unsharded optimizer's; each rank holds
    its region's moments only, as `plan.engine_bytes` counts them."""
    from nanoeuler.kernels.bf16.plan import engine_bytes
    from nanoeuler.model import transformer

    params = transformer.init_params(_cfg(), seed=0)
    plain, zero = _engine(params, 2, optimizer), _sharded(params, 2, optimizer, n)
    tol = TOL
    for x, y in _batches(0, STEPS, 2 * n):
        micro = [(x[r::n], y[r::n]) for r in range(n)]
        want_losses, want_norm = plain_step(plain, micro)
        got_losses, got_norm = zero_step(zero, micro)
        np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
        assert want_norm > MAX_NORM and got_norm == pytest.approx(want_norm, rel=1e-5)
    want = _host(plain.params())
    for e in zero:
        worst = _assert_moved_alike(_host(e.params()), want, params, tol)
    got_params, got_state, t = gathered_state(zero)
    want_state = _host(plain.state_tensors())
    assert got_state.keys() == want_state.keys() and t == plain.t == STEPS
    for k, v in want_state.items():
        assert np.linalg.norm(got_state[k] - v) <= tol * np.linalg.norm(v), k
    print(f"\nZeRO-1 {optimizer} x{n}, {STEPS} steps: weights within {worst:.2e} of the distance trained")
    assert sum(e.Mo.size for e in zero) == zero[0].layout.total < n * plain.Mo.size
    if optimizer == "adamw":  # (Muon's tiny-model scratch lies outside the plan)
        e = zero[-1]
        kw = dict(attention=e.attention, fuse_swiglu=e.fuse_swiglu, fuse_rope=e.fuse_rope, shards=n)
        assert sum(engine_bytes(_cfg(), 2, T, **kw).values()) == e.nbytes()


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_sharded_run_resumes_on_another_world_and_on_one_gpu(optimizer):
    """A step on 2 sharded ranks, the gathered checkpoint resumed on 4 for a step, then on one unsharded
    engine: the same as the unsharded data-parallel steps on 2, 4 and 1 ranks, each resumed from the last's
    checkpoint (the second and third steps read moments that crossed a change of world). The reference
    splits each step's batch as the sharded run does: a split of its own (4 rows against 2 x 2, say) adds
    the loss in another order, which this tiny model, its moments near zero, turns into 1e-2 by step 2."""
    from nanoeuler.model import transformer

    params = transformer.init_params(_cfg(), seed=1)
    batches, worlds = _batches(1, STEPS, 4), (2, 4, 1)
    ref, p, state, t = None, params, None, 0
    for n, (x, y) in zip(worlds, batches):
        ref = _engine(p, 4 // n, optimizer)
        if state is not None:
            ref.load_state_tensors(state, t)
        plain_step(ref, [(x[r::n], y[r::n]) for r in range(n)])
        p, state, t = _host(ref.params()), _host(ref.state_tensors()), ref.t
    p, state, t = params, None, 0
    for n, (x, y) in zip(worlds[:2], batches):
        zero = _sharded(p, 4 // n, optimizer, n, state, t)
        zero_step(zero, [(x[r::n], y[r::n]) for r in range(n)])
        p, state, t = gathered_state(zero)
        del zero
    one = _engine(p, 4, optimizer)
    one.load_state_tensors(state, t)
    x, y = batches[2]
    plain_step(one, [(x, y)])
    assert one.t == ref.t == STEPS
    _assert_moved_alike(_host(one.params()), _host(ref.params()), params, TOL)


class Alone:
    """The transport of a world of one: each collective leaves its buffers as they are (in place)."""

    rank, size = 0, 1

    def reduce_scatter_mean(self, src, dst) -> None:
        assert dst.data.ptr == src.data.ptr and dst.size == src.size

    def all_reduce_sum(self, arrays) -> None:
        pass

    def all_gather(self, src, dst) -> None:
        assert dst.data.ptr == src.data.ptr and dst.size == src.size


@pytest.mark.parametrize("accum", [False, True], ids=["step", "step_accum"])
def test_the_zero_step_runs_in_the_captured_graph(accum):
    """The sharded step itself (`_zero_update`, eager once, then a CUDA graph) over a world of one steps as
    the plain engine with a collective does, whole batches and accumulated micro-batches alike."""
    from nanoeuler.model import transformer

    params = transformer.init_params(_cfg(), seed=2)
    plain, zero = (_engine(params, 2, "adamw", accum=accum) for _ in range(2))
    plain.set_collective(lambda grads: None)
    zero.set_zero(Alone())
    for x, y in _batches(2, 6, 4):
        for e in (plain, zero):
            if accum:
                e.step_accum([(x[:2], y[:2]), (x[2:], y[2:])], LR)
            else:
                e.step(x[:2], y[:2], LR)
        assert zero.last_loss() == pytest.approx(plain.last_loss(), rel=1e-3)
    assert (zero._graphs["update"] if accum else zero._graph) is not None
    _assert_moved_alike(_host(zero.params()), _host(plain.params()), params, 1e-3)
