"""Data-parallel training on the CPU: world discovery, the NCCL id's rendezvous, the partition of the
windows, N ranks x B against 1 x N*B in float64 (ranks are processes averaging through pipes, a test
double of NCCL), rank 0 alone writing, resume on every rank, and dead ranks."""

import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from nanoeuler import checkpoint
from nanoeuler.config import validate
from nanoeuler.errors import UserError
from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig
from nanoeuler.train import loop, parallel
from nanoeuler.train.loader import RandomWindows, ShardSplit
from nanoeuler.train.parallel import DataParallel, World, exchange_id, rendezvous_path, world_from_env
from nanoeuler.train.sft import EpochBatches
from nanoeuler.train.stepper import NonFinite
from train_fixtures import write_shards

CFG = ModelConfig(vocab_size=40, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ctx_len=8, mtp_heads=2)
FORK = mp.get_context("fork")


# ---- the world and the rendezvous ---------------------------------------------------------------


def test_world_comes_from_the_launchers_variables():
    assert world_from_env({}) is None
    assert world_from_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2"}) == World(2, 4, 2)
    assert world_from_env({"RANK": "1", "WORLD_SIZE": "2"}) == World(1, 2, 1)  # LOCAL_RANK defaults to RANK
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "3"}
    assert world_from_env(slurm) == World(3, 4, 3)
    assert world_from_env({**slurm, "RANK": "0", "WORLD_SIZE": "1"}) == World(0, 1, 0)  # the explicit names win
    assert world_from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}) is None
    assert world_from_env({"RANK": "0", "WORLD_SIZE": "1"}).is_root  # a launched world of one: the NCCL path


@pytest.mark.parametrize(
    "env, words",
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, "0 <= rank < world size"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"WORLD_SIZE": "2"}, "RANK is not set"),
    ],
)
def test_a_bad_world_is_one_clear_error(env, words):
    with pytest.raises(UserError, match=words):
        world_from_env(env)


