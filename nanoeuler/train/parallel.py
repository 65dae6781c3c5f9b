"""Data-parallel training: one process a GPU, on one host or several, gradients averaged by NCCL.

    nanoeuler pretrain --gpus 4 ...      # starts 4 processes itself (RANK/WORLD_SIZE/LOCAL_RANK set)
    srun -n 16 nanoeuler pretrain ...    # or under a launcher that sets them (SLURM_PROCID/...), any nodes

Every rank builds the same model from the same seed and draws the same seeded stream of training
windows; rank r keeps windows r, r+N, ... of each step's N*B, so N GPUs with batch B train on exactly
the windows of 1 GPU with batch N*B. Between the backward and the clipping the stepper's `grad_hook`
averages the gradients over the ranks (NCCL, in place: one all-reduce of the bf16 engine's flat gradient
buffer; on the fp32 path a reduce-scatter and an all-gather of a flat copy laid out as ZeRO-1's, so the
two add alike), and the loss is averaged too, so every rank computes the same norm and the same
update and logs the loss of the whole batch. Rank 0 alone reads and writes the run directory
(checkpoints, metrics, the final model, the progress bar); the others load the checkpoint it chose.
With `zero: 1` (ZeRO stage 1) each rank keeps the optimizer state of its share of the tensors only: the
gradients are reduce-scattered, each rank updates its share, the parameters are all-gathered (the fp32
path: `ZeroStepper`; the bf16 engine: its own sharded step, `TrainEngine.set_zero`).

Rank 0 makes the NCCL unique id and passes it to the others: through a file (`NANOEULER_RENDEZVOUS`, set
by `--gpus`; across nodes, a path on a shared filesystem) or over TCP from rank 0's host
(MASTER_ADDR/MASTER_PORT, or NANOEULER_RENDEZVOUS=tcp://HOST:PORT). A dead rank stops the run: the
launcher of `--gpus` notices a child's exit and stops the others; under another launcher each rank's
watchdog aborts the communicator when a step makes no progress for `NANOEULER_NCCL_TIMEOUT` seconds
(default 900) or NCCL reports an error.

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
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from nanoeuler.backend import array_module
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
            raise UserError(
                f"{rank_var}={rank} {size_var}={size} {local_var}={local}: "
                "need 0 <= rank < world size and a local rank >= 0"
            )
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


@dataclass(frozen=True)
class TcpRendezvous:
    """Rank 0's NCCL id served over TCP at host:port (the first node's address: every node reaches it)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"tcp://{self.host}:{self.port}"


def rendezvous_path(env=None) -> Path | TcpRendezvous:
    """Where the NCCL id travels: `NANOEULER_RENDEZVOUS` (a file every rank reaches, on a shared filesystem
    across nodes, or tcp://HOST:PORT), else a TCP store at MASTER_ADDR:MASTER_PORT (several nodes), else a
    file named after the SLURM step in the temporary folder (one host).

        >>> rendezvous_path({"MASTER_ADDR": "node01", "MASTER_PORT": "29500"})
        TcpRendezvous(host='node01', port=29500)
    """
    env = os.environ if env is None else env
    value = env.get(ENV_RENDEZVOUS)
    if value and value.startswith("tcp://"):
        host, _, port = value[len("tcp://") :].rpartition(":")
        return TcpRendezvous(host or "127.0.0.1", _port(port, f"{ENV_RENDEZVOUS}={value!r}"))
    if value:
        return Path(value)
    if env.get("MASTER_PORT"):
        return TcpRendezvous(env.get("MASTER_ADDR") or "127.0.0.1", _port(env["MASTER_PORT"], "MASTER_PORT"))
    if "SLURM_JOB_ID" in env:
        tmp = Path(tempfile.gettempdir())
        return tmp / f"nanoeuler-nccl-{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '0')}.id"
    raise UserError(
        f"set {ENV_RENDEZVOUS} to a file path every rank can reach (it carries the NCCL id), "
        "or MASTER_ADDR/MASTER_PORT to rank 0's host and a free port, or start the run with --gpus N"
    )


