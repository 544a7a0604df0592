"""A compressed durable state: prompt tokens in 8 bits with a float32 scale per block of tokens and head.

`QuantizedTokens` holds what a growing layer kind keeps per prompt token — full-attention K or V
`[1, Hkv, P, D]`, MLA latents `[1, 1, P, r + dr]` — as fp8 (e4m3) or int8 with one scale per
`block` tokens × one head (absmax / the format's largest value), quantized once, at capture, as each
block completes. The last, unfinished block (fewer than `block` tokens) stays in the model's dtype
until capture ends. Bytes per token and head: D (the 8-bit values) + 4 / block (the scale): for
D = 128 and block = 64, 0.25 of float32 (0.50 of bf16); for D = 32, 0.25 + 1/512.

Attention never dequantizes the whole state: its kernels read one key block at a time through
`read(start, n, dtype)` (`longstraw.ops.attention`), and DSA gathers only the selected rows
(`gather_rows`); the transient is one tile. `dequantize()` is the plain reference the tests use.

The state is a constant: exact mode (`prompt_grad="exact"`) refuses a quantized state, since its
gradient would be with respect to values that were rounded away.
"""

from __future__ import annotations

import torch

#: names accepted for `capture(..., state_dtype=...)`
STATE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "int8": torch.int8,
}
#: tokens per scale
QUANT_BLOCK = 64
_MAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


def state_dtype(value) -> torch.dtype | None:
    """`capture`'s `state_dtype` argument as a torch dtype (None: the model's own dtype, no compression)."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {sorted(STATE_DTYPES)} or None; got {value!r}")
        return STATE_DTYPES[value]
    if value not in _MAX:
        raise ValueError(f"state_dtype must be torch.float8_e4m3fn or torch.int8 (or None); got {value}")
    return value


def check_device(dtype: torch.dtype, device) -> None:
    """A clear error where `device` cannot hold or convert to `dtype`."""
    try:
        torch.ones(2, device=device).to(dtype).to(torch.float32)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"state_dtype {dtype} is not supported on {device}: {err}") from None


def quantize(x: torch.Tensor, dtype: torch.dtype, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values in `dtype` `[1, H, n, D]`, scales float32 `[1, H, n / block]`) of `x` `[1, H, n, D]`, n a multiple
    of `block`: each block of tokens × head divided by its absmax / the format's largest value."""
    one, h, n, d = x.shape
    xf = x.float().reshape(one, h, n // block, block, d)
    scale = (xf.abs().amax(dim=(-1, -2)) / _MAX[dtype]).clamp_min(torch.finfo(torch.float32).tiny)
    y = xf / scale[..., None, None]
    if dtype == torch.int8:
        y = y.round().clamp(-127, 127)
    return y.to(dtype).reshape(one, h, n, d), scale


def host_or_device(shape, dtype, device, compute_device) -> torch.Tensor:
    """An empty buffer on `device`: pinned when that is the host and the computation runs on a GPU."""
    device = torch.device(device)
    pin = device.type == "cpu" and torch.device(compute_device).type == "cuda"
    return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)


