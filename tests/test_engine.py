"""The decode engine (NumPy backend): equal to the reference `Generator`, batched ragged prompts, and
self-speculative decoding (greedy token-identical; sampling with the exact output distribution)."""

import itertools
import threading

import numpy as np
import pytest

from nanoeuler.infer.engine import DecodeEngine, sampled_kept
from nanoeuler.infer.generate import Generator
from nanoeuler.infer.sampling import Sampling, accept_or_resample, sampling_probs
from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig

GREEDY = Sampling(temperature=0.0)


def _model(dtype=np.float64, ctx=24, K=3, V=97, scale=20.0, seed=3):
    cfg = ModelConfig(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ctx_len=ctx, mtp_heads=K)
    params = transformer.init_params(cfg, seed=seed, dtype=dtype)
    for name in transformer.head_weight_names(cfg):  # far-from-uniform logits: no near-ties in greedy
        params[name] = params[name] * scale
    return params, cfg


@pytest.fixture(scope="module")
def model():
    return _model()


def test_greedy_equals_the_reference_generator_across_a_context_slide(model):
    params, cfg = model
    ref, eng = Generator(params, cfg), DecodeEngine.from_params(params, cfg, "cpu")
    for prompt, n in (([5, 17, 42, 8], 3 * cfg.ctx_len), (list(range(1, cfg.ctx_len + 5)), 40)):
        assert eng.generate([prompt], n, GREEDY, speculative=False)[0] == ref.generate(prompt, n, GREEDY)


def test_sampling_draws_the_reference_generators_tokens(model):
    params, cfg = model
    s = Sampling(temperature=1.0, top_k=20, top_p=0.9, seed=7)
    ref, eng = Generator(params, cfg), DecodeEngine.from_params(params, cfg, "cpu")
    assert list(eng.stream([3, 4], 50, s)) == ref.generate([3, 4], 50, s)


def test_batched_ragged_prompts_equal_one_at_a_time(model):
    params, cfg = model
    eng, ref = DecodeEngine.from_params(params, cfg, "cpu"), Generator(params, cfg)
    prompts = [[1, 2, 3], [9], list(range(10, 30)), [4, 4, 4, 4, 4]]
    s = Sampling(temperature=0.9, top_k=0, top_p=1.0, seed=2)
    got = eng.generate(prompts, 30, s, stop_ids={7})
    for i, p in enumerate(prompts):
        assert got[i] == ref.generate(p, 30, Sampling(0.9, 0, 1.0, 2 + i), stop_ids={7})


def test_prefill_many_equals_one_prefill_a_slot(model):
    params, cfg = model
    be = DecodeEngine.from_params(params, cfg, "cpu").backend
    prompts = [[1, 2, 3], [9], list(range(10, 30)), [4] * 5]
    be.start(4)
    want = [be.prefill(b, p) for b, p in enumerate(prompts)]
    caches = [k.copy() for k in be.k + be.v]
    for k in be.k + be.v:
        k[:] = 0
    got = be.prefill_many([0, 1, 2, 3], prompts)
    assert got.shape == (4, cfg.mtp_heads, cfg.vocab_size)
    for b in range(4):
        np.testing.assert_allclose(got[b], want[b], rtol=1e-12, atol=1e-12)
    for k, want_k in zip(be.k + be.v, caches):  # the same cache rows, which the next steps read
        np.testing.assert_allclose(k, want_k, rtol=1e-12, atol=1e-12)


def test_speculative_greedy_is_token_identical_and_drafts_get_accepted(model):
    params, cfg = model
    # a model whose draft heads are its head 0 shifted: half the drafts are right
    eng = DecodeEngine.from_params(params, cfg, "cpu")
    ref = Generator(params, cfg)
    for prompt in ([5, 17, 42, 8], [1], list(range(30, 50))):
        n = 2 * cfg.ctx_len + 3
        assert list(eng.stream(prompt, n, GREEDY, speculative=True)) == ref.generate(prompt, n, GREEDY)
    assert eng.stats.passes > 0 and eng.stats.tokens >= eng.stats.passes
    stop = ref.generate([5, 17], 6, GREEDY)[3]
    assert list(eng.stream([5, 17], 20, GREEDY, {stop}, speculative=True)) == ref.generate([5, 17], 20, GREEDY, {stop})