def _port(text: str, what: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 < port < 65536:
        raise UserError(f"{what}: the port must be a number in 1..65535")
    return port


def _id_record(uid: bytes | tuple) -> str:
    return json.dumps({"hex": uid.hex()} if isinstance(uid, bytes) else {"ints": list(uid)})


def _id_from_record(text: str) -> bytes | tuple:
    record = json.loads(text)
    return bytes.fromhex(record["hex"]) if "hex" in record else tuple(record["ints"])


def exchange_id(
    world: World, where: Path | TcpRendezvous, make_id: Callable[[], bytes | tuple], timeout: float
) -> bytes | tuple:
    """Rank 0 makes the id with `make_id()` and hands it on; the others wait up to `timeout` s for it.
    Through a file (written atomically), or over TCP (rank 0 serves it until every other rank has it).
    The id is bytes (CuPy >= 13) or a tuple of ints (older CuPy); every rank gets the same type back."""
    if world.is_root:
        uid = make_id()
        if isinstance(where, TcpRendezvous):
            _serve_id(where, _id_record(uid).encode(), world.size - 1, timeout)
        else:
            where = Path(where)
            tmp = where.with_name(where.name + f".{os.getpid()}.tmp")
            tmp.write_text(_id_record(uid))
            os.replace(tmp, where)
        return uid
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = _fetch_id(where) if isinstance(where, TcpRendezvous) else Path(where).read_text()
            return _id_from_record(text)
        except (OSError, ValueError, KeyError):  # not there yet (or half sent): wait
            if time.monotonic() > deadline:
                raise UserError(
                    f"rank {world.rank}: rank 0's NCCL id did not appear in {where} within {timeout:.0f} s "
                    f"(are all {world.size} ranks running?)"
                ) from None
            time.sleep(0.05)


def _serve_id(where: TcpRendezvous, record: bytes, ranks: int, timeout: float) -> None:
    """Send `record` to each of `ranks` connections on every interface at where.port; return once all have
    it (they need nothing else from rank 0 to build their communicator), or fail after `timeout` s."""
    try:
        server = socket.create_server(("", where.port))
    except OSError as exc:
        raise UserError(
            f"rank 0: cannot listen on port {where.port} for the rendezvous ({exc.strerror}); "
            "choose another MASTER_PORT"
        ) from None
    server.settimeout(0.2)
    deadline, sent = time.monotonic() + timeout, 0
    with server:
        while sent < ranks:
            if time.monotonic() > deadline:
                raise UserError(
                    f"rank 0: {sent} of the other {ranks} ranks fetched the NCCL id from {where} "
                    f"within {timeout:.0f} s (are they running, and can they reach this host?)"
                )
            try:
                conn, _ = server.accept()
            except (socket.timeout, BlockingIOError):
                continue
            with conn:
                try:
                    conn.sendall(record)
                    sent += 1
                except OSError:  # that rank retries
                    pass


def _fetch_id(where: TcpRendezvous) -> str:
    with socket.create_connection((where.host, where.port), timeout=10) as conn:
        chunks = []
        while chunk := conn.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks).decode()


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
    parser.add_argument(
        "--gpus",
        type=int,
        metavar="N",
        help="train data parallel on N GPUs of this host, one process each "
        "(default: the stage's `gpus` key, itself default 1)",
    )
    parser.add_argument(
        "--zero",
        type=int,
        choices=(0, 1),
        metavar="STAGE",
        help="1: ZeRO stage 1, each GPU keeps 1/N of the optimizer state "
        "(default: the stage's `zero` key, itself default 0)",
    )


def gpus_wanted(args, section: dict) -> int:
    gpus = args.gpus if getattr(args, "gpus", None) is not None else int(section.get("gpus", 1))
    if gpus < 1:
        raise UserError(f"--gpus {gpus}: need at least 1")
    return gpus


def zero_wanted(args, section: dict) -> int:
    return args.zero if getattr(args, "zero", None) is not None else int(section.get("zero", 0))


def launch_or_setup(stage: str, args, section: dict, device: str):
    """(exit status of the N rank processes this one started, None) when the stage asks for several GPUs and no
    launcher set a world; else (None, this rank's `DataParallel`, or None for a single process). Call it
    before the first CuPy array: it picks the rank's GPU."""
    gpus = gpus_wanted(args, section)
    if gpus > 1 and world_from_env() is None:
        return run_ranks(stage, args.argv, gpus, device), None
    return None, setup(stage, gpus, device, zero=zero_wanted(args, section))


