"""The trainer on N processes: where this process stands, how the ranks start, the few collectives the trainer adds.

    longstraw train CONFIG.yaml --nproc N                              # N processes on this machine
    torchrun --nproc-per-node N -m longstraw train CONFIG.yaml          # the same, through torchrun
    torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m longstraw train CONFIG.yaml

A rank reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT from the environment (what torchrun and
`--nproc` set) and joins the process group: gloo on the CPU, NCCL on CUDA (device cuda:LOCAL_RANK), every collective
with the timeout `dist_timeout`. A process already in a process group (a test, a user script) uses that group.

Every rank runs the same trainer over the same data, seeds and weights, and one GRPO step goes (per prompt):
- capture: context parallel (`longstraw.capture(..., group=)`): rank r keeps the state of its slice of the prompt;
- sample: a collective in which every rank decodes the same G responses (the same generator seed, checked);
- rewards: scored on rank 0 (each reward function runs once per step, not N times) and broadcast; the
  advantages and the loss normalizer are then computed alike on every rank;
- replay: rank r replays responses r, r + N, r + 2N, ... of the group. A replay is a collective, so every rank
  replays ⌈G / N⌉ times: a rank short of responses replays the group's first one again with loss weight 0
  (its backward still runs, adding exact zeros to the gradients);
- gradients: summed over the ranks (`Ranks.all_reduce_grads`, one all-reduce per optimizer step, bucketed), then
  every rank takes the same clipped AdamW step, so the weights stay equal (checked at every checkpoint). With
  `fsdp: true` the decoder layers are sharded instead (`longstraw.distributed.fsdp`): their gradients are
  reduce-scattered in the step's last backward, only the replicated parameters are all-reduced, each rank steps its
  shards (see `longstraw.train.trainer`).
Supervised warm-up steps: full-sequence ones split the step's prompts over the ranks (data parallel: ranks hold
whole prompts there), replayed ones capture each prompt context parallel and the prompt's owner (b mod N) replays
its answer. Evaluation captures context parallel too; every rank gets the same greedy completions.

Rank 0 alone writes metrics.jsonl, TensorBoard, the progress bar, config.yaml, checkpoints, the final model and
eval.json. On resume every rank loads the checkpoint rank 0 names (the output folder must be on a file system all
ranks see), and the ranks' weights are compared. A rank that dies or stops answering makes the others raise
`CollectiveError` naming the collective (at once when its connections close, after `dist_timeout` when it hangs);
checkpoints are written atomically by rank 0, so the last one stays intact. A rank whose launcher (torchrun's agent)
dies stops too (`watch_launcher`), so that a dead agent is an error on the other machines, not a wait.
"""

from __future__ import annotations

import atexit
import datetime
import io
import os
import pickle
import sys
import threading
import time
import traceback
import uuid

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from .collectives import CollectiveError, Group

__all__ = ["ContextGroups", "Ranks", "launch_local", "setup_ranks"]

#: bytes per gradient all-reduce (one bucket of flattened gradients of one dtype and device)
BUCKET_BYTES = 64 * 2**20
#: seconds between two looks of a rank at whether its launcher (the torchrun agent) is still alive
LAUNCHER_POLL_S = 0.5