def test_speculative_greedy_accepts_every_draft_when_the_heads_agree():
    """A model trained to repeat itself: drafts from heads 1.. that predict the same token as head 0."""
    params, cfg = _model(K=4)
    # every head reads the same weights and the model's next token is (mostly) a fixed point
    for k in range(1, 4):
        params[f"mtp_heads.{k}.weight"] = params["lm_head.weight"]
    params["embed_tokens.weight"] = params["embed_tokens.weight"] * 0  # no input dependence: constant logits
    eng = DecodeEngine.from_params(params, cfg, "cpu")
    out = list(eng.stream([1, 2], 13, GREEDY, speculative=True))
    assert out == [out[0]] * 13
    assert eng.stats.acceptance() == [1.0, 1.0, 1.0] and eng.stats.tokens_per_pass() == 4.0
    eng.stats = type(eng.stats)()  # by default on the CPU: drafts this good are verified after the shadow steps
    assert list(eng.stream([1, 2], 40, GREEDY)) == [out[0]] * 40
    assert eng.stats.passes > 0 and eng.stats.tokens_per_pass() == 4.0


def test_accept_or_resample_gives_the_target_distribution():
    rng = np.random.default_rng(0)
    p, q = np.array([0.1, 0.6, 0.3]), np.array([0.5, 0.2, 0.3])
    n = 40000
    counts = np.zeros(3)
    for _ in range(n):
        d = rng.choice(3, p=q)
        counts[accept_or_resample(p, q, d, rng.random(), rng)[1]] += 1
    np.testing.assert_allclose(counts / n, p, atol=0.01)


def test_sampled_kept_keeps_drafts_drawn_from_the_target_and_stops_at_an_impossible_one():
    """A draft drawn from head 0's own distribution (q = p) always stands, and the token after the last row is
    drawn from it; a draft head 0 gives probability 0 falls, and its replacement comes from p - q."""
    rng = np.random.default_rng(1)
    s = Sampling(temperature=1.0, top_k=0, top_p=1.0)
    target = rng.standard_normal((4, 6))  # head 0's logits at 4 rows, 6 tokens
    ps = [sampling_probs(z, 1.0) for z in target]
    for seed in range(20):
        draws = np.random.default_rng(seed)
        block = np.array([0] + [int(draws.choice(6, p=p)) for p in ps[:3]])
        assert sampled_kept(target, block, ps[:3], draws, s)[0] == 3
    banned = target.copy()
    banned[1, 2] = -np.inf  # head 0 never picks token 2 after row 1
    q = np.eye(6)[2]  # the draft head was sure of token 2
    for seed in range(20):
        a, tok = sampled_kept(
            banned, np.array([0, int(np.argmax(ps[0])), 2, 0]), [ps[0], q, ps[2]], np.random.default_rng(seed), s
        )
        assert a == 1 and tok != 2


def _sequence_probs(params, cfg, prompt, n, s):
    """Exact probability of every n-token continuation under plain sampling with `s` (float64)."""
    V = cfg.vocab_size
    probs = {}
    for seq in itertools.product(range(V), repeat=n):
        pr, hist = 1.0, list(prompt)
        for t in seq:
            lg = transformer.logits(params, np.array([hist]), cfg)[0, -1]
            pr *= sampling_probs(lg, s.temperature, s.top_k, s.top_p)[t]
            hist.append(t)
        probs[seq] = pr
    return probs