def run_ranks(stage: str, argv: list[str], gpus: int, device: str, poll: float = 0.2) -> int:
    """Run `nanoeuler <stage> <argv>` as `gpus` processes, one a GPU; the exit status of the run.

    Ranks above 0 keep their standard output to themselves (rank 0 prints the run's progress and summary)."""
    _check_device(gpus, device)
    import cupy as cp

    have = cp.cuda.runtime.getDeviceCount()
    if gpus > have:
        raise UserError(f"--gpus {gpus}: this host has {have} GPU(s)")
    with tempfile.TemporaryDirectory(prefix="nanoeuler-ranks-") as tmp:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "nanoeuler", stage, *argv],
                env=rank_env(r, gpus, str(Path(tmp) / "nccl.id")),
                stdout=None if r == 0 else subprocess.DEVNULL,
            )
            for r in range(gpus)
        ]
        return supervise(stage, procs, poll=poll)


def rank_env(rank: int, world: int, rendezvous: str, base=None) -> dict:
    """The environment of rank `rank` of `world` started by `run_ranks`: GPU `rank` of this host."""
    base = os.environ if base is None else base
    return {
        **base,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        ENV_RENDEZVOUS: rendezvous,
        ENV_LAUNCHER: str(os.getpid()),
    }


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
                print(
                    f"nanoeuler {stage}: error: rank {rank} (pid {procs[rank].pid}) {_describe_exit(code)}"
                    f"{stopped}. {hint}",
                    file=sys.stderr,
                    flush=True,
                )
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

    def all_reduce_sum(self, arrays: list) -> None:
        """Each (contiguous) array becomes the sum over the ranks of that array, in place."""

    def mean_scalar(self, value: float) -> float: ...

    def broadcast_int(self, value: int) -> int:
        """Rank 0's `value` on every rank."""

    def reduce_scatter_mean(self, src, dst) -> None:
        """dst (src.size / size elements) becomes block `rank` of the mean over the ranks of src
        (`FlatGradients`); dst may be that block of src itself (in place)."""

    def all_gather(self, src, dst) -> None:
        """dst (size * src.size elements) becomes every rank's src, in rank order (`FlatGradients`, ZeRO's
        norm); src may be block `rank` of dst itself (in place)."""

    def check(self) -> None:
        """Raise if the transport reported an asynchronous error (a peer is gone)."""

    def abort(self) -> None: ...

    def close(self) -> None: ...


class NcclComm:
    """`Comm` over `cupy.cuda.nccl`, on the current CUDA stream (the collectives are queued, not waited for,
    so the bf16 engine captures them in its step's CUDA graph). NCCL reduces in place when the output is
    the input's block `rank` (reduce-scatter) or the input is the output's (all-gather), as ZeRO-1 uses them."""

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
        self._all_reduce(arrays, self.nccl.NCCL_SUM if self._avg is None else self._avg)
        if self._avg is None and self.size > 1:
            for a in arrays:
                a *= 1.0 / self.size

    def all_reduce_sum(self, arrays: list) -> None:
        self._all_reduce(arrays, self.nccl.NCCL_SUM)

    def _all_reduce(self, arrays: list, op) -> None:
        import cupy as cp

        stream = cp.cuda.get_current_stream().ptr
        self.nccl.groupStart()  # several buffers: one fused launch
        for a in arrays:
            self.comm.allReduce(a.data.ptr, a.data.ptr, a.size, self._dtype(a), op, stream)
        self.nccl.groupEnd()

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

    def reduce_scatter_mean(self, src, dst) -> None:
        import cupy as cp

        op = self.nccl.NCCL_SUM if self._avg is None else self._avg
        self.comm.reduceScatter(
            src.data.ptr, dst.data.ptr, dst.size, self._dtype(dst), op, cp.cuda.get_current_stream().ptr
        )
        if self._avg is None and self.size > 1:
            dst *= 1.0 / self.size

    def all_gather(self, src, dst) -> None:
        import cupy as cp

        self.comm.allGather(src.data.ptr, dst.data.ptr, src.size, self._dtype(src), cp.cuda.get_current_stream().ptr)

    def warm_up(self, mib: int = 32) -> None:
        """Run each collective the training uses once, on `mib` MiB a rank (large enough for NCCL's ring
        protocol), so that the connections and buffers NCCL sets up on a collective's first call exist
        before the stage measures its memory budget, which then counts them in the context."""
        import cupy as cp

        shard = (mib << 20) // 4 // self.size
        buf = cp.zeros(shard * self.size, dtype=cp.float32)
        mine = buf[self.rank * shard : (self.rank + 1) * shard]
        self.all_reduce_mean([buf])
        self.all_reduce_mean([buf[:1]])  # a small one: NCCL's low-latency protocol
        self.reduce_scatter_mean(buf, mine)
        self.all_gather(mine, buf)
        cp.cuda.get_current_stream().synchronize()
        del buf, mine
        cp.get_default_memory_pool().free_all_blocks()

    def check(self) -> None:
        self.comm.check_async_error()

    def abort(self) -> None:
        self.comm.abort()

    def close(self) -> None:
        self.comm.destroy()


