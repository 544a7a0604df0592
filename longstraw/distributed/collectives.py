"""Collectives as longstraw uses them: named, tagged, argument-checked.

- Every collective has a name (``"replay forward layer 3: queries"``). A failure inside torch.distributed — a
  timeout because a rank died or never arrived, a closed connection — is re-raised as `CollectiveError` naming the
  collective, this rank and the group size. The timeout is the group's own (`init_process_group(timeout=...)`,
  `new_group(timeout=...)`): a dead rank is an error after that long, not a hang.
- Every message carries an 8-byte tag derived from the collective's name. Ranks whose collectives are out of step
  (one replays while another runs a backward) exchange different tags: `CollectiveError` names both, instead of
  silently mixing queries of one layer with partials of another.
- `agree(...)`: a cheap hash all-gather of a call's arguments; every rank raises the same `MismatchError` naming the
  arguments that differ and each rank's value (or hash), so no rank goes on alone into a collective that would hang.

Messages are byte buffers: tensors of any dtypes packed behind the tag (each segment aligned to 8 bytes), so one
collective moves queries in the model's dtype and partial results in float32 together.
"""

from __future__ import annotations

import hashlib
import zlib

import torch
import torch.distributed as dist

_ALIGN = 8
_NAMES: dict[int, str] = {}
#: torch 2.13 renames `all_gather_into_tensor` (deprecated there) to `all_gather_single`
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
    torch.int8,
    torch.float8_e4m3fn,
]


class CollectiveError(RuntimeError):
    """A collective failed (timeout, dead rank, ranks out of step); the message names the collective."""


class MismatchError(ValueError):
    """Ranks called a longstraw collective with different arguments (the same message on every rank)."""


def _tag(name: str) -> int:
    tag = zlib.crc32(name.encode()) | (1 << 40)
    _NAMES.setdefault(tag, name)
    return tag