class Ranks:
    """This process's place in a run: `size` 1 (one process, `pg` None) or a rank of a torch.distributed group.

    `pg` is what `longstraw.capture(..., group=)` takes (None: one process). Every method is a collective of the
    group when `size` > 1 and does nothing collective when `size` is 1."""

    def __init__(self, group=None, owned: bool = False):
        self.group = None if group is None else Group(group)
        self.pg = group
        self.rank = 0 if self.group is None else self.group.rank
        self.size = 1 if self.group is None else self.group.size
        self.owned = owned  # this object started the process group (and ends it in `close`)

    def __repr__(self) -> str:
        return f"Ranks(rank {self.rank} of {self.size})"

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes files and prints."""
        return self.rank == 0

    # ------------------------------------------------------------------ work division
    def padded_share(self, n: int) -> list[int | None]:
        """This rank's share of n items in round robin: [r, r + N, ...], padded with None to ⌈n / N⌉ entries, so
        every rank takes the same number of turns (None: take one with weight 0)."""
        turns = -(-n // self.size)
        return [k * self.size + self.rank if k * self.size + self.rank < n else None for k in range(turns)]

    def share(self, n: int) -> list[int]:
        """This rank's items of n, no padding (for work that is not a collective)."""
        return list(range(self.rank, n, self.size))

    # ------------------------------------------------------------------ collectives
    def fail(self, name: str, err: BaseException):
        raise CollectiveError(
            f"longstraw collective {name!r} failed on rank {self.rank} of {self.size} ({type(err).__name__}: {err})"
        ) from err

    def sum_floats(self, name: str, values: list[float]) -> list[float]:
        """`values` summed over the ranks (float64, in rank order on every rank)."""
        if self.size == 1:
            return list(values)
        assert self.group is not None  # size > 1: a group
        rows = self.group.all_gather(name, [torch.tensor(values, dtype=torch.float64)])
        total = rows[0][0].clone()
        for row in rows[1:]:
            total += row[0]
        return total.tolist()

    def max_floats(self, name: str, values: list[float]) -> list[float]:
        """The largest of `values` over the ranks, value by value (float64, on every rank)."""
        if self.size == 1:
            return list(values)
        assert self.group is not None  # size > 1: a group
        rows = self.group.all_gather(name, [torch.tensor(values, dtype=torch.float64)])
        return torch.stack([row[0] for row in rows]).amax(0).tolist()

    def broadcast_object(self, name: str, obj=None):
        """Rank 0's `obj` (pickled) on every rank."""
        if self.size == 1:
            return obj
        assert self.group is not None  # size > 1: a group
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if self.main else None
        size = self.group.broadcast(f"{name}: size", [torch.tensor([0 if data is None else data.numel()])], src=0)
        n = int(size[0][0])
        buf = data if data is not None else torch.empty(n, dtype=torch.uint8)  # data: rank 0's, None elsewhere
        (buf,) = self.group.broadcast(name, [buf], src=0)
        return pickle.load(io.BytesIO(buf.numpy().tobytes()))

    def gather_objects(self, name: str, obj=None) -> list:
        """Every rank's `obj` (pickled), in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        assert self.group is not None  # size > 1: a group
        data = pickle.dumps(obj)
        sizes = [row[0] for row in self.group.all_gather_ints(f"{name}: sizes", [len(data)])]
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = self.group.all_gather(name, [buf])
        return [pickle.load(io.BytesIO(row[0][:n].numpy().tobytes())) for row, n in zip(rows, sizes)]

    def from_main(self, name: str, fn):
        """`fn()` run on rank 0 only; its result, or the exception it raised, on every rank."""
        if self.size == 1:
            return fn()
        result = err = None
        if self.main:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                err = e
                try:
                    pickle.dumps(e)
                except Exception:  # noqa: BLE001 - an exception that does not pickle travels as its message
                    err = RuntimeError(f"{type(e).__name__}: {e}")
        result, err = self.broadcast_object(name, (result, err))
        if err is not None:
            if self.main:
                raise err
            raise err from RuntimeError(f"raised on rank 0 during {name!r}")
        return result

    def run_alike(self, name: str, fn):
        """`fn()` on every rank; if it raised on any rank, every rank raises (a rank that failed its own exception,
        the others a RuntimeError naming the failed ranks), so no rank goes on alone into a collective."""
        result, err = None, None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            err = e
        if self.size > 1:
            assert self.group is not None  # size > 1: a group
            rows = self.group.all_gather_ints(f"{name}: status", [int(err is not None)])
            failed = [r for r, row in enumerate(rows) if row[0]]
            if failed and err is None:
                raise RuntimeError(f"{name} failed on rank(s) {failed} (see their error)")
        if err is not None:
            raise err
        return result

    def all_reduce_grads(self, params: list[torch.Tensor], name: str) -> None:
        """Sum the gradients of `params` over the ranks (missing gradients count as zeros), one all-reduce per
        bucket of `BUCKET_BYTES`; first a tagged all-gather checks that every rank is at the same collective with
        the same parameters."""
        if self.size == 1:
            return
        assert self.group is not None  # size > 1: a group
        self.group.agree(name, {"parameters": len(params), "elements": sum(p.numel() for p in params)})
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        buckets: list[list[torch.Tensor]] = []
        size = 0
        for p in params:
            g = p.grad
            assert g is not None  # set above
            if (
                not buckets
                or g.dtype != buckets[-1][0].dtype
                or g.device != buckets[-1][0].device
                or size + g.numel() * g.element_size() > BUCKET_BYTES
            ):
                buckets.append([])
                size = 0
            buckets[-1].append(g)
            size += g.numel() * g.element_size()
        for k, grads in enumerate(buckets):
            flat = torch.cat([g.reshape(-1) for g in grads])
            try:
                torch.distributed.all_reduce(flat, group=self.pg)
            except RuntimeError as err:
                self.fail(f"{name} (bucket {k + 1} of {len(buckets)})", err)
            off = 0
            for g in grads:
                g.copy_(flat[off : off + g.numel()].view_as(g))
                off += g.numel()

    def broadcast_params(self, named: list[tuple[str, torch.Tensor]], name: str) -> None:
        """Rank 0's values of these parameters on every rank (randomly initialised adapters, say)."""
        if self.size == 1:
            return
        for pname, p in named:
            try:
                torch.distributed.broadcast(p.data, src=0, group=self.pg)
            except RuntimeError as err:
                self.fail(f"{name}: {pname}", err)

    def check_same(self, named: list[tuple[str, torch.Tensor]], name: str, where: str = "") -> None:
        """Raise on every rank if the parameters differ between ranks: a float64 sum and sum of squares per tensor,
        all-gathered and compared exactly (cheap: one pass over the weights). `where`: for the message. Nothing to
        compare (every trainable tensor sharded: LoRA on sharded layers) is nothing to check, on every rank alike."""
        if self.size == 1 or not named:
            return
        with torch.no_grad():
            sums = torch.stack([torch.stack([p.double().sum(), p.double().square().sum()]) for _, p in named])
        assert self.group is not None  # size > 1: a group
        rows = self.group.all_gather(name, [sums.cpu()])
        for r, (row,) in enumerate(rows):
            if not torch.equal(row, rows[0][0]):
                k = int((row != rows[0][0]).any(dim=1).nonzero()[0])
                raise RuntimeError(
                    f"{name} {where}: the weights of rank {r} differ from rank 0's (first: "
                    f"{named[k][0]}); the ranks of a run must stay in step"
                )

    def close(self) -> None:
        """End the process group if this object started it."""
        if self.owned and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            self.owned = False