def gradient_buffers(grads: dict) -> list:
    """The one buffer `grads` are all views of (the bf16 engine's flat gradients: all-reduced in a single
    call), else the gradients themselves (the fp32 stepper's: averaged through `FlatGradients`)."""
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

    def __init__(
        self, comm: Comm, stage: str, timeout: float = DEFAULT_TIMEOUT, launcher_pid: int | None = None, zero: int = 0
    ):
        self.comm, self.stage, self.timeout, self.launcher_pid = comm, stage, float(timeout), launcher_pid
        self.rank, self.size = comm.rank, comm.size
        self.zero = int(zero)  # 1: ZeRO stage 1 (`ZeroStepper`), each rank keeps a shard of the optimizer state
        self._then = None  # the stage's own gradient hook, run after the average
        self._busy_since: float | None = None
        self._stopped = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def grad_hook(self, then: Callable[[dict], None] | None = None) -> Callable[[dict], None]:
        """A `grad_hook` that averages the gradients over the ranks, then runs `then` (if any) on the mean.
        The bf16 engine's gradients (views of one buffer) take one all-reduce; the fp32 stepper's tensors go
        through `FlatGradients`, as ZeRO-1's do, so zero 0 and zero 1 add alike on any number of ranks.
        With `zero` it carries the transport as `zero_comm`: `make_stepper` then builds the bf16 engine
        sharded, and its step averages the gradients itself instead of calling the hook."""
        self._then = then
        flat = None  # the fp32 gradients' buffer, laid out on the first call

        def hook(grads: dict) -> None:
            nonlocal flat
            buffers = gradient_buffers(grads)
            if len(buffers) == 1 and len(grads) > 1:  # the engine's: no ZeroStepper of the fp32 path to match
                self.comm.all_reduce_mean(buffers)
            else:
                if flat is None:
                    flat = FlatGradients(grads, self.comm)
                flat.average(grads)
            if then is not None:
                then(grads)

        # NCCL calls may be captured into a CUDA graph: without `then`, the bf16 engine runs the hook in its
        # graph step (its gradients are one contiguous buffer, so the copy above is never taken)
        hook.in_graph = then is None
        hook.zero_comm = self.comm if self.zero else None
        return hook

    def wrap(self, stepper) -> "ParallelStepper":
        """The stepper of this rank: the loss averaged over the ranks, and with `zero` the optimizer sharded
        (the fp32 path here, by `ZeroStepper`; the bf16 engine was built sharded by `make_stepper`)."""
        if self.zero:
            from nanoeuler.train.stepper import EngineStepper

            if self._then is not None:
                raise UserError(f"{self.stage}.zero 1: this stage's own gradient hook needs every gradient; use zero 0")
            if isinstance(stepper, EngineStepper):
                if stepper.engine.zero is not self.comm:
                    raise UserError(f"{self.stage}.zero 1: the bf16 engine was built unsharded (no zero_comm)")
                whole = engine_optimizer_bytes(stepper.engine.cfg)
            else:
                whole = optimizer_bytes(stepper)
                stepper = ZeroStepper(stepper, self.comm)
            if self.is_root:
                print(
                    f"nanoeuler {self.stage}: ZeRO-1 over {self.size} ranks: rank 0 keeps "
                    f"{optimizer_bytes(stepper) / 2**20:.1f} MiB of optimizer state ({whole / 2**20:.1f} MiB "
                    "unsharded)",
                    file=sys.stderr,
                    flush=True,
                )
        return ParallelStepper(stepper, self)

    def broadcast_int(self, value: int) -> int:
        with self.busy():
            return self.comm.broadcast_int(value)

    # -- the watchdog --
    def busy(self):
        return _Busy(self)

    def start_watchdog(self, period: float = 1.0) -> None:
        self._watchdog = threading.Thread(
            target=self._watch, args=(period,), daemon=True, name=f"nanoeuler-rank{self.rank}-watchdog"
        )
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
            return (
                f"a step waited more than {self.timeout:.0f} s for the other ranks (one died or hangs; "
                f"{ENV_TIMEOUT} sets the limit)"
            )
        if self.launcher_pid is not None and os.getppid() != self.launcher_pid:
            return "the launcher of the ranks is gone"
        try:
            self.comm.check()
        except Exception as exc:  # NCCL's asynchronous error: a peer's connection broke
            return f"NCCL reported {type(exc).__name__}: {exc}"
        return None

    def die(self, why: str) -> None:
        print(
            f"nanoeuler {self.stage}: error: rank {self.rank}: {why}; aborting the communicator",
            file=sys.stderr,
            flush=True,
        )
        aborting = threading.Thread(target=self.comm.abort, daemon=True)  # an abort that hangs must not keep
        aborting.start()  # the process alive
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
    gradient average (the hook runs before any finiteness check), then the loss average; a non-finite
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


