"""ZeRO stage 1 and the plain data-parallel average on the CPU: ranks are threads whose collectives
(all-reduce, reduce-scatter, all-gather) meet at a barrier and add round the ranks as NCCL's ring does, so a
tensor all-reduced alone adds in another order than its block of a flat reduce-scatter. The sharded run
matches the unsharded data-parallel run bit for bit in float32 over 100 steps (AdamW and Muon, 2, 3 and 4
ranks, clipping on) because both average through the same flat buffer; that average is the float64 mean
to float32 rounding. Each rank keeps about 1/N of the optimizer state, and a checkpoint of N ranks resumes
on M. The bf16 engine's ZeRO-1 wiring is checked here, the engine itself in tests/test_engine_zero_gpu.py."""

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from nanoeuler import checkpoint, memory
from nanoeuler.config import validate
from nanoeuler.errors import UserError
from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig
from nanoeuler.train import loop
from nanoeuler.train.config import TrainConfig
from nanoeuler.train.parallel import DataParallel, FlatGradients, ZeroStepper, optimizer_bytes, plan_shards
from nanoeuler.train.stepper import make_stepper
from test_parallel import _run, shards  # noqa: F401 (a fixture)

CFG = ModelConfig(vocab_size=40, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ctx_len=8, mtp_heads=2)


class ThreadWorld:
    """n ranks as threads of one process: each collective is an exchange at a barrier."""

    def __init__(self, n: int):
        self.n, self.barrier, self.slots = n, threading.Barrier(n, timeout=60), [None] * n

    def exchange(self, rank: int, value) -> list:
        self.slots[rank] = value
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return got


