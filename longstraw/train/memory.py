"""Memory of a training step and of its stages (capture, sample, replay, ...).

CPU (Linux): the peak resident set size (VmHWM) is reset at the start of every stage by writing "5"
to /proc/self/clear_refs, after `malloc_trim(0)` hands the allocator's free pages back to the kernel.
Without the trim, memory freed by an earlier step stays resident and a step that re-uses it shows no
growth at all (the "0 MiB per step" trap of peak − RSS-before); without the reset, a peak reached
once hides every later one. A stage's memory is its peak RSS − the RSS when the step started.

CUDA: the caching allocator's peak (`torch.cuda.max_memory_allocated`) reset per stage, minus what was
allocated when the step started. Either way, a stage that allocated cannot read 0.

Limit on CPU: RSS counts pages, so an allocation that fits in heap pages still resident (partly used
pages `malloc_trim` cannot return) is not seen; at tiny sizes (a few hundred KiB, e.g. sampling a
few tokens from a tiny model) a stage can read near 0. On CUDA the allocator's counters are exact.
"""

from __future__ import annotations

import ctypes
import os
import time
from contextlib import contextmanager

import torch

_MB = 1 << 20


def _status_kb(field: str) -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def rss_mb() -> float:
    """Current resident set size in MiB."""
    return _status_kb("VmRSS") / 1024


def peak_rss_mb() -> float:
    """Peak resident set size since the last `reset_peak()` (or process start) in MiB."""
    return _status_kb("VmHWM") / 1024


def reset_peak() -> None:
    """Reset the peak RSS to the current RSS (Linux ≥ 4.0)."""
    with open(f"/proc/{os.getpid()}/clear_refs", "w") as f:
        f.write("5")


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return None


_LIBC = _libc()


def trim_heap() -> None:
    """Return free heap pages to the kernel (glibc `malloc_trim`), so that re-use shows up in RSS."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class MemoryMeter:
    """Peak memory per stage of one step, in MiB above what the step started with.

        meter = MemoryMeter(device)
        meter.start_step()
        with meter.stage("capture"): ...
        meter.results()   # {"mem_capture_mb": ..., "step_mem_mb": max over the stages, "time_capture": s}

    Stages may repeat within a step (one capture per prompt): the peak and the total time are kept.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.base = 0.0
        self.peaks: dict[str, float] = {}
        self.times: dict[str, float] = {}

    def _now(self) -> float:
        return torch.cuda.memory_allocated() / _MB if self.cuda else rss_mb()

    def _reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            trim_heap()
            reset_peak()

    def _peak(self) -> float:
        return torch.cuda.max_memory_allocated() / _MB if self.cuda else peak_rss_mb()

    def start_step(self) -> None:
        self.peaks, self.times = {}, {}
        self._reset()
        self.base = self._now()

    @contextmanager
    def stage(self, name: str):
        self._reset()
        t = time.perf_counter()
        try:
            yield
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t
            self.peaks[name] = max(self.peaks.get(name, 0.0), self._peak() - self.base)

    def results(self) -> dict[str, float]:
        out = {f"mem_{k}_mb": round(v, 3) for k, v in self.peaks.items()}
        out.update({f"time_{k}": v for k, v in self.times.items()})
        out["step_mem_mb"] = round(max(self.peaks.values(), default=0.0), 3)
        return out