@pytest.mark.parametrize("top_k", [0, 3])
def test_speculative_sampling_has_the_plain_output_distribution(top_k):
    """A 4-token vocabulary, 3 draft heads: the frequencies of all 64 three-token continuations over many seeds
    against their exact probabilities (chi-square, 63 degrees of freedom, p > 0.001)."""
    params, cfg = _model(V=4, K=4, scale=60.0, seed=5, ctx=16)
    s = Sampling(temperature=1.0, top_k=top_k, top_p=1.0)
    prompt, n = [1, 2, 3], 3
    exact = _sequence_probs(params, cfg, prompt, n, s)
    eng = DecodeEngine.from_params(params, cfg, "cpu")
    runs = 3000
    counts = dict.fromkeys(exact, 0)
    for seed in range(runs):
        out = tuple(eng.stream(prompt, n, Sampling(1.0, top_k, 1.0, seed), speculative=True))
        counts[out] += 1
    assert eng.stats.passes > runs / 2  # the drafts were really verified
    seqs = [k for k in exact if exact[k] * runs >= 5]  # cells with enough expected counts; the rest pooled
    obs = np.array([counts[k] for k in seqs] + [runs - sum(counts[k] for k in seqs)], dtype=float)
    exp = np.array([exact[k] * runs for k in seqs] + [runs * (1 - sum(exact[k] for k in seqs))])
    keep = exp > 0
    chi2 = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    # the 0.999 quantile of chi-square is below dof + 4.5 sqrt(2 dof) + 10 for these sizes
    assert chi2 < dof + 4.5 * np.sqrt(2 * dof) + 10, (chi2, dof)
    assert min(eng.stats.acceptance()) < 1.0  # drafts were rejected too: the resample path ran


