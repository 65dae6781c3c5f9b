"""Data-parallel training on the GPUs of one host: one process a GPU, gradients averaged by NCCL.

    nanoeuler pretrain --gpus 4 ...      # starts 4 processes itself (RANK/WORLD_SIZE/LOCAL_RANK set)
    srun -n 4 nanoeuler pretrain ...     # or under a launcher that sets them (SLURM_PROCID/...)

Every rank builds the same model from the same seed and draws the same seeded stream of training
windows; rank r keeps windows r, r+N, ... of each step's N*B, so N GPUs with batch B train on exactly
the windows of 1 GPU with batch N*B. Between the backward and the clipping the stepper's `grad_hook`
averages the gradients over the ranks (NCCL all-reduce, in place: one call on the bf16 engine's flat
gradient buffer), and the loss is averaged too, so every rank computes the same norm and the same
update and logs the loss of the whole batch. Rank 0 alone reads and writes the run directory
(checkpoints, metrics, the final model, the progress bar); the others load the checkpoint it chose.

Rank 0 makes the NCCL unique id and passes it to the others through a file (`NANOEULER_RENDEZVOUS`,
set by `--gpus`; under SLURM or a RANK/WORLD_SIZE launcher a name in the temporary folder is derived
from the job). A dead rank stops the run: the launcher of `--gpus` notices a child's exit and stops the
others; under another launcher each rank's watchdog aborts the communicator when a step makes no
progress for `NANOEULER_NCCL_TIMEOUT` seconds (default 900) or NCCL reports an error.

    >>> world_from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    World(rank=1, size=2, local_rank=1)
    >>> [list(range(8))[r::2] for r in range(2)]         # windows of a step with B=4, N=2
    [[0, 2, 4, 6], [1, 3, 5, 7]]
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from nanoeuler.errors import UserError
from nanoeuler.train.stepper import NonFinite

ENV_RENDEZVOUS = "NANOEULER_RENDEZVOUS"  # the file that carries rank 0's NCCL unique id
ENV_TIMEOUT = "NANOEULER_NCCL_TIMEOUT"  # seconds a step may wait for the other ranks
ENV_LAUNCHER = "NANOEULER_LAUNCHER_PID"  # set by --gpus: a rank stops when its launcher is gone
DEFAULT_TIMEOUT = 900.0  # long enough for the first step's kernel compilation and rank 0's evaluation


# ---- who am I: the world from the environment -------------------------------------------------------

@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int  # the GPU of this host that the rank uses

    @property
    def is_root(self) -> bool:
        return self.rank == 0


_WORLD_VARS = (("RANK", "WORLD_SIZE", "LOCAL_RANK"), ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))


def world_from_env(env=None) -> World | None:
    """The rank, world size and local rank a launcher set, or None outside a launcher.

    RANK/WORLD_SIZE/LOCAL_RANK first (torchrun's names, and `--gpus`), else SLURM's; a SLURM job of
    one task is no world (a plain single-process run inside an allocation)."""
    env = os.environ if env is None else env
    for rank_var, size_var, local_var in _WORLD_VARS:
        if size_var not in env:
            continue
        size, rank = _int_var(env, size_var), _int_var(env, rank_var)
        local = _int_var(env, local_var) if local_var in env else rank
        if size < 1 or not 0 <= rank < size or local < 0:
            raise UserError(f"{rank_var}={rank} {size_var}={size} {local_var}={local}: "
                            "need 0 <= rank < world size and a local rank >= 0")
        if rank_var == "SLURM_PROCID" and size == 1:
            return None
        return World(rank, size, local)
    return None


def _int_var(env, name: str) -> int:
    try:
        return int(env[name])
    except KeyError:
        raise UserError(f"environment variable {name} is not set (a launcher sets it with the world size)") from None
    except ValueError:
        raise UserError(f"environment variable {name}={env[name]!r} is not an integer") from None


def rendezvous_path(env=None) -> Path:
    """The file that carries the NCCL id: `NANOEULER_RENDEZVOUS`, else one named after the SLURM step
    or the MASTER_ADDR/MASTER_PORT pair, in the temporary folder (one host)."""
    env = os.environ if env is None else env
    if env.get(ENV_RENDEZVOUS):
        return Path(env[ENV_RENDEZVOUS])
    tmp = Path(tempfile.gettempdir())
    if "SLURM_JOB_ID" in env:
        return tmp / f"nanoeuler-nccl-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}.id"
    if "MASTER_PORT" in env:
        return tmp / f"nanoeuler-nccl-{env.get('MASTER_ADDR', 'localhost')}-{env['MASTER_PORT']}.id"
    raise UserError(f"set {ENV_RENDEZVOUS} to a file path every rank can reach (it carries the NCCL id), "
                    "or start the run with --gpus N")


def exchange_id(world: World, path: Path, make_id: Callable[[], bytes | tuple], timeout: float) -> bytes | tuple:
    """Rank 0 writes `make_id()` to `path` (atomically); the others wait up to `timeout` s to read it.
    The id is bytes (CuPy >= 13) or a tuple of ints (older CuPy); every rank gets the same type back."""
    path = Path(path)
    if world.is_root:
        uid = make_id()
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"hex": uid.hex()} if isinstance(uid, bytes) else {"ints": list(uid)}))
        os.replace(tmp, path)
        return uid
    deadline = time.monotonic() + timeout
    while True:
        try:
            record = json.loads(path.read_text())
            return bytes.fromhex(record["hex"]) if "hex" in record else tuple(record["ints"])
        except (FileNotFoundError, json.JSONDecodeError):
            if time.monotonic() > deadline:
                raise UserError(f"rank {world.rank}: rank 0's NCCL id did not appear in {path} within {timeout:.0f} s "
                                f"(are all {world.size} ranks running?)") from None
            time.sleep(0.05)


def timeout_from_env(env=None) -> float:
    env = os.environ if env is None else env
    if not env.get(ENV_TIMEOUT):
        return DEFAULT_TIMEOUT
    try:
        value = float(env[ENV_TIMEOUT])
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UserError(f"{ENV_TIMEOUT}={env[ENV_TIMEOUT]!r} must be a number of seconds > 0")
    return value


# ---- the launcher of --gpus N -----------------------------------------------------------------------

def add_gpus_argument(parser) -> None:
    parser.add_argument("--gpus", type=int, metavar="N",
                        help="train data parallel on N GPUs of this host, one process each "
                             "(default: the stage's `gpus` key, itself default 1)")


def gpus_wanted(args, section: dict) -> int:
    gpus = args.gpus if getattr(args, "gpus", None) is not None else int(section.get("gpus", 1))
    if gpus < 1:
        raise UserError(f"--gpus {gpus}: need at least 1")
    return gpus


def launch_or_setup(stage: str, args, section: dict, device: str):
    """(exit status of the N rank processes this one started, None) when the stage asks for several GPUs and no
    launcher set a world; else (None, this rank's `DataParallel`, or None for a single process). Call it
    before the first CuPy array: it picks the rank's GPU."""
    gpus = gpus_wanted(args, section)
    if gpus > 1 and world_from_env() is None:
        return launch(stage, args.argv, gpus, device), None
    return None, setup(stage, gpus, device)


def launch(stage: str, argv: list[str], gpus: int, device: str, poll: float = 0.2) -> int:
    """Run `nanoeuler <stage> <argv>` as `gpus` processes, one a GPU; the exit status of the run.

    Ranks above 0 keep their standard output to themselves (rank 0 prints the run's progress and summary)."""
    _check_device(gpus, device)
    import cupy as cp

    have = cp.cuda.runtime.getDeviceCount()
    if gpus > have:
        raise UserError(f"--gpus {gpus}: this host has {have} GPU(s)")
    with tempfile.TemporaryDirectory(prefix="nanoeuler-ranks-") as tmp:
        procs = [subprocess.Popen([sys.executable, "-m", "nanoeuler", stage, *argv],
                                  env=rank_env(r, gpus, str(Path(tmp) / "nccl.id")),
                                  stdout=None if r == 0 else subprocess.DEVNULL)
                 for r in range(gpus)]
        return supervise(stage, procs, poll=poll)


def rank_env(rank: int, world: int, rendezvous: str, base=None) -> dict:
    """The environment of rank `rank` of `world` started by `launch`: GPU `rank` of this host."""
    base = os.environ if base is None else base
    return {**base, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            ENV_RENDEZVOUS: rendezvous, ENV_LAUNCHER: str(os.getpid())}


def _check_device(ranks: int, device: str) -> None:
    from nanoeuler.backend import resolve_device

    if resolve_device(device) != "gpu":
        raise UserError(f"data-parallel training ({ranks} ranks) runs on GPUs; use --device gpu")


RESUME_HINT = "Running the same command again resumes from the last checkpoint"


def supervise(stage: str, procs: list, poll: float = 0.2, grace: float = 10.0, hint: str = RESUME_HINT) -> int:
    """Wait for every rank; when one exits with an error, stop the others and say which one it was."""
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                others = [p for p in procs if p.poll() is None]
                _stop(others, grace)
                stopped = f"; stopped the other {len(others)} rank(s)" if others else ""
                print(f"nanoeuler {stage}: error: rank {rank} (pid {procs[rank].pid}) {_describe_exit(code)}"
                      f"{stopped}. {hint}", file=sys.stderr, flush=True)
                return 1
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll)
    except KeyboardInterrupt:
        _stop([p for p in procs if p.poll() is None], grace)
        raise


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _stop(procs: list, grace: float) -> None:
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ---- the communicator ------------------------------------------------------------------------------

class Comm(Protocol):
    """What data parallelism asks of a transport: in-place averages and a broadcast from rank 0."""
    rank: int
    size: int

    def all_reduce_mean(self, arrays: list) -> None:
        """Each (contiguous) array becomes the mean over the ranks of that array, in place."""

    def mean_scalar(self, value: float) -> float: ...

    def broadcast_int(self, value: int) -> int:
        """Rank 0's `value` on every rank."""

    def check(self) -> None:
        """Raise if the transport reported an asynchronous error (a peer is gone)."""

    def abort(self) -> None: ...

    def close(self) -> None: ...


class NcclComm:
    """`Comm` over `cupy.cuda.nccl`, on the current CUDA stream (the all-reduce is queued, not waited for)."""

    def __init__(self, world: World, uid: tuple):
        from cupy.cuda import nccl

        self.nccl, self.rank, self.size = nccl, world.rank, world.size
        self.comm = nccl.NcclCommunicator(world.size, uid, world.rank)
        # ncclAvg (NCCL >= 2.10) averages inside the reduction; else a sum and a scale
        self._avg = getattr(nccl, "NCCL_AVG", None)

    def _dtype(self, a) -> int:
        kinds = {"float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "int64": "NCCL_INT64"}
        return getattr(self.nccl, kinds[a.dtype.name])

    def all_reduce_mean(self, arrays: list) -> None:
        import cupy as cp

        stream = cp.cuda.get_current_stream().ptr
        op = self.nccl.NCCL_SUM if self._avg is None else self._avg
        self.nccl.groupStart()  # several buffers: one fused launch
        for a in arrays:
            self.comm.allReduce(a.data.ptr, a.data.ptr, a.size, self._dtype(a), op, stream)
        self.nccl.groupEnd()
        if self._avg is None and self.size > 1:
            for a in arrays:
                a *= 1.0 / self.size

    def mean_scalar(self, value: float) -> float:
        import cupy as cp

        buf = cp.asarray([value], dtype=cp.float64)
        self.all_reduce_mean([buf])
        return float(buf[0])

    def broadcast_int(self, value: int) -> int:
        import cupy as cp

        buf = cp.asarray([value], dtype=cp.int64)
        self.comm.bcast(buf.data.ptr, 1, self.nccl.NCCL_INT64, 0, cp.cuda.get_current_stream().ptr)
        return int(buf[0])

    def check(self) -> None:
        self.comm.check_async_error()

    def abort(self) -> None:
        self.comm.abort()

    def close(self) -> None:
        self.comm.destroy()


def gradient_buffers(grads: dict) -> list:
    """The arrays to all-reduce for `grads`: the one buffer they are all views of (the bf16 engine's flat
    gradients: a single call), else the gradients themselves."""
    owners = {id(o): o for o in (g if g.base is None else g.base for g in grads.values())}
    if len(owners) == 1:
        (owner,) = owners.values()
        if owner.flags.c_contiguous:
            return [owner]
    return list(grads.values())


# ---- the data-parallel training: a gradient hook and a stepper wrapper ------------------------------

class DataParallel:
    """One rank's part of a data-parallel run: the hook that averages gradients, the stepper wrapper that
    averages the loss, rank 0's resume decision, and a watchdog that stops a rank whose peers are gone."""

    def __init__(self, comm: Comm, stage: str, timeout: float = DEFAULT_TIMEOUT, launcher_pid: int | None = None):
        self.comm, self.stage, self.timeout, self.launcher_pid = comm, stage, float(timeout), launcher_pid
        self.rank, self.size = comm.rank, comm.size
        self._busy_since: float | None = None
        self._stopped = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def grad_hook(self, then: Callable[[dict], None] | None = None) -> Callable[[dict], None]:
        """A `grad_hook` that averages the gradients over the ranks, then runs `then` (if any) on the mean."""
        def hook(grads: dict) -> None:
            for a in gradient_buffers(grads):
                if a.flags.c_contiguous:
                    self.comm.all_reduce_mean([a])
                else:  # NCCL reduces contiguous memory: through a copy
                    buf = a.copy()
                    self.comm.all_reduce_mean([buf])
                    a[...] = buf
            if then is not None:
                then(grads)
        # NCCL calls may be captured into a CUDA graph: without `then`, the bf16 engine runs the hook in its
        # graph step (its gradients are one contiguous buffer, so the copy above is never taken)
        hook.in_graph = then is None
        return hook

    def wrap(self, stepper) -> "ParallelStepper":
        return ParallelStepper(stepper, self)

    def broadcast_int(self, value: int) -> int:
        with self.busy():
            return self.comm.broadcast_int(value)

    # -- the watchdog --
    def busy(self):
        return _Busy(self)

    def start_watchdog(self, period: float = 1.0) -> None:
        self._watchdog = threading.Thread(target=self._watch, args=(period,), daemon=True,
                                          name=f"nanoeuler-rank{self.rank}-watchdog")
        self._watchdog.start()

    def _watch(self, period: float) -> None:
        while not self._stopped.wait(period):
            problem = self.problem()
            if problem:
                self.die(problem)

    def problem(self) -> str | None:
        """Why this rank should stop now, or None."""
        since = self._busy_since
        if since is not None and time.monotonic() - since > self.timeout:
            return (f"a step waited more than {self.timeout:.0f} s for the other ranks (one died or hangs; "
                    f"{ENV_TIMEOUT} sets the limit)")
        if self.launcher_pid is not None and os.getppid() != self.launcher_pid:
            return "the launcher of the ranks is gone"
        try:
            self.comm.check()
        except Exception as exc:  # NCCL's asynchronous error: a peer's connection broke
            return f"NCCL reported {type(exc).__name__}: {exc}"
        return None

    def die(self, why: str) -> None:
        print(f"nanoeuler {self.stage}: error: rank {self.rank}: {why}; aborting the communicator",
              file=sys.stderr, flush=True)
        aborting = threading.Thread(target=self.comm.abort, daemon=True)  # an abort that hangs must not keep
        aborting.start()                                                   # the process alive
        aborting.join(10.0)
        os._exit(1)

    def close(self) -> None:
        self._stopped.set()
        self.comm.close()


class _Busy:
    def __init__(self, dp: DataParallel):
        self.dp = dp

    def __enter__(self):
        self.dp._busy_since = time.monotonic()

    def __exit__(self, *exc):
        self.dp._busy_since = None


class ParallelStepper:
    """A stepper whose gradients are averaged by its hook, and whose loss is the mean over the ranks.

    Every rank makes the same collective calls in every step, even when its own loss is not finite: the
    gradient all-reduce (the hook runs before any finiteness check), then the loss average; a non-finite
    mean loss then stops every rank at the same step, and a non-finite norm is the same on every rank."""

    def __init__(self, inner, dp: DataParallel):
        self.inner, self.dp = inner, dp

    @property
    def t(self) -> int:
        return self.inner.t

    def step(self, batch, lr: float, head_weights=None) -> tuple[float, float]:
        with self.dp.busy():
            local_error = None
            try:
                loss, norm = self.inner.step(batch, lr, head_weights=head_weights)
            except NonFinite as exc:
                local_error, loss, norm = exc, (exc.value if exc.what == "loss" else 0.0), float("nan")
            loss = self.dp.comm.mean_scalar(float(loss))
        if not math.isfinite(loss):
            raise NonFinite("loss", loss)
        if local_error is not None:
            raise local_error
        return loss, norm

    def params(self) -> dict:
        return self.inner.params()

    def state_tensors(self) -> dict:
        return self.inner.state_tensors()

    def load_state_tensors(self, tensors: dict, t: int) -> None:
        self.inner.load_state_tensors(tensors, t)


# ---- a stage's entry -------------------------------------------------------------------------------

def setup(stage: str, gpus: int, device: str, env=None) -> DataParallel | None:
    """This process's rank of a data-parallel run on `gpus` GPUs (None: a plain single-process run).

    Picks the rank's GPU, builds the NCCL communicator and starts the watchdog. A launcher's world
    (even of size 1: the NCCL path) wins; `gpus` > 1 must then match its size."""
    env = os.environ if env is None else env
    world = world_from_env(env)
    if world is None:
        if gpus > 1:
            raise UserError(f"{stage}.gpus {gpus}: start the run with `nanoeuler {stage} --gpus {gpus}` "
                            "or under a launcher that sets RANK/WORLD_SIZE")
        return None
    if gpus > 1 and gpus != world.size:
        raise UserError(f"--gpus/{stage}.gpus is {gpus} but the launcher started {world.size} ranks")
    _check_device(world.size, device)
    import cupy as cp
    from cupy.cuda import nccl

    n_dev = cp.cuda.runtime.getDeviceCount()
    if world.local_rank >= n_dev and n_dev > 1:
        raise UserError(f"rank {world.rank} wants GPU {world.local_rank} (LOCAL_RANK) but this host has {n_dev}")
    cp.cuda.Device(world.local_rank % n_dev).use()  # one visible GPU a rank (SLURM's binding): device 0
    timeout = timeout_from_env(env)
    path = rendezvous_path(env)
    uid = exchange_id(world, path, nccl.get_unique_id, timeout)
    comm = NcclComm(world, uid)  # returns once every rank has joined
    if world.is_root and ENV_RENDEZVOUS not in env:
        path.unlink(missing_ok=True)  # a derived name: leave nothing for a later job to misread
    launcher = int(env[ENV_LAUNCHER]) if env.get(ENV_LAUNCHER) else None
    dp = DataParallel(comm, stage, timeout=timeout, launcher_pid=launcher)
    dp.start_watchdog()
    return dp