def consecutive_group(size: int, timeout_s: float):
    """This rank's process group among the groups of `size` consecutive ranks of the default group (a collective:
    torch.distributed has every rank create every group, in the same order)."""
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mine = None
    for first in range(0, world, size):
        g = torch.distributed.new_group(list(range(first, first + size)), timeout=datetime.timedelta(seconds=timeout_s))
        if first <= rank < first + size:
            mine = g
    return mine


class ContextGroups:
    """`context_parallel: C` on the run's W ranks: W / C groups of C consecutive ranks. A group captures, samples and
    replays a prompt together (`context`: the `Ranks` its collectives run in, each rank a slice of the prompt's
    positions); the groups take the step's contexts in turn (context k by group k mod W / C, `owns`) and hand each
    other what they sampled (`exchange`), so that every rank holds the whole step's responses and rewards.
    C = 0 (or W): one group of every rank."""

    def __init__(self, world: Ranks, size: int, timeout_s: float):
        size = size or world.size
        if world.size % size:
            raise ValueError(f"context_parallel: {size} needs a process count it divides; this run has {world.size}")
        self.world = world
        self.count = world.size // size  #: how many groups
        self.index = world.rank // size  #: this rank's group
        self.context = world if self.count == 1 else Ranks()  # groups of one rank: no collective inside
        if self.count > 1 and size > 1:
            self.context = Ranks(consecutive_group(size, timeout_s))

    def __repr__(self) -> str:
        return f"ContextGroups(group {self.index} of {self.count}, {self.context})"

    def owns(self, k: int) -> bool:
        """Whether this rank's group takes the step's context `k`."""
        return k % self.count == self.index

    def exchange(self, name: str, mine: dict) -> dict:
        """Every group's `mine` (what its first rank holds; the others' are not sent) merged into one dict, on every
        rank (a collective of all W ranks)."""
        if self.count == 1:
            return dict(mine)
        merged: dict = {}
        for part in self.world.gather_objects(name, mine if self.context.main else None):
            merged.update(part or {})
        return merged


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup_ranks(timeout_s: float, device: torch.device) -> Ranks:
    """This process's `Ranks`: the existing default process group, else one started from the environment that
    torchrun (or `--nproc`) sets (gloo on the CPU, NCCL on CUDA, `timeout_s` per collective), else one process."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.group.WORLD) if dist.get_world_size() > 1 else Ranks()
    if env_world_size() <= 1:
        return Ranks()
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(
            f"WORLD_SIZE={env_world_size()} but {', '.join(missing)} not set: launch with torchrun or "
            "`longstraw train CONFIG --nproc N`"
        )
    watch_launcher(int(os.environ["RANK"]), env_world_size())
    if device.type == "cuda":
        if device.index is not None:
            raise ValueError(
                f"device {device}: on several processes each rank takes cuda:LOCAL_RANK; use device: cuda or auto"
            )
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    ranks = Ranks(dist.group.WORLD, owned=True)
    atexit.register(ranks.close)  # also on the way out of an error: a live gloo group aborts the interpreter's exit
    return ranks


def watch_launcher(rank: int, size: int) -> None:
    """Under torchrun (or `--nproc`): end this rank when its launcher dies.

    torch's elastic agent starts every rank in a session of its own, so an agent killed outright (SIGKILL, the OOM
    killer) takes none of its ranks with it: they would train on alone, and the agents of the other machines, their
    own ranks done, would wait for the dead agent in their exit barrier (300 s, then exit 0). Instead the orphaned rank
    exits (status 3, saying why) within `LAUNCHER_POLL_S`, and the other ranks fail in their next collective, naming
    it (at once: their connections to it close)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or os.name != "posix":
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(LAUNCHER_POLL_S)
        print(
            f"longstraw: error: rank {rank} of {size}: its launcher (torchrun agent, pid {parent}) died; this rank "
            "stops, so that the other ranks fail instead of waiting for it. The last checkpoint is intact: run the "
            "same command again to resume.",
            file=sys.stderr,
            flush=True,
        )
        os._exit(3)  # at once: no atexit, no process-group teardown with ranks that may be gone

    threading.Thread(target=watch, name="longstraw launcher watch", daemon=True).start()