# ---- ZeRO stage 1: each rank updates one shard of the parameters, and keeps only its optimizer state --


@dataclass(frozen=True)
class ShardPlan:
    """Whole tensors, in the model's order, in `size` contiguous runs; run r is rank r's. A flat buffer of
    size * span elements holds run r at r * span (runs padded to the longest, `span`), so one reduce-scatter
    gives each rank the mean gradient of its tensors and one all-gather gives every rank all of them."""

    owner: dict  # name -> rank
    offset: dict  # name -> first element in the flat buffer
    shapes: dict  # name -> shape
    size: int
    span: int

    def mine(self, rank: int) -> list[str]:
        return [n for n, r in self.owner.items() if r == rank]

    def flat_view(self, flat, name):
        o, shape = self.offset[name], self.shapes[name]
        return flat[o : o + math.prod(shape)].reshape(shape)


def plan_shards(shapes: dict, size: int) -> ShardPlan:
    """Cut the tensors into `size` runs of about total/size elements: a tensor goes to the rank whose
    share holds its middle element. Whole tensors keep each gradient's sum of squares (the clipping) and
    Muon's matrices on one rank; a rank's run exceeds total/size by at most the largest tensor (half of
    one at either end).

        >>> plan = plan_shards({"a": (4, 2), "b": (3,), "c": (2, 2)}, 2)
        >>> plan.owner, plan.offset, plan.span
        ({'a': 0, 'b': 1, 'c': 1}, {'a': 0, 'b': 8, 'c': 11}, 8)
    """
    sizes = {n: math.prod(s) for n, s in shapes.items()}
    total, start, owner = sum(sizes.values()), 0, {}
    for n, k in sizes.items():
        owner[n] = min(size - 1, int((start + k / 2) * size // max(total, 1)))
        start += k
    runs = [sum(sizes[n] for n in owner if owner[n] == r) for r in range(size)]
    span = max(runs)
    offset, at = {}, [r * span for r in range(size)]
    for n in shapes:
        offset[n] = at[owner[n]]
        at[owner[n]] += sizes[n]
    return ShardPlan(owner, offset, dict(shapes), size, span)


class FlatGradients:
    """Gradients in one flat buffer laid out by `plan_shards` over the names and shapes of `tensors` (the
    model's order), and the two collectives on it. Rank r's block of the buffer is its `shard`: NCCL
    reduce-scatters and all-gathers in place there.

    ZeRO-1 and the plain data-parallel average both reduce through here, so every element is added in the
    same order in both runs: NCCL's ring adds the ranks of a reduce-scatter's block in another order than
    those of an all-reduce of one tensor (with 3 ranks or more). The cost is the buffer, size * span
    elements: the gradients once more, plus the padding of the shorter runs.

        >>> import numpy as np
        >>> class One: rank, size = 0, 1
        >>> flat = FlatGradients({"a": np.zeros((2, 2)), "b": np.zeros(3)}, One())
        >>> flat.plan.offset, flat.buffer.size, np.shares_memory(flat.shard, flat.buffer)
        ({'a': 0, 'b': 4}, 7, True)
    """

    def __init__(self, tensors: dict, comm: Comm):
        self.comm = comm
        self.plan = plan_shards({n: tuple(a.shape) for n, a in tensors.items()}, comm.size)
        a = next(iter(tensors.values()))
        self.buffer = array_module(a).zeros(self.plan.size * self.plan.span, dtype=a.dtype)
        start = comm.rank * self.plan.span
        self.shard = self.buffer[start : start + self.plan.span]

    def view(self, name):
        """Tensor `name` in the flat buffer (inside `shard` when this rank owns it)."""
        return self.plan.flat_view(self.buffer, name)

    def reduce_scatter(self, grads: dict) -> None:
        """`shard` becomes the mean over the ranks of this rank's run of `grads`."""
        for n, g in grads.items():
            self.view(n)[...] = g
        self.comm.reduce_scatter_mean(self.buffer, self.shard)

    def all_gather(self) -> None:
        """Every rank's `shard` into the flat buffer: bytes copied, so every rank holds the same values."""
        self.comm.all_gather(self.shard, self.buffer)

    def average(self, grads: dict) -> None:
        """Each gradient becomes its mean over the ranks, in place: the bytes of one ring all-reduce, in
        two collectives for the whole model instead of one a tensor."""
        self.reduce_scatter(grads)
        self.all_gather()
        for n, g in grads.items():
            g[...] = self.view(n)


def keep_only(opt, names: set) -> None:
    """Drop the optimizer state of every tensor not in `names`: AdamW (and Muon's AdamW part) updates and
    saves only the tensors it holds moments for, Muon only the hidden matrices it lists."""
    from nanoeuler.optim import Muon

    if isinstance(opt, Muon):
        opt.hidden = [n for n in opt.hidden if n in names]
        opt.m = {n: m for n, m in opt.m.items() if n in names}
        opt = opt.adam
    opt.m = {n: m for n, m in opt.m.items() if n in names}
    opt.v = {n: v for n, v in opt.v.items() if n in names}


class ZeroStepper:
    """ZeRO stage 1 over an `XpStepper`: every rank holds all parameters and computes all gradients, but
    keeps the optimizer state of its own tensors only (`plan_shards`), a 1/N share. A step:

        gradients -> reduce-scatter (the mean of this rank's tensors) -> the global norm from every
        tensor's sum of squares (all-gathered) -> clip and update this rank's tensors -> all-gather them

    Every number is the one the unsharded data-parallel step computes (the same `FlatGradients` sums, the
    same clipping factor, the optimizer on the same tensors), so the two runs agree bit for bit. The
    checkpoint keeps the native format: `state_tensors` gathers the shards (a collective every rank joins),
    and `load_state_tensors` takes this rank's tensors from full ones, so a run of N ranks resumes on M."""

    def __init__(self, inner, comm: Comm):
        # laid out by the parameters, as the data-parallel hook lays out their gradients (the same order)
        self.inner, self.comm, self.flat = inner, comm, FlatGradients(inner.params(), comm)
        self.plan = self.flat.plan
        self.mine = self.plan.mine(comm.rank)
        keep_only(inner.opt, set(self.mine))
        xp, dtype = inner.xp, self.flat.buffer.dtype
        self.index = {n: i for i, n in enumerate(self.plan.shapes)}
        self.squares = xp.zeros(len(self.index), dtype=dtype)  # this rank's tensors' sums of squares
        self.all_squares = xp.zeros(self.plan.size * len(self.index), dtype=dtype)

    @property
    def t(self) -> int:
        return self.inner.t

    def step(self, batch, lr: float, head_weights=None) -> tuple[float, float]:
        inner = self.inner
        loss, grads = inner.gradients(batch, head_weights)
        order = list(grads)  # clip_grad_norm adds the squares in this order
        self.flat.reduce_scatter(grads)
        del grads
        mine = {n: self.flat.view(n) for n in self.mine}
        norm = self._clip(mine, order)
        if math.isfinite(norm):  # the norm is global: every rank updates, or none does
            inner.opt.step(inner.params(), mine, lr)
            self._gather_params()
        if not math.isfinite(loss):  # after the collectives, which every rank joins whatever its loss
            raise NonFinite("loss", loss)
        if not math.isfinite(norm):
            raise NonFinite("gradient norm", norm)
        return loss, norm

    def _clip(self, mine: dict, order: list) -> float:
        """`optim.clip_grad_norm` over all tensors, from this rank's: each tensor's sum of squares comes from
        its owner, and they are added in the same order, so the norm and the factor are the unsharded ones."""
        xp = self.inner.xp
        self.squares[...] = 0
        for n, g in mine.items():
            self.squares[self.index[n]] = xp.vdot(g.ravel(), g.ravel())
        self.comm.all_gather(self.squares, self.all_squares)
        each = self.all_squares.reshape(self.plan.size, len(self.index))
        norm = math.sqrt(float(sum(each[self.plan.owner[n], self.index[n]] for n in order)))
        max_norm = self.inner.max_norm
        if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for g in mine.values():
                g *= scale
        return norm

    def _gather_params(self) -> None:
        params = self.inner.params()
        for n in self.mine:
            self.flat.view(n)[...] = params[n]
        self.flat.all_gather()
        for n, p in params.items():
            if n not in self.mine:
                p[...] = self.flat.view(n)

    def params(self) -> dict:
        return self.inner.params()

    def state_tensors(self) -> dict:
        """Every tensor's optimizer state on every rank, as the unsharded optimizer names it (NumPy copies:
        the device keeps only its shard). A collective: every rank calls it."""
        from nanoeuler.backend import to_numpy
        from nanoeuler.optim import Muon, param_group

        own, out = self.inner.opt.state_tensors(), {}
        muon = isinstance(self.inner.opt, Muon)
        for kind in ("m", "v"):
            self.flat.shard[...] = 0
            for n in self.mine:
                if f"{kind}.{n}" in own:
                    self.flat.view(n)[...] = own[f"{kind}.{n}"]
            self.flat.all_gather()
            for n in self.plan.shapes:
                if kind == "m" or not (muon and param_group(n) == "hidden"):  # Muon's matrices: momentum only
                    out[f"{kind}.{n}"] = to_numpy(self.flat.view(n)).copy()
        return out

    def load_state_tensors(self, tensors: dict, t: int) -> None:
        """This rank's part of a full optimizer state (a checkpoint of any number of ranks)."""
        self.inner.load_state_tensors(tensors, t)


def zero_world(dp: "DataParallel | None") -> int:
    """The ranks that share the optimizer state (`memory.plan_training`'s zero_world): 1 without ZeRO."""
    return dp.size if dp is not None and dp.zero else 1


def optimizer_bytes(stepper) -> int:
    """Bytes of optimizer state this rank holds (its moments; with ZeRO, its shard's): the fp32 path's
    optimizer, or the bf16 engine's moment buffers (under Muon the second holds the Newton-Schulz operands)."""
    while not hasattr(stepper, "opt") and not hasattr(stepper, "engine"):  # through the wrappers
        stepper = stepper.inner
    if hasattr(stepper, "engine"):
        return int(stepper.engine.Mo.nbytes + stepper.engine.Vo.nbytes)
    return sum(int(a.nbytes) for a in stepper.opt.state_tensors().values())


def engine_optimizer_bytes(cfg) -> int:
    """Bytes of the unsharded bf16 engine's moments (two float32 values for every element of its layout)."""
    from nanoeuler.kernels.bf16.plan import plan_layout

    return 2 * 4 * plan_layout(cfg).total


# ---- a stage's entry -------------------------------------------------------------------------------


def setup(stage: str, gpus: int, device: str, env=None, zero: int = 0) -> DataParallel | None:
    """This process's rank of a data-parallel run on `gpus` GPUs (None: a plain single-process run).

    Picks the rank's GPU, builds the NCCL communicator and starts the watchdog. A launcher's world
    (even of size 1: the NCCL path) wins; `gpus` > 1 must then match its size."""
    env = os.environ if env is None else env
    world = world_from_env(env)
    if world is None:
        if gpus > 1:
            raise UserError(
                f"{stage}.gpus {gpus}: start the run with `nanoeuler {stage} --gpus {gpus}` "
                "or under a launcher that sets RANK/WORLD_SIZE"
            )
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
    comm.warm_up()  # NCCL's buffers exist before the stage measures its budget
    if world.is_root and ENV_RENDEZVOUS not in env and isinstance(path, Path):
        path.unlink(missing_ok=True)  # a derived name: leave nothing for a later job to misread
    launcher = int(env[ENV_LAUNCHER]) if env.get(ENV_LAUNCHER) else None
    dp = DataParallel(comm, stage, timeout=timeout, launcher_pid=launcher, zero=zero)
    dp.start_watchdog()
    return dp