def digest(*parts) -> int:
    """A 62-bit hash of tensors (dtype, shape, bytes), strings and numbers, the same on every process (unlike
    `hash`)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        if isinstance(p, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in p):
            h.update(f"L{len(p)}:{digest(*p)}".encode())
        elif isinstance(p, torch.Tensor):
            t = p.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.flatten().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(p).encode())
        h.update(b"\x00")
    return int.from_bytes(h.digest(), "little") >> 2


class Group:
    """A torch.distributed process group (None: the default group) with longstraw's named, tagged collectives."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "group=...: torch.distributed is not initialized (call "
                "torch.distributed.init_process_group or launch with torchrun)"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise RuntimeError("group=...: this process is not a member of the group")
        backend = dist.get_backend(group)
        # gloo exchanges CPU tensors; NCCL device tensors
        self.device = torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())

    def fail(self, name: str, err: BaseException):
        raise CollectiveError(
            f"longstraw collective {name!r} failed on rank {self.rank} of {self.size} ({type(err).__name__}: {err})"
        ) from err

    def _check_tags(self, name: str, tags: list[int], ranks=None) -> None:
        mine = _tag(name)
        for r, t in zip(ranks or range(len(tags)), tags):
            if t != mine:
                other = _NAMES.get(t, f"an unknown collective (tag {t:#x})")
                raise CollectiveError(
                    f"longstraw collective {name!r} on rank {self.rank} of {self.size}: rank {r} is "
                    f"in {other!r} instead; ranks are out of step (every rank must make the same "
                    "longstraw calls in the same order)"
                )

    # ------------------------------------------------------------------ packing
    def _pack(self, name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        segs = [torch.tensor([_tag(name)], dtype=torch.int64).view(torch.uint8)]
        for t in tensors:
            b = t.detach().contiguous().reshape(-1).view(torch.uint8).to(self.device)
            pad = -b.numel() % _ALIGN
            segs.append(b)
            if pad:
                segs.append(torch.zeros(pad, dtype=torch.uint8, device=self.device))
        return torch.cat([s.to(self.device) for s in segs])

    @staticmethod
    def _size(specs) -> int:
        n = _ALIGN
        for shape, dtype in specs:
            b = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            n += b + (-b % _ALIGN)
        return n

    @staticmethod
    def _unpack(buf: torch.Tensor, specs, device) -> tuple[int, list[torch.Tensor]]:
        tag = int(buf[:_ALIGN].cpu().view(torch.int64)[0])
        out, off = [], _ALIGN
        for shape, dtype in specs:
            b = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            out.append(buf[off : off + b].clone().view(dtype).reshape(shape).to(device))
            off += b + (-b % _ALIGN)
        return tag, out

    # ------------------------------------------------------------------ collectives
    def all_gather(self, name: str, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Every rank's `tensors` (same shapes and dtypes on every rank), in rank order."""
        specs = [(tuple(t.shape), t.dtype) for t in tensors]
        device = tensors[0].device if tensors else torch.device("cpu")
        buf = self._pack(name, tensors)
        out = torch.empty(self.size * buf.numel(), dtype=torch.uint8, device=self.device)
        try:
            _all_gather_single(out, buf, group=self.group)
        except RuntimeError as err:
            self.fail(name, err)
        parts = [self._unpack(chunk, specs, device) for chunk in out.chunk(self.size)]
        self._check_tags(name, [t for t, _ in parts])
        return [p for _, p in parts]

    def all_to_all(self, name: str, per_rank: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Send `per_rank[j]` to rank j; returns what each rank sent to this one, in rank order. The shapes and dtypes
        of `per_rank[j]` must not depend on j (nor on the rank)."""
        specs = [(tuple(t.shape), t.dtype) for t in per_rank[0]]
        device = per_rank[0][0].device
        bufs = [self._pack(name, ts) for ts in per_rank]
        send = torch.cat(bufs)
        recv = torch.empty_like(send)
        try:
            dist.all_to_all_single(recv, send, group=self.group)
        except RuntimeError as err:
            self.fail(name, err)
        parts = [self._unpack(chunk, specs, device) for chunk in recv.chunk(self.size)]
        self._check_tags(name, [t for t, _ in parts])
        return [p for _, p in parts]

    def broadcast(self, name: str, tensors: list[torch.Tensor], src: int) -> list[torch.Tensor]:
        """`tensors` of rank `src` on every rank (the same shapes and dtypes on every rank)."""
        specs = [(tuple(t.shape), t.dtype) for t in tensors]
        device = tensors[0].device if tensors else torch.device("cpu")
        buf = self._pack(name, tensors)
        try:
            dist.broadcast(buf, src=self._global(src), group=self.group)
        except RuntimeError as err:
            self.fail(name, err)
        tag, out = self._unpack(buf, specs, device)
        self._check_tags(name, [tag])
        return out

    # ------------------------------------------------------------------ point to point
    _HEADER = 64

    def send(self, name: str, tensors: list[torch.Tensor], dst: int) -> None:
        """Send `tensors` (any shapes and dtypes, at most 7, up to 6 dimensions) to rank `dst` of the group: a header
        with their shapes, then the data."""
        header = [_tag(name), len(tensors)]
        for t in tensors:
            header += [_DTYPES.index(t.dtype), t.dim(), *t.shape, *[0] * (6 - t.dim())]
        header += [0] * (self._HEADER - len(header))
        try:
            dist.send(
                torch.tensor(header, dtype=torch.int64, device=self.device), dst=self._global(dst), group=self.group
            )
            dist.send(self._pack(name, tensors), dst=self._global(dst), group=self.group)
        except RuntimeError as err:
            self.fail(name, err)

    def recv(self, name: str, src: int, device=None) -> list[torch.Tensor]:
        """What rank `src` sent with `send` under the same name."""
        header = torch.empty(self._HEADER, dtype=torch.int64, device=self.device)
        try:
            dist.recv(header, src=self._global(src), group=self.group)
        except RuntimeError as err:
            self.fail(name, err)
        fields: list[int] = header.tolist()
        self._check_tags(name, [fields[0]], ranks=[src])
        specs = []
        for i in range(fields[1]):
            code, ndim, *dims = fields[2 + 8 * i : 10 + 8 * i]
            specs.append((tuple(dims[:ndim]), _DTYPES[code]))
        buf = torch.empty(self._size(specs), dtype=torch.uint8, device=self.device)
        try:
            dist.recv(buf, src=self._global(src), group=self.group)
        except RuntimeError as err:
            self.fail(name, err)
        tag, out = self._unpack(buf, specs, device or self.device)
        self._check_tags(name, [tag], ranks=[src])
        return out

    def _global(self, r: int) -> int:
        return r if self.group is None or self.group is dist.group.WORLD else dist.get_global_rank(self.group, r)

    def all_gather_ints(self, name: str, values: list[int]) -> list[list[int]]:
        rows = self.all_gather(name, [torch.tensor(values, dtype=torch.int64)])
        return [r[0].tolist() for r in rows]

    def agree(self, what: str, fields: dict, free: tuple[int, ...] = ()) -> list[list[int]]:
        """Refuse, on every rank with the same message, a call whose `fields` differ between ranks.

        `fields`: name → int (compared and shown as is) or anything else (compared by `digest`). `free`: ints gathered
        in the same collective but allowed to differ (e.g. each rank's response length). Returns every rank's
        `free` values, in rank order."""
        names = list(fields)
        mine = [v if isinstance(v, int) and not isinstance(v, bool) else digest(v) for v in fields.values()]
        rows = self.all_gather_ints(f"{what}: argument check", mine + [int(v) for v in free])
        free_rows = [row[len(names) :] for row in rows]
        rows = [row[: len(names)] for row in rows]
        differ = [i for i in range(len(names)) if len({row[i] for row in rows}) > 1]
        if differ:
            shown = []
            for i in differ:
                raw = isinstance(fields[names[i]], int) and not isinstance(fields[names[i]], bool)
                vals = ", ".join(
                    f"rank {r}: {row[i] if raw else f'#{row[i] & 0xFFFFFFFF:08x}'}" for r, row in enumerate(rows)
                )
                shown.append(f"{names[i]} ({vals})")
            raise MismatchError(
                f"{what}: the {self.size} ranks of the group were called with different arguments: "
                f"{'; '.join(shown)}. Every rank must pass the same values to this collective call"
            )
        return free_rows