def torch_collective_failure(err: BaseException) -> str | None:
    """What failed, for an error raised inside torch.distributed on a multi-process run where no longstraw collective
    wraps it (the sharded layers' all-gathers and reduce-scatters in FSDP2's hooks, a DTensor's gather, the gradient
    norm's all-reduce): a message naming the torch.distributed call, FSDP2's or DTensor's step, this rank and where
    longstraw was. None for any other error."""
    if not isinstance(err, RuntimeError) or isinstance(err, CollectiveError) or env_world_size() <= 1:
        return None
    frames = [(f.filename.replace("\\", "/"), f.name, f.lineno) for f in traceback.extract_tb(err.__traceback__)]
    torch_dist = [(path, name) for path, name, _ in frames if "/torch/distributed/" in path and "/elastic/" not in path]
    text = str(err).strip()
    if not torch_dist and not any(k in text for k in ("/gloo/", "NCCL error", "ProcessGroupNCCL")):
        return None  # (a collective in a backward hook may arrive without its frames, but with gloo's or NCCL's text)
    wrappers = ("__call__", "wrapper", "decorate_context", "inner", "_fn", "apply", "forward")
    named = [(path, name) for path, name in torch_dist if name not in wrappers] or torch_dist
    what = f"torch.distributed {named[-1][1]}" if named else "a torch.distributed collective"
    fsdp = [name for path, name in named if "/fsdp/" in path]
    dtensor = [name for path, name in named if path.endswith("/tensor/_api.py")]
    if fsdp:
        what += f" (FSDP2 {fsdp[-1]}: a sharded decoder layer's parameters or gradients)"
    elif dtensor:
        what += f" (DTensor.{dtensor[0]} of a sharded parameter)"
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))).replace("\\", "/") + "/"  # longstraw/
    ours = [(path[len(package) :], name, line) for path, name, line in frames if path.startswith(package)]
    where = (" in " + ", ".join(f"{path}:{line} ({name})" for path, name, line in ours[-2:])) if ours else ""
    steps = [name for path, name, _ in ours if path == "train/trainer.py"]
    during = f" during Trainer.{steps[-1]}" if steps else ""
    first = text.splitlines()[0] if text else ""
    return (
        f"{what} failed on rank {os.environ.get('RANK', '?')} of {env_world_size()}{where}{during} "
        f"({type(err).__name__}: {first[:400]})"
    )


def launch_local(nproc: int, argv: list[str], cpu: bool) -> int:
    """Run `python -m longstraw ARGV` as `nproc` ranks on this machine, as `torchrun --standalone --nproc-per-node
    nproc` would (torch.distributed's elastic launcher, rendezvous on a free local port, no restarts); on the CPU each
    rank gets one thread unless OMP_NUM_THREADS says otherwise. Returns the exit status: 0, or 1 when a rank failed
    (the launcher then stops the others)."""
    if env_world_size() > 1:
        raise ValueError("--nproc inside a multi-process launch (WORLD_SIZE is set): use one or the other")
    if cpu:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"longstraw-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
    )
    try:
        elastic_launch(config, sys.executable)("-m", "longstraw", *argv)
    except ChildFailedError as err:
        rank, first = err.get_first_failure()
        print(
            f"longstraw: rank {rank} of {nproc} failed first (exit code {first.exitcode}; its error is above); the "
            "launcher stopped the other ranks. The last checkpoint is intact: run the same command again to resume.",
            file=sys.stderr,
        )
        return 1
    return 0