def test_sample_command_speculative_prints_the_same_greedy_text(tmp_path):
    import subprocess
    import sys

    from train_fixtures import make_tokenizer, save_random_model

    save_random_model(tmp_path / "m.bin", make_tokenizer())
    cmd = [
        sys.executable,
        "-m",
        "nanoeuler",
        "sample",
        "--ckpt",
        str(tmp_path / "m.bin"),
        "--prompt",
        "It was",
        "--max-new-tokens",
        "20",
        "--temperature",
        "0",
        "--device",
        "cpu",
    ]
    plain = subprocess.run(cmd + ["--no-speculative"], capture_output=True, text=True, timeout=60)
    spec = subprocess.run(cmd + ["--speculative"], capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and spec.returncode == 0, plain.stderr + spec.stderr
    assert spec.stdout == plain.stdout and plain.stdout.startswith("It was")


class _FeedsItself:
    """The NumPy backend with the GPU backend's self-feeding calls (`greedy_steps`, `greedy_passes`), done
    one step at a time: the engine's bookkeeping around them (context ends, refills, stop ids) is the same."""

    def __init__(self, be, cfg):
        self.be, self.cfg = be, cfg

    def __getattr__(self, name):
        return getattr(self.be, name)

    def greedy_steps(self, tokens, pos, n):
        tokens, pos, ctx = np.array(tokens), np.array(pos), self.cfg.ctx_len
        for _ in range(n):
            tokens = self.be.decode(tokens, pos, GREEDY, 0, [None] * len(tokens), np.ones(len(tokens), bool))
            pos = np.minimum(pos + 1, ctx - 1)  # finished rows may run on, below the context length
            yield tokens.copy()

    def greedy_passes(self, sure, drafts, pos):
        K, block = self.cfg.mtp_heads, np.array([sure] + list(drafts))
        while pos + K <= self.cfg.ctx_len:
            ids = self.be.verify_argmax(block, pos)
            a = 0
            while a < K - 1 and ids[0, a] == block[a + 1]:
                a += 1
            yield a, block, ids[:, a]
            block, pos = ids[:, a].copy(), pos + a + 1


@pytest.mark.parametrize("cost,probed", [(100.0, True), (0.0, False)])
def test_default_speculation_goes_on_plainly_where_it_does_not_pay(model, monkeypatch, cost, probed):
    """On by default (not asked for), a greedy stream on a backend with self-feeding passes (the GPU's) whose
    first PROBE_PASSES passes keep fewer tokens a pass than the backend's verify_cost goes on plainly; the
    tokens are plain greedy's either way (a switch from greedy_passes to greedy_steps mid-stream)."""
    from nanoeuler.infer import engine as engine_mod

    params, cfg = model
    base = DecodeEngine.from_params(params, cfg, "cpu")
    monkeypatch.setattr(type(base.backend), "verify_cost", cost)
    p, n = [5, 17, 42, 8], cfg.ctx_len + 20  # across a refill
    want = list(base.stream(p, n, GREEDY, speculative=False))
    eng = DecodeEngine(_FeedsItself(base.backend, cfg), cfg)
    assert list(eng.stream(p, n, GREEDY)) == want
    assert (eng.stats.passes == engine_mod.PROBE_PASSES) == probed
    eng.stats = type(eng.stats)()
    assert list(eng.stream(p, n, GREEDY, speculative=True)) == want  # asked for: no probe
    assert eng.stats.passes > engine_mod.PROBE_PASSES
    eng.stats = type(eng.stats)()
    assert eng.generate([p], n, GREEDY) == [want]
    assert (eng.stats.passes == engine_mod.PROBE_PASSES) == probed


@pytest.mark.parametrize("cost", [100.0, 0.0])
def test_default_speculation_on_the_cpu_verifies_only_where_the_heads_would_pay(model, monkeypatch, cost):
    """On the NumPy backend a default-on greedy stream starts plainly and checks the draft heads on a few
    steps (`greedy_step`, `draft_ids`): with passes priced out (cost 100) it never verifies; priced free, it does. The
    tokens are plain greedy's either way, across a context refill and with a stop id."""
    params, cfg = model
    eng = DecodeEngine.from_params(params, cfg, "cpu")
    monkeypatch.setattr(type(eng.backend), "verify_cost", cost)
    for p, n in (([5, 17, 42, 8], cfg.ctx_len + 20), ([1], 3), (list(range(30, 50)), 2 * cfg.ctx_len)):
        eng.stats = type(eng.stats)()
        assert list(eng.stream(p, n, GREEDY)) == list(eng.stream(p, n, GREEDY, speculative=False))
    assert (eng.stats.passes > 0) == (cost == 0.0)
    stop = list(eng.stream([5, 17], 9, GREEDY, speculative=False))[-1]
    plain = list(eng.stream([5, 17], 40, GREEDY, {stop}, speculative=False))
    assert list(eng.stream([5, 17], 40, GREEDY, {stop})) == plain


def test_default_speculation_on_the_cpu_never_verifies_drafts_that_are_never_right():
    """Draft heads that never agree with the text (an untrained model's): no verify pass at all, whatever
    the timing, since 1 + 0 kept drafts a pass never beats a pass's cost."""
    params, cfg = _model(K=4, seed=11)
    for k in range(1, 4):  # a draft head that always proposes a token head 0 never picks
        w = np.zeros_like(params["lm_head.weight"])
        w[cfg.vocab_size - 1] = 1.0
        params[f"mtp_heads.{k}.weight"] = w
        params["lm_head.weight"][cfg.vocab_size - 1] = -1e3 * np.abs(params["lm_head.weight"]).max()
    eng = DecodeEngine.from_params(params, cfg, "cpu")
    out = list(eng.stream([3, 1, 4], 2 * cfg.ctx_len, GREEDY))
    assert out == Generator(params, cfg).generate([3, 1, 4], 2 * cfg.ctx_len, GREEDY)
    assert eng.stats.passes == 0 and eng.stats.plain > len(out) // 2


def test_steps_that_feed_themselves_give_the_same_tokens(model):
    params, cfg = model
    eng = DecodeEngine.from_params(params, cfg, "cpu")
    fed = DecodeEngine(_FeedsItself(eng.backend, cfg), cfg)
    prompts = [[5, 17, 42, 8], [1], list(range(30, 50))]
    for p in prompts:
        for spec in (False, True):
            n = 2 * cfg.ctx_len + 3  # across context refills
            assert list(fed.stream(p, n, GREEDY, speculative=spec)) == list(eng.stream(p, n, GREEDY, speculative=spec))
        assert list(fed.stream(p, 40, GREEDY, {7, 11})) == list(eng.stream(p, 40, GREEDY, {7, 11}))
    for stop in (frozenset(), {7}):
        want = eng.generate(prompts, 2 * cfg.ctx_len, GREEDY, stop_ids=stop, speculative=False)
        assert fed.generate(prompts, 2 * cfg.ctx_len, GREEDY, stop_ids=stop, speculative=False) == want


def test_cpu_logits_equal_the_model_and_blas_threads_are_restored(model):
    """The backend's folded, stacked weights give the model's own logits (float64), for a long prefill
    (BLAS on its threads), a verify pass and a plain step; the caller's BLAS thread count is left as it was."""
    from nanoeuler.infer import cpu

    params, cfg = model
    be = cpu.CpuBackend(params, cfg, threads=2)
    before = cpu.blas_threads(3)
    try:
        monkey_macs, cpu.THREADED_MACS = cpu.THREADED_MACS, 1  # every call counts as long here
        ids = [5, 17, 42, 8, 1, 2, 3]
        be.start(1)
        got = be.prefill(0, ids[:4])[0]
        want = transformer.logits(params, np.array([ids[:4]]), cfg)[0, -1]
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
        ver = be.verify(np.array(ids[4:]), 4)[0]  # head 0 at rows 4..6
        np.testing.assert_allclose(ver, transformer.logits(params, np.array([ids]), cfg)[0, 4:], rtol=1e-9, atol=1e-9)
        for k in range(1, cfg.mtp_heads):  # the draft heads too
            want_k = transformer.logits(params, np.array([ids]), cfg, head=k)[0, 4:]
            np.testing.assert_allclose(be.verify(np.array(ids[4:]), 4)[k], want_k, rtol=1e-9, atol=1e-9)
        assert cpu.blas_threads(3) in (0, 3)  # 0: no OpenBLAS found, nothing to restore
    finally:
        cpu.THREADED_MACS = monkey_macs
        cpu.blas_threads(before or 1)


def test_step_threads_follow_the_faster_measured_count():
    """One-row steps run on the thread count measured faster; a try that loses waits twice as long."""
    from nanoeuler.infer.cpu import StepThreads

    def run(t, seconds, steps):
        picked = []
        for _ in range(steps):
            n = t.pick()
            picked.append(n)
            t.record(seconds[n])
        return picked

    fast2 = StepThreads(2)
    assert run(fast2, {1: 0.04, 2: 0.025}, 40)[-20:].count(2) >= 18  # two threads win and stay
    busy = StepThreads(2)
    picked = run(busy, {1: 0.04, 2: 0.4}, 200)
    assert picked.count(2) <= 4 and busy.interval >= 256  # tries of the slow count back off
    assert StepThreads(1).pick() == 1 and run(StepThreads(1), {1: 0.01}, 20) == [1] * 20


def test_cpu_backend_keeps_float32_weights_in_float32():
    """No float64 creeps in (a NumPy float64 scalar would turn a product into a float64 one, twice the bytes)."""
    from nanoeuler.infer import cpu

    params, cfg = _model(dtype=np.float32)
    be = cpu.CpuBackend(params, cfg)
    seen = []
    real = cpu._mm
    try:
        cpu._mm = lambda x, w: seen.append((x.dtype, w.dtype)) or real(x, w)
        be.start(1)
        be.prefill(0, [1, 2, 3])
        be.verify(np.array([4, 5, 6]), 3)
        be.decode(np.array([7]), np.array([6]), GREEDY, 0, [None], np.ones(1, bool))
    finally:
        cpu._mm = real
    assert set(seen) == {(np.dtype(np.float32), np.dtype(np.float32))}
    assert be.k[0].dtype == np.float32


def test_step_threads_try_the_other_count_when_a_step_turns_slow():
    from nanoeuler.infer.cpu import StepThreads

    t = StepThreads(2)
    t.cur, t.mean, t.left = 1, 0.02, 500  # two threads chosen on a quiet machine, the next try far off
    assert t.pick() == 2
    t.record(0.2)  # one slow step: a preemption, perhaps
    assert t.pick() == 2
    t.record(0.2)  # two: the machine got busy
    assert t.pick() == 1 and t.trying
    t.record(0.04)
    assert t.pick() == 1 and not t.trying  # one thread measured faster than two threads' mean now
    t.record(0.2)
    t.record(0.2)
    assert t.pick() == 1  # on one thread, slow steps do not make two threads try


def test_default_speculation_on_random_heads_pays_for_no_pass():
    """Untrained heads (random, seeded): the default stream runs exactly the plain run's forward passes, the
    same rows in the same calls, and no verify pass; its only extra work is the probe, the draft heads of
    SHADOW_STEPS + 1 recorded states every RECHECK_TOKENS tokens, in one product each."""
    from nanoeuler.infer import engine as engine_mod

    params, cfg = _model(K=4, seed=5)
    eng = DecodeEngine.from_params(params, cfg, "cpu")
    be = eng.backend
    fed, drafts = [], []
    rows, draft_ids = be._rows, be.draft_ids
    be._rows = lambda ids, *a: fed.append(len(ids)) or rows(ids, *a)
    be.draft_ids = lambda states: drafts.append(len(states)) or draft_ids(states)
    p, n = [5, 17, 42, 8], 300  # across context refills (ctx_len 24)
    plain = list(eng.stream(p, n, GREEDY, speculative=False))
    plain_fed, fed[:] = fed[:], []
    assert list(eng.stream(p, n, GREEDY)) == plain
    assert fed == plain_fed and eng.stats.passes == 0
    rounds = -(-n // engine_mod.RECHECK_TOKENS)
    assert 0 < len(drafts) <= rounds and set(drafts) == {engine_mod.SHADOW_STEPS + 1}


def test_long_prefill_in_shares_equals_the_model(monkeypatch):
    """A long one-slot call is fed in shares by `threads` workers (each its own thread), attention in causal
    chunks: the logits equal the model's (float64), the cache equals the one row-at-a-time feeding writes,
    for a prefill, a prefill after a cached prefix, and the steps after them."""
    from nanoeuler.infer import cpu

    cfg = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ctx_len=300, mtp_heads=3)
    params = transformer.init_params(cfg, seed=3, dtype=np.float64)
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 97, 290)]
    want = [transformer.logits(params, np.array([ids]), cfg, head=k)[0] for k in range(3)]
    monkeypatch.setattr(cpu, "THREADED_MACS", 1)  # this small model's prefill counts as long
    ref = cpu.CpuBackend(params, cfg, threads=1)
    ref.start(1)
    for t in range(len(ids)):  # one row at a time: the decode path
        ref.verify(np.array(ids[t : t + 1]), t)
    for threads in (1, 2, 3):
        be = cpu.CpuBackend(params, cfg, threads=threads)
        workers = set()
        feed = be._feed_share
        be._feed_share = lambda *a: workers.add(threading.get_ident()) or feed(*a)
        be.start(1)
        for n in (cpu.LONG_ROWS, 150, 290):
            got = be.prefill(0, ids[:n])
            np.testing.assert_allclose(got, np.stack([w[n - 1] for w in want]), rtol=1e-9, atol=1e-9)
        assert len(workers) == threads
        for k, k_ref in zip(be.k + be.v, ref.k + ref.v):
            np.testing.assert_allclose(k[:, :, :290], k_ref[:, :, :290], rtol=1e-9, atol=1e-12)
        be.prefill(0, ids[:20])
        got = be.prefill_from(0, ids, 20)  # rows 20.. attend to the cached 0..19 too
        np.testing.assert_allclose(got[0], want[0][-1], rtol=1e-9, atol=1e-9)
        step = be.verify(np.array(ids[286:290]), 286)[0]
        np.testing.assert_allclose(step, want[0][286:290], rtol=1e-9, atol=1e-9)


def test_long_prefill_a_failing_worker_raises_its_own_error(monkeypatch):
    """A worker that fails breaks the others' wait: the call raises that worker's error (not a broken
    barrier, not a hang), and the next call works."""
    from nanoeuler.infer import cpu

    params, cfg = _model(ctx=200)
    monkeypatch.setattr(cpu, "THREADED_MACS", 1)
    be = cpu.CpuBackend(params, cfg, threads=2)
    be.start(1)
    attend = be._attend_causal

    def fails_off_main(*a):
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("a worker's failure")
        return attend(*a)

    be._attend_causal = fails_off_main
    with pytest.raises(ValueError, match="a worker's failure"):
        be.prefill(0, [t % cfg.vocab_size for t in range(150)])
    be._attend_causal = attend
    ids = [t % cfg.vocab_size for t in range(140)]  # two workers again
    want = transformer.logits(params, np.array([ids]), cfg)[0, -1]
    np.testing.assert_allclose(be.prefill(0, ids)[0], want, rtol=1e-9, atol=1e-9)