class ThreadComm:
    """`parallel.Comm` over a `ThreadWorld`, adding as NCCL's ring does: block c of a reduce-scatter is summed
    going round the ranks from c + 1 to c, and an all-reduce cuts its array into `size` chunks, chunk c
    summed the same way. So an element of a tensor all-reduced alone is added in another rank order than in
    its block of a flat reduce-scatter (with 3 ranks or more: a + b is b + a), as on the GPUs."""

    def __init__(self, world: ThreadWorld, rank: int):
        self.world, self.rank, self.size = world, rank, world.n

    def _ring_mean(self, parts: list, c: int):
        """The mean of `parts` (one a rank) added from rank c + 1 round to rank c."""
        order = [parts[(c + 1 + i) % self.size] for i in range(self.size)]
        return sum(order[1:], order[0]) * (1.0 / self.size)

    def all_reduce_mean(self, arrays: list) -> None:
        for a in arrays:
            parts = [np.array_split(p.ravel(), self.size) for p in self.world.exchange(self.rank, a.copy())]
            chunks = [self._ring_mean([p[c] for p in parts], c) for c in range(self.size)]
            a[...] = np.concatenate(chunks).reshape(a.shape)

    def reduce_scatter_mean(self, src, dst) -> None:
        k, r = dst.size, self.rank
        dst[...] = self._ring_mean([p[r * k : (r + 1) * k] for p in self.world.exchange(self.rank, src.copy())], r)

    def all_gather(self, src, dst) -> None:
        dst[...] = np.concatenate(self.world.exchange(self.rank, src.copy()))

    def mean_scalar(self, value: float) -> float:
        return float(self._ring_mean(self.world.exchange(self.rank, float(value)), 0))

    def broadcast_int(self, value: int) -> int:
        return self.world.exchange(self.rank, value)[0]

    def check(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


def in_threads(fn, world: ThreadWorld) -> list:
    """fn(rank) for every rank of `world`, each in a thread; their results. A rank that fails breaks the
    barrier (the others stop at once) and its exception is raised here."""
    out, errors = [None] * world.n, []

    def run(r):
        try:
            out[r] = fn(r)
        except BaseException as exc:  # noqa: BLE001 (raised below)
            errors.append(exc)
            world.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world.n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return out


def settings(optimizer: str, batch: int) -> TrainConfig:
    sec = validate(
        {
            "pretrain": {
                "batch_size": batch,
                "optimizer": optimizer,
                "grad_clip": 0.5,
                "lr": 1e-2,
                "muon_lr": 2e-2,
                "weight_decay": 0.1,
            }
        }
    )["pretrain"]
    return TrainConfig.from_section(sec)


def windows(step: int, n: int, b: int):
    """The n*b windows of a step (the same on every rank, as the loader draws them); rank r takes r::n."""
    rng = np.random.default_rng(1000 + step)
    w = rng.integers(0, CFG.vocab_size, size=(n * b, CFG.ctx_len + CFG.mtp_heads))
    y = np.stack([w[:, 1 + k : CFG.ctx_len + 1 + k] for k in range(CFG.mtp_heads)], axis=-1)
    return w[:, : CFG.ctx_len], y


def rank_stepper(rank: int, world: ThreadWorld, optimizer: str, batch: int, zero: int, params=None):
    dp = DataParallel(ThreadComm(world, rank), "pretrain", zero=zero)
    params = transformer.init_params(CFG, seed=0) if params is None else params
    inner = make_stepper(
        settings(optimizer, batch), CFG, {n: p.copy() for n, p in params.items()}, np, grad_hook=dp.grad_hook()
    )
    return dp.wrap(inner)


def train(stepper, rank: int, n: int, b: int, steps: range) -> list:
    out = []
    for s in steps:
        x, y = windows(s, n, b)
        out.append(stepper.step([(x[rank::n], y[rank::n])], lr=1e-2))
    return out


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_zero_1_matches_the_unsharded_run_bit_for_bit_over_100_steps(optimizer, n):
    b, steps = 2, range(100)
    results = {}
    for zero in (0, 1):
        world = ThreadWorld(n)

        def rank_main(r):
            stepper = rank_stepper(r, world, optimizer, b, zero)
            log = train(stepper, r, n, b, steps)
            return log, {k: v.copy() for k, v in stepper.params().items()}, stepper.state_tensors()

        results[zero] = in_threads(rank_main, world)
    (plain, zero) = results[0], results[1]
    assert plain[0][1]["embed_tokens.weight"].dtype == np.float32
    norms = [norm for _, norm in plain[0][0]]
    assert min(norms) < 0.5 < max(norms)  # clipping acted on some steps and not on others
    for r in range(n):
        assert zero[r][0] == plain[0][0]  # every step's loss and gradient norm, to the last bit
        for name, p in plain[0][1].items():
            np.testing.assert_array_equal(zero[r][1][name], p, err_msg=f"rank {r} {name}")
    assert zero[0][2].keys() == plain[0][2].keys()  # the gathered state is the unsharded optimizer's
    for key, value in plain[0][2].items():
        np.testing.assert_array_equal(zero[0][2][key], value, err_msg=key)


def test_each_rank_keeps_about_a_quarter_of_the_optimizer_state():
    world, n = ThreadWorld(4), 4
    steppers = in_threads(lambda r: rank_stepper(r, world, "adamw", 2, zero=1), world)
    whole = optimizer_bytes(rank_stepper(0, ThreadWorld(1), "adamw", 2, zero=0))
    held = [optimizer_bytes(s) for s in steppers]
    assert sum(held) == whole  # every moment on exactly one rank
    largest = max(int(np.prod(s)) for s in CFG.param_shapes().values()) * 2 * 4  # m and v, float32
    assert max(held) <= whole / n + largest
    parts = memory.xp_train_parts(CFG, 2, CFG.ctx_len, zero_world=n)
    assert max(held) <= parts["adamw"] < whole  # the memory model's share bounds every rank's
    assert isinstance(steppers[0].inner, ZeroStepper)
    flat = steppers[0].inner.flat.buffer.nbytes  # and its flat buffer, within a largest tensor a rank
    assert flat <= parts["flat_grads"] <= flat + n * largest // 2  # (largest: two float32 copies of it)
    assert memory.xp_train_parts(CFG, 2, CFG.ctx_len, dp_world=n)["flat_grads"] == parts["flat_grads"]


def rank_grads(rank: int) -> dict:
    """Float32 gradients of the model's shapes, different on every rank; one a transposed view, as the
    backward hands out views too."""
    rng = np.random.default_rng(rank)
    grads = {n: rng.standard_normal(s).astype(np.float32) for n, s in CFG.param_shapes().items()}
    o = "layers.0.self_attn.o_proj.weight"
    grads[o] = np.ascontiguousarray(grads[o].T).T
    return grads


def assert_the_mean(got: list, sent: list, n: int, what: str) -> None:
    """Every rank's `got` is the same float32 bytes, within float32 rounding of the float64 mean of `sent`:
    n - 1 additions and the scaling by 1/n, each off by at most half a float32 ulp of what it rounds."""
    for name in sent[0]:
        exact = np.mean([s[name].astype(np.float64) for s in sent], axis=0)
        scale = np.mean([np.abs(s[name].astype(np.float64)) for s in sent], axis=0)
        for r in range(n):
            assert got[r][name].dtype == np.float32
            np.testing.assert_array_equal(got[r][name], got[0][name], err_msg=f"{what}: rank {r} {name}")
        assert np.all(np.abs(got[0][name] - exact) <= (n + 1) * 2.0**-24 * scale), f"{what}: {name}"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_plain_average_is_the_float64_mean_to_float32_rounding(n):
    world = ThreadWorld(n)
    sent = [rank_grads(r) for r in range(n)]

    def rank_main(r):
        hook = DataParallel(ThreadComm(world, r), "pretrain").grad_hook()
        for _ in range(2):  # the flat buffer laid out on the first call serves the next
            grads = {k: v.copy(order="K") for k, v in sent[r].items()}
            hook(grads)
        return grads

    assert_the_mean(in_threads(rank_main, world), sent, n, f"{n} ranks")


def test_a_stages_own_hook_runs_on_the_averaged_gradients():
    """The stage's `then` sees the mean, not this rank's gradients, and what it changes is what the stepper
    clips and applies."""
    n, world = 3, ThreadWorld(3)
    sent = [rank_grads(r) for r in range(n)]

    def rank_main(r):
        seen = {}

        def then(grads):
            seen.update({k: v.copy() for k, v in grads.items()})
            grads["norm.weight"][...] = 0  # as a stage that freezes a tensor would

        grads = {k: v.copy() for k, v in sent[r].items()}
        DataParallel(ThreadComm(world, r), "sft").grad_hook(then=then)(grads)
        return seen, grads

    out = in_threads(rank_main, world)
    assert_the_mean([seen for seen, _ in out], sent, n, "then")
    for seen, grads in out:
        assert not grads["norm.weight"].any()
        np.testing.assert_array_equal(grads["lm_head.weight"], seen["lm_head.weight"])


class Counting(ThreadComm):
    """A world of one rank that records which collectives ran."""

    def __init__(self):
        super().__init__(ThreadWorld(1), 0)
        self.calls = []

    def all_reduce_mean(self, arrays):
        self.calls.append(("all_reduce", [a.size for a in arrays]))
        super().all_reduce_mean(arrays)

    def reduce_scatter_mean(self, src, dst):
        self.calls.append(("reduce_scatter", src.size))
        super().reduce_scatter_mean(src, dst)

    def all_gather(self, src, dst):
        self.calls.append(("all_gather", dst.size))
        super().all_gather(src, dst)


def test_the_engines_flat_gradients_take_one_all_reduce_and_the_fp32_tensors_the_flat_pair():
    """The bf16 engine's gradients (views of its one buffer) are all-reduced in one call, as its captured
    step does; the fp32 stepper's separate tensors take one reduce-scatter and one all-gather of the flat
    buffer, whatever their number, and come back unchanged from a world of one."""
    engine = Counting()
    buffer = np.arange(100, dtype=np.float32)
    DataParallel(engine, "pretrain").grad_hook()({"a": buffer[:12].reshape(3, 4), "b": buffer[64:70]})
    assert engine.calls == [("all_reduce", [100])]
    fp32, grads = Counting(), rank_grads(0)
    before = {k: v.copy() for k, v in grads.items()}
    DataParallel(fp32, "pretrain").grad_hook()(grads)
    total = sum(g.size for g in grads.values())
    assert fp32.calls == [("reduce_scatter", total), ("all_gather", total)]
    for name, g in grads.items():
        np.testing.assert_array_equal(g, before[name], err_msg=name)


def test_the_plain_average_and_zero_1_lay_the_gradients_out_alike():
    """The hook lays its buffer out by the gradients' names and shapes, ZeroStepper by the parameters': both
    in the model's order, so both are `plan_shards(cfg.param_shapes(), n)`."""
    x, y = windows(0, 1, 2)
    for n in (2, 3, 4):
        comm = ThreadComm(ThreadWorld(n), 0)
        inner = make_stepper(settings("adamw", 2), CFG, transformer.init_params(CFG, seed=0), np)
        _, grads = inner.gradients([(x, y), (x, y)])  # two micro-batches: the summed dict
        assert list(grads) == list(CFG.param_shapes())
        want = plan_shards(CFG.param_shapes(), n)
        assert FlatGradients(grads, comm).plan == want
        assert ZeroStepper(inner, comm).plan == want


def test_the_shard_plan_keeps_tensors_whole_contiguous_and_balanced():
    shapes = CFG.param_shapes()
    sizes = {k: int(np.prod(s)) for k, s in shapes.items()}
    for n in (1, 2, 3, 4, 7, 64):
        plan = plan_shards(shapes, n)
        owners = [plan.owner[k] for k in shapes]
        assert owners == sorted(owners) and set(plan.owner) == set(shapes)  # contiguous runs, in order
        ends = [plan.offset[k] + sizes[k] for k in shapes]
        for k in shapes:  # inside its rank's run, never overlapping the next tensor
            assert (
                plan.owner[k] * plan.span <= plan.offset[k]
                and ends[list(shapes).index(k)] <= (plan.owner[k] + 1) * plan.span
            )
        assert len(set(plan.offset.values())) == len(shapes)
        assert plan.span <= sum(sizes.values()) / n + max(sizes.values())  # a tensor spills half over each end


def test_a_checkpoint_of_2_ranks_resumes_on_4_and_on_3():
    """The state gathered from 2 sharded ranks at step 10 continues on 4 (and 3) sharded ranks exactly as
    the unsharded runs of the same worlds do: the global batch of 12 stays, the shards are cut anew."""

    def run(zero, first, second):
        world = ThreadWorld(first)

        def part1(r):
            s = rank_stepper(r, world, "muon", 12 // first, zero)
            train(s, r, first, 12 // first, range(10))
            return {k: v.copy() for k, v in s.params().items()}, s.state_tensors(), s.t

        params, state, t = in_threads(part1, world)[0]  # rank 0's, as the checkpoint keeps
        world2 = ThreadWorld(second)

        def part2(r):
            s = rank_stepper(r, world2, "muon", 12 // second, zero, params=params)
            s.load_state_tensors(state, t)
            log = train(s, r, second, 12 // second, range(10, 20))
            return log, {k: v.copy() for k, v in s.params().items()}

        return in_threads(part2, world2)

    for second in (4, 3):
        plain, zero = run(0, 2, second), run(1, 2, second)
        for r in range(second):
            assert zero[r][0] == plain[0][0]
            for name, p in plain[0][1].items():
                np.testing.assert_array_equal(zero[r][1][name], p, err_msg=f"{second} ranks, rank {r}: {name}")


def _loop_ranks(manifest, run_dir, n, batch, zero):
    world = ThreadWorld(n)

    def rank_main(r):
        dp = DataParallel(ThreadComm(world, r), "pretrain", zero=zero)
        loop.train(_run(manifest, run_dir, rank=r, world=n, batch=batch, dp=dp))

    in_threads(rank_main, world)


def test_the_training_loop_checkpoints_a_sharded_run_and_resumes_it_on_another_world(
    shards,  # noqa: F811 (the fixture imported from test_parallel)
    tmp_path,
    capsys,
):
    whole_dir, run_dir = tmp_path / "whole", tmp_path / "run"
    _loop_ranks(shards, whole_dir, n=2, batch=2, zero=0)  # the unsharded run, 2 x 2
    _loop_ranks(shards, run_dir, n=2, batch=2, zero=1)
    ref, _ = checkpoint.load(whole_dir / "ckpt_00000004.bin")
    got, meta = checkpoint.load(run_dir / "ckpt_00000004.bin")
    assert got.keys() == ref.keys() and meta["identity"]["settings"]["batch_size"] == 4  # the global batch
    for name in ref:  # the checkpoint of the sharded run is the native one, every moment gathered
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
    (run_dir / "ckpt_00000004.bin").unlink()  # both ranks died after step 2's checkpoint
    (run_dir / "final.bin").unlink()
    capsys.readouterr()
    _loop_ranks(shards, run_dir, n=4, batch=1, zero=1)  # 4 ranks of 1: the same global batch resumes
    assert f"resuming from step 2 ({run_dir / 'ckpt_00000002.bin'})" in capsys.readouterr().err
    resumed, _ = checkpoint.load(run_dir / "ckpt_00000004.bin")
    assert not (run_dir / "previous").exists()
    for name in ref:  # float64: the sums of 4 partial means differ from those of 2 by rounding only
        np.testing.assert_allclose(resumed[name], ref[name], rtol=1e-10, atol=1e-13, err_msg=name)


# ---- the bf16 engine's ZeRO-1: the wiring (the engine itself: tests/test_engine_zero_gpu.py) ------------


def test_a_zero_runs_gradient_hook_carries_its_transport_to_the_engine_factory():
    """`make_stepper` builds the bf16 engine sharded from the hook's `zero_comm`; a stage's own gradient
    hook needs every gradient, so ZeRO with one is refused in one line before any engine is built."""
    comm = ThreadComm(ThreadWorld(2), 0)
    assert DataParallel(comm, "pretrain", zero=1).grad_hook().zero_comm is comm
    assert DataParallel(comm, "pretrain", zero=0).grad_hook().zero_comm is None
    hook = DataParallel(comm, "sft", zero=1).grad_hook(then=lambda grads: None)
    bf16 = TrainConfig.from_section(validate({"pretrain": {"precision": "bf16"}})["pretrain"])
    with pytest.raises(UserError, match=r"^sft\.zero 1: this stage's own gradient hook needs every gradient"):
        make_stepper(bf16, CFG, transformer.init_params(CFG, seed=0), np, stage="sft", grad_hook=hook)


def test_wrapping_a_sharded_engine_reports_its_share_of_the_moments(capsys):
    """Rank 0 of a ZeRO-1 run on the bf16 engine says what its moment buffers hold against the unsharded
    engine's (two float32 values an element of each layout); an engine built unsharded is refused."""
    from nanoeuler.kernels.bf16.plan import plan_layout
    from nanoeuler.train.stepper import EngineStepper

    comm = ThreadComm(ThreadWorld(2), 0)
    dp = DataParallel(comm, "pretrain", zero=1)
    span = plan_layout(CFG, shards=2).span
    engine = SimpleNamespace(cfg=CFG, zero=comm, Mo=np.zeros(span, np.float32), Vo=np.zeros(span, np.float32))
    wrapped = dp.wrap(EngineStepper(engine))
    assert optimizer_bytes(wrapped) == 8 * span < 8 * plan_layout(CFG).total
    err = capsys.readouterr().err
    assert f"rank 0 keeps {8 * span / 2**20:.1f} MiB of optimizer state" in err
    assert f"({8 * plan_layout(CFG).total / 2**20:.1f} MiB unsharded)" in err
    with pytest.raises(UserError, match="built unsharded"):
        dp.wrap(EngineStepper(SimpleNamespace(cfg=CFG, zero=None)))