def test_the_rendezvous_file_is_set_or_derived_from_the_job(tmp_path):
    assert rendezvous_path({parallel.ENV_RENDEZVOUS: str(tmp_path / "id")}) == tmp_path / "id"
    assert rendezvous_path({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3"}).name == "nanoeuler-nccl-77.3.id"
    assert rendezvous_path({"MASTER_PORT": "29500"}) == parallel.TcpRendezvous("127.0.0.1", 29500)
    assert rendezvous_path(
        {parallel.ENV_RENDEZVOUS: "tcp://node07:6000", "MASTER_PORT": "1"}
    ) == parallel.TcpRendezvous("node07", 6000)
    with pytest.raises(UserError, match="NANOEULER_RENDEZVOUS"):
        rendezvous_path({})
    with pytest.raises(UserError, match="MASTER_PORT: the port must be a number in 1..65535"):
        rendezvous_path({"MASTER_ADDR": "node01", "MASTER_PORT": "http"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_of_a_job(env, out):
    """One SLURM task: its world and rendezvous from the environment, then rank 0's id."""
    world = world_from_env(env)
    uid = exchange_id(world, rendezvous_path(env), make_id=lambda: bytes(range(7, 135)), timeout=30)
    out.put((world.rank, world.local_rank, uid))


@pytest.mark.parametrize("how", ["tcp", "file"])
def test_tasks_of_two_nodes_get_rank_0s_id_through_a_tcp_store_or_a_shared_file(tmp_path, how):
    """Three processes as srun starts them on two nodes (tasks 0, 1 on the first, 2 on the second), the
    others before rank 0: each reads its rank from SLURM's variables and receives rank 0's id."""
    where = (
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        if how == "tcp"
        else {parallel.ENV_RENDEZVOUS: str(tmp_path / "shared" / "nccl.id")}
    )
    (tmp_path / "shared").mkdir()
    out = FORK.Queue()
    tasks = [
        {"SLURM_JOB_ID": "9", "SLURM_PROCID": str(r), "SLURM_NTASKS": "3", "SLURM_LOCALID": str(local), **where}
        for r, local in ((2, 0), (1, 1), (0, 0))
    ]
    procs = []
    for env in tasks:
        procs.append(FORK.Process(target=_rank_of_a_job, args=(env, out)))
        procs[-1].start()
        time.sleep(0.3)  # rank 0 comes last: the others retry until it serves
    got = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert got == [(0, 0, bytes(range(7, 135))), (1, 1, bytes(range(7, 135))), (2, 0, bytes(range(7, 135)))]


def test_a_tcp_rendezvous_names_its_address_when_rank_0_never_comes_or_its_port_is_taken():
    port = _free_port()
    where = parallel.TcpRendezvous("127.0.0.1", port)
    with pytest.raises(UserError, match=rf"rank 1: rank 0's NCCL id did not appear in tcp://127.0.0.1:{port} "):
        exchange_id(World(1, 2, 1), where, make_id=None, timeout=0.3)
    with socket.create_server(("", port)):
        with pytest.raises(UserError, match=f"rank 0: cannot listen on port {port} .* choose another MASTER_PORT"):
            exchange_id(World(0, 2, 0), where, make_id=lambda: b"x", timeout=1)
    with pytest.raises(UserError, match=r"rank 0: 0 of the other 2 ranks fetched the NCCL id from tcp://"):
        exchange_id(World(0, 3, 0), where, make_id=lambda: b"x", timeout=0.3)


def test_rank_0_passes_the_nccl_id_to_the_others_through_the_file(tmp_path):
    path, got = tmp_path / "nccl.id", {}

    def other(rank):
        got[rank] = exchange_id(World(rank, 3, rank), path, make_id=None, timeout=10)

    threads = [threading.Thread(target=other, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    time.sleep(0.2)  # the others wait for the file
    uid = exchange_id(World(0, 3, 0), path, make_id=lambda: bytes(range(128)), timeout=10)
    for t in threads:
        t.join()
    assert got == {1: uid, 2: uid} and uid == bytes(range(128))
    exchange_id(World(0, 2, 0), path, make_id=lambda: tuple(range(-5, 123)), timeout=10)  # an older CuPy's id
    assert exchange_id(World(1, 2, 1), path, make_id=None, timeout=10) == tuple(range(-5, 123))
    with pytest.raises(UserError, match=r"rank 1: rank 0's NCCL id did not appear .* all 2 ranks running"):
        exchange_id(World(1, 2, 1), tmp_path / "never.id", make_id=None, timeout=0.2)


def test_timeout_and_gpus_are_checked():
    assert parallel.timeout_from_env({}) == parallel.DEFAULT_TIMEOUT
    assert parallel.timeout_from_env({parallel.ENV_TIMEOUT: "30"}) == 30.0
    with pytest.raises(UserError, match="NANOEULER_NCCL_TIMEOUT='0' must be a number of seconds > 0"):
        parallel.timeout_from_env({parallel.ENV_TIMEOUT: "0"})
    assert parallel.gpus_wanted(SimpleNamespace(gpus=None), {"gpus": 4}) == 4
    assert parallel.gpus_wanted(SimpleNamespace(gpus=2), {"gpus": 4}) == 2
    with pytest.raises(UserError, match="--gpus 0"):
        parallel.gpus_wanted(SimpleNamespace(gpus=0), {})
    assert parallel.setup("pretrain", 1, "cpu", env={}) is None  # no launcher, one GPU: the plain path
    with pytest.raises(UserError, match="pretrain.gpus 2: start the run with `nanoeuler pretrain --gpus 2`"):
        parallel.setup("pretrain", 2, "gpu", env={})
    with pytest.raises(UserError, match="is 4 but the launcher started 2 ranks"):
        parallel.setup("pretrain", 4, "gpu", env={"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(UserError, match="runs on GPUs; use --device gpu"):
        parallel.setup("pretrain", 2, "cpu", env={"RANK": "0", "WORLD_SIZE": "2"})


def test_ranks_get_their_rank_the_world_and_the_rendezvous_file():
    env = parallel.rank_env(2, 4, "/tmp/x/nccl.id", base={"PATH": "/bin", "RANK": "9"})
    assert env["RANK"] == "2" and env["LOCAL_RANK"] == "2" and env["WORLD_SIZE"] == "4"
    assert env[parallel.ENV_RENDEZVOUS] == "/tmp/x/nccl.id" and env[parallel.ENV_LAUNCHER] == str(os.getpid())
    assert env["PATH"] == "/bin"


# ---- the data each rank takes --------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    tok = SimpleNamespace(vocab_size=CFG.vocab_size, sha256="0" * 64)
    return write_shards(tmp_path_factory.mktemp("shards"), tok, n_train=6000, n_val=600, shard_tokens=1000)


def test_ranks_take_windows_r_r_plus_n_of_the_one_gpu_stream(shards):
    split = ShardSplit(shards, "train")
    B, N, T, K = 3, 4, CFG.ctx_len, CFG.mtp_heads
    whole = RandomWindows(split, T, K, N * B, seed=5)
    ranks = [RandomWindows(split, T, K, B, seed=5, rank=r, world=N) for r in range(N)]
    for _ in range(5):
        x, y = whole.next_batch()
        parts = [w.next_batch() for w in ranks]
        for r, (xr, yr) in enumerate(parts):
            np.testing.assert_array_equal(xr, x[r::N])
            np.testing.assert_array_equal(yr, y[r::N])
    assert all(w.state() == whole.state() for w in ranks)  # one generator state: rank 0's checkpoint resumes all


def test_sft_ranks_partition_each_batch_and_leave_out_a_tail_shorter_than_the_world():
    examples = [([i, i + 1, i + 2], 1) for i in range(23)]
    B, N = 2, 3
    whole = EpochBatches(examples, N * B, 1, seed=1, K=1, pad_id=0)
    ranks = [EpochBatches(examples, B, 1, seed=1, K=1, pad_id=0, rank=r, world=N) for r in range(N)]
    assert whole.per_epoch == 4 and all(e.per_epoch == 4 for e in ranks)  # 23 = 3*6 + 5: the tail of 5 >= 3
    for step in range(8):
        x = whole.batch(step)[0]
        for r, e in enumerate(ranks):
            np.testing.assert_array_equal(e.batch(step)[0], x[r::N])
    short = [EpochBatches(examples[:20], B, 1, seed=1, K=1, pad_id=0, rank=r, world=N) for r in range(N)]
    assert short[0].per_epoch == 3  # 20 = 3*6 + 2: two examples cannot feed three ranks
    with pytest.raises(UserError, match="2 training examples cannot feed 3 ranks"):
        EpochBatches(examples[:2], B, 1, seed=1, K=1, pad_id=0, world=N)


def test_the_engines_flat_gradient_buffer_is_reduced_in_one_call():
    flat = np.zeros(100)
    views = {"a": flat[0:12].reshape(3, 4), "b": flat[64:70]}
    assert [b is flat for b in parallel.gradient_buffers(views)] == [True]
    apart = {"a": np.zeros((3, 4)), "b": np.zeros(6)}
    assert [id(b) for b in parallel.gradient_buffers(apart)] == [id(apart["a"]), id(apart["b"])]


# ---- a test double of NCCL: processes averaging through pipes ------------------------------------


class PipeComm:
    """Rank 0 gathers every rank's arrays through a pipe and sends them all back; each rank sums them in
    rank order."""

    def __init__(self, rank: int, size: int, conns: list):
        self.rank, self.size, self.conns = rank, size, conns

    def _gather(self, values: list) -> list:
        """Every rank's `values`, in rank order."""
        if self.rank != 0:
            self.conns[0].send(values)
            return self.conns[0].recv()
        parts = [values] + [c.recv() for c in self.conns]
        for c in self.conns:
            c.send(parts)
        return parts

    def _sum(self, values: list) -> list:
        parts = self._gather(values)
        return [sum(p[i] for p in parts) for i in range(len(values))]

    def all_reduce_mean(self, arrays: list) -> None:
        for a, t in zip(arrays, self._sum([np.array(a) for a in arrays])):
            a[...] = t / self.size

    def reduce_scatter_mean(self, src, dst) -> None:
        k, r = dst.size, self.rank
        dst[...] = sum(p[0][r * k : (r + 1) * k] for p in self._gather([np.array(src)])) / self.size

    def all_gather(self, src, dst) -> None:
        dst[...] = np.concatenate([p[0] for p in self._gather([np.array(src)])])

    def mean_scalar(self, value: float) -> float:
        return float(self._sum([np.float64(value)])[0]) / self.size

    def broadcast_int(self, value: int) -> int:
        if self.rank == 0:
            for c in self.conns:
                c.send(value)
            return value
        return self.conns[0].recv()

    def check(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def close(self) -> None:
        for c in self.conns:
            c.close()


def _pipes(n: int) -> list[list]:
    """conns[r]: rank 0 holds one end to each other rank, rank r > 0 the other end of its own."""
    pairs = [FORK.Pipe() for _ in range(n - 1)]
    return [[a for a, _ in pairs]] + [[b] for _, b in pairs]


def _run(shards, run_dir, *, rank=0, world=1, batch=2, steps=4, dp=None):
    sec = validate(
        {
            "pretrain": dict(
                batch_size=batch,
                lr=1e-2,
                min_lr=1e-3,
                warmup_steps=1,
                log_every=1,
                eval_every=1000,
                checkpoint_every=2,
                keep_checkpoints=5,
                grad_clip=1.0,
                steps=steps,
            )
        }
    )["pretrain"]
    windows = RandomWindows(
        ShardSplit(shards, "train"), CFG.ctx_len, CFG.mtp_heads, batch, seed=3, rank=rank, world=world
    )

    class Batches:
        def batch(self, step, micro):
            return windows.next_batch()

        state = staticmethod(windows.state)
        load_state = staticmethod(windows.load_state)

    def init():
        return {n: p.astype(np.float64) for n, p in transformer.init_params(CFG, seed=0).items()}

    return loop.Run(
        stage="pretrain",
        cfg=CFG,
        section=sec,
        total_steps=steps,
        batches=Batches(),
        init_params=init,
        tokenizer_json="{}",
        tokenizer_sha256="0" * 64,
        run_dir=run_dir,
        out=run_dir / "final.bin",
        xp=np,
        progress=False,
        parallel=dp,
    )


def _rank_main(rank, world, conns, shards, run_dirs, batch, steps):
    dp = DataParallel(PipeComm(rank, world, conns), "pretrain")
    loop.train(_run(shards, run_dirs[rank], rank=rank, world=world, batch=batch, steps=steps, dp=dp))
    dp.close()


def _train_ranks(shards, run_dirs, world, batch, steps=4):
    conns = _pipes(world)
    procs = [
        FORK.Process(target=_rank_main, args=(r, world, conns[r], shards, run_dirs, batch, steps)) for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * world


def _metrics(run_dir):
    from nanoeuler.train.rundir import read_jsonl

    records = read_jsonl(run_dir / "metrics.jsonl")
    return [(r["step"], r["loss"], r["grad_norm"], r["tokens_per_s"] > 0) for r in records]


def test_two_ranks_of_b_train_like_one_process_of_2b_and_rank_0_alone_writes(shards, tmp_path):
    one = tmp_path / "one"
    loop.train(_run(shards, one, batch=4))
    dirs = [tmp_path / "rank0", tmp_path / "rank1"]  # rank 1 is given a directory of its own: it stays unmade
    _train_ranks(shards, dirs, world=2, batch=2)
    assert not dirs[1].exists()
    ref, got = _metrics(one), _metrics(dirs[0])
    assert [r[0] for r in got] == [1, 2, 3, 4] and all(r[3] for r in got)
    for (_, loss, norm, _), (_, loss2, norm2, _) in zip(ref, got):
        assert loss2 == pytest.approx(loss, rel=1e-10) and norm2 == pytest.approx(norm, rel=1e-10)
    a, _ = checkpoint.load(one / "ckpt_00000004.bin")
    b, meta = checkpoint.load(dirs[0] / "ckpt_00000004.bin")
    assert set(a) == set(b) and meta["identity"]["settings"]["batch_size"] == 4  # the global batch: 2 x 2
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-10, atol=1e-14, err_msg=name)


def test_resume_restores_every_rank(shards, tmp_path):
    run_dir = tmp_path / "run"
    _train_ranks(shards, [run_dir, run_dir], world=2, batch=2)
    whole, _ = checkpoint.load(run_dir / "ckpt_00000004.bin")
    (run_dir / "ckpt_00000004.bin").unlink()  # as if both ranks died after step 2's checkpoint
    (run_dir / "final.bin").unlink()
    _train_ranks(shards, [run_dir, run_dir], world=2, batch=2)
    resumed, _ = checkpoint.load(run_dir / "ckpt_00000004.bin")
    for name in whole:  # rank 1 started from the checkpoint too (params, moments, windows): bit for bit
        np.testing.assert_array_equal(resumed[name], whole[name], err_msg=name)
    assert [r[0] for r in _metrics(run_dir)] == [1, 2, 3, 4]


# ---- non-finite steps and dead ranks -------------------------------------------------------------


class OtherRanks:
    """A comm whose other rank contributes `peer_loss`; counts the collective calls."""

    def __init__(self, peer_loss=1.0):
        self.rank, self.size, self.peer_loss, self.calls = 0, 2, peer_loss, []

    def all_reduce_mean(self, arrays):
        self.calls.append("grads")

    def mean_scalar(self, value):
        self.calls.append("loss")
        return (value + self.peer_loss) / 2


class Inner:
    t = 0

    def __init__(self, result):
        self.result = result

    def step(self, batch, lr, head_weights=None):
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_the_loss_is_the_mean_over_ranks_and_a_non_finite_one_stops_every_rank():
    comm = OtherRanks(peer_loss=3.0)
    assert DataParallel(comm, "pretrain").wrap(Inner((1.0, 0.5))).step([], 1e-3) == (2.0, 0.5)
    with pytest.raises(NonFinite, match="loss is nan"):  # a peer's NaN loss: this rank stops at the same step
        DataParallel(OtherRanks(peer_loss=float("nan")), "pretrain").wrap(Inner((1.0, 0.5))).step([], 1e-3)
    comm = OtherRanks()
    with pytest.raises(NonFinite, match="loss is inf"):  # its own: still joins the loss average first
        DataParallel(comm, "pretrain").wrap(Inner(NonFinite("loss", float("inf")))).step([], 1e-3)
    assert comm.calls == ["loss"]


def test_a_rank_with_a_nan_loss_still_joins_the_gradient_all_reduce():
    from nanoeuler.train.config import TrainConfig
    from nanoeuler.train.stepper import make_stepper

    calls = []
    sec = validate({"pretrain": {"batch_size": 2}})["pretrain"]
    params = {n: p.astype(np.float64) for n, p in transformer.init_params(CFG, seed=0).items()}
    params["norm.weight"][0] = np.nan
    stepper = make_stepper(TrainConfig.from_section(sec), CFG, params, np, grad_hook=calls.append)
    rng = np.random.default_rng(0)
    w = rng.integers(0, CFG.vocab_size, size=(2, CFG.ctx_len + CFG.mtp_heads))
    y = np.stack([w[:, 1 + k : CFG.ctx_len + 1 + k] for k in range(CFG.mtp_heads)], axis=-1)
    with pytest.raises(NonFinite, match="loss"):
        stepper.step([(w[:, : CFG.ctx_len], y)], 1e-3)
    assert len(calls) == 1 and stepper.t == 0  # the collective ran; the update did not


def test_the_watchdog_names_a_stuck_step_a_gone_launcher_and_an_nccl_error():
    class Broken(OtherRanks):
        def check(self):
            raise RuntimeError("NCCL_ERROR_REMOTE_ERROR")

    dp = DataParallel(Broken(), "pretrain", timeout=0.05, launcher_pid=os.getppid())
    assert "NCCL reported RuntimeError: NCCL_ERROR_REMOTE_ERROR" in dp.problem()
    dp.comm.check = lambda: None
    assert dp.problem() is None
    with dp.busy():
        time.sleep(0.1)
        assert "waited more than 0 s for the other ranks" in dp.problem()
    dp.launcher_pid = -1
    assert dp.problem() == "the launcher of the ranks is gone"


def test_a_rank_whose_peer_died_aborts_with_a_clear_message():
    script = textwrap.dedent("""
        import sys, threading
        from nanoeuler.train.parallel import DataParallel
        class Stuck:  # the peer never answers the loss average
            rank, size = 1, 2
            def mean_scalar(self, value): threading.Event().wait()
            def check(self): pass
            def abort(self): print("communicator aborted", file=sys.stderr, flush=True)
        class Inner:
            t = 0
            def step(self, batch, lr, head_weights=None): return 1.0, 1.0
        dp = DataParallel(Stuck(), "pretrain", timeout=0.3)
        dp.start_watchdog(period=0.05)
        dp.wrap(Inner()).step([], 1e-3)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "nanoeuler pretrain: error: rank 1: a step waited more than 0 s for the other ranks" in done.stderr
    assert "communicator aborted" in done.stderr


def _sleeper(seconds):
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def test_the_launcher_stops_the_others_when_one_rank_dies(capsys):
    procs = [_sleeper(60), _sleeper(60), _sleeper(60)]
    threading.Timer(0.3, lambda: os.kill(procs[1].pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    assert parallel.supervise("pretrain", procs, poll=0.05, grace=5) == 1
    assert time.monotonic() - t0 < 20 and all(p.poll() is not None for p in procs)
    err = capsys.readouterr().err
    assert f"nanoeuler pretrain: error: rank 1 (pid {procs[1].pid}) was killed by SIGKILL; stopped the other 2" in err
    assert "resumes from the last checkpoint" in err
    assert parallel.supervise("sft", [_sleeper(0), _sleeper(0.2)], poll=0.05) == 0
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert parallel.supervise("sft", [_sleeper(60), failing], poll=0.05, grace=5) == 1
    assert f"rank 1 (pid {failing.pid}) exited with status 3" in capsys.readouterr().err


def test_gpus_on_the_cpu_is_one_clear_error_before_any_process_starts(tmp_path, capsys):
    from nanoeuler.cli import main

    conf = tmp_path / "c.yaml"
    conf.write_text("device: cpu\n")
    rc = main(
        [
            "pretrain",
            "--config",
            str(conf),
            "--gpus",
            "2",
            "--shards",
            "m.json",
            "--tokenizer",
            "t.json",
            "--out",
            str(tmp_path / "b.bin"),
        ]
    )
    assert rc == 1
    assert (
        "nanoeuler pretrain: error: data-parallel training (2 ranks) runs on GPUs; use --device gpu"
        in capsys.readouterr().err
    )
