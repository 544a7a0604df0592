"""Process memory measurement on Linux: current and peak resident set size, and peak reset.

Step memory = peak RSS during a step − RSS just before it, in a fresh process. The peak (VmHWM) is
reset by writing "5" to /proc/self/clear_refs, so a warm-up before the step does not count.
"""

from __future__ import annotations

import os

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