class QuantizedTokens:
    """`[1, H, P, D]` prompt tokens in 8 bits, filled chunk by chunk during capture (see the module docstring)."""

    #: a constant of the replay graph
    requires_grad = False

    def __init__(self, like: torch.Tensor, capacity: int, dtype: torch.dtype, block: int = QUANT_BLOCK, device=None):
        """`device`: where the 8-bit blocks and their scales live (default: with `like`; "cpu" for a CUDA
        model: pinned host memory, see `capture(state_device=...)`); the unfinished tail stays with `like`."""
        one, h, _, d = like.shape
        self.dtype = like.dtype  # what `read` returns by default: the model's dtype
        self.device = like.device  # where `read` delivers by default
        self.block = block
        self.qdtype = dtype
        full = capacity - capacity % block
        self.values = host_or_device((one, h, full, d), dtype, like.device if device is None else device, like.device)
        self.scales = host_or_device(
            (one, h, full // block), torch.float32, like.device if device is None else device, like.device
        )
        self.quantized = 0  # tokens in `values`
        self.tail = like[:, :, :0].clone()  # the unfinished block, in the model's dtype

    @property
    def length(self) -> int:
        return self.quantized + self.tail.shape[2]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.values.shape[0], self.values.shape[1], self.length, self.values.shape[3]))

    @property
    def nbytes(self) -> int:
        return (
            self.values.numel() * self.values.element_size()
            + self.scales.numel() * 4
            + self.tail.numel() * self.tail.element_size()
        )

    def tensors(self) -> list[torch.Tensor]:
        return [self.values, self.scales, self.tail]

    def append(self, x: torch.Tensor) -> None:
        """Add the tokens `x` `[1, H, n, D]` that follow; complete blocks are quantized now."""
        pending = torch.cat([self.tail, x], dim=2)
        full = pending.shape[2] - pending.shape[2] % self.block
        if full:
            q, s = quantize(pending[:, :, :full], self.qdtype, self.block)
            b0 = self.quantized // self.block
            self.values[:, :, self.quantized : self.quantized + full] = q
            self.scales[:, :, b0 : b0 + full // self.block] = s
            self.quantized += full
        self.tail = pending[:, :, full:].clone()

    def read(self, start: int, n: int, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        """Tokens start … start + n − 1, dequantized, `[1, H, n, D]` in `dtype` (default: the model's) on `device`
        (default: where the state lives; a host-resident state's 8-bit block travels before it is dequantized)."""
        dtype = dtype or self.dtype
        device = self.device if device is None else torch.device(device)
        end = start + n
        parts = []
        if start < self.quantized:
            a, b = start, min(end, self.quantized)
            v = to_device(self.values[:, :, a:b], device).to(torch.float32)
            s = to_device(self.scales[:, :, a // self.block : (b - 1) // self.block + 1], device)
            if a % self.block == 0 and (b - a) % self.block == 0:  # whole blocks (tiles are): one broadcast product
                one, h, n, d = v.shape
                v = v.view(one, h, n // self.block, self.block, d).mul_(s[..., None, None]).view(one, h, n, d)
                parts.append(v.to(dtype))
            else:
                idx = torch.arange(a, b, device=device) // self.block - a // self.block
                parts.append((v * s[:, :, idx, None]).to(dtype))
        if end > self.quantized:
            tail = self.tail[:, :, max(start, self.quantized) - self.quantized : end - self.quantized]
            parts.append(to_device(tail, device).to(dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def gather_rows(self, idx: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Head 0's rows `idx` (any shape, positions < `length`) dequantized: `[*idx.shape, D]` (MLA latents)."""
        dtype = dtype or self.dtype
        q = idx.clamp(max=max(self.quantized - 1, 0))
        out = (
            (self.values[0, 0][q].to(torch.float32) * self.scales[0, 0][q // self.block][..., None]).to(dtype)
            if self.quantized
            else torch.zeros((*idx.shape, self.values.shape[-1]), dtype=dtype, device=self.device)
        )
        if self.tail.shape[2]:
            t = (idx - self.quantized).clamp(min=0, max=self.tail.shape[2] - 1)
            out = torch.where((idx >= self.quantized)[..., None], self.tail[0, 0][t].to(dtype), out)
        return out

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole state in full precision (the tests' reference; the kernels never do this)."""
        return self.read(0, self.length, dtype)


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """`x` on `device`; from pinned host memory without waiting (a copy per leading index when the slice is not
    contiguous, so no pageable staging copy is made on the host)."""
    device = torch.device(device)
    if x.device == device:
        return x
    if x.is_contiguous() or x.dim() < 3:
        return x.to(device, non_blocking=True)
    out = torch.empty(x.shape, dtype=x.dtype, device=device)
    for i in range(x.shape[0]):
        for h in range(x.shape[1]):
            out[i, h].copy_(x[i, h], non_blocking=True)
    return out


def read_block(x, start: int, n: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Keys or values start … start + n − 1 of a tensor `[B, H, T, D]` or a `QuantizedTokens`, in `dtype`, on
    `device` (default: where they live)."""
    if isinstance(x, torch.Tensor):
        block = x[:, :, start : start + n]
        return (block if device is None else to_device(block, device)).to(dtype)
    return x.read(start, n, dtype, device)
