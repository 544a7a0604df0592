"""Where longstraw keeps what it builds once per machine: compiled kernels, converted real models."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir(sub: str = "") -> Path:
    """`$LONGSTRAW_CACHE`, else `~/.cache/longstraw`, else (not writable) a folder in the system's temporary
    directory; `sub` a folder inside it. Created if missing."""
    if "LONGSTRAW_CACHE" in os.environ:
        roots = [Path(os.environ["LONGSTRAW_CACHE"])]
    else:
        roots = [Path.home() / ".cache" / "longstraw", Path(tempfile.gettempdir()) / f"longstraw-{os.getuid()}"]
    for root in roots:
        path = root / sub if sub else root
        try:
            path.mkdir(parents=True, exist_ok=True)
            if os.access(path, os.W_OK):
                return path
        except OSError:
            continue
    raise OSError("no writable cache folder: set LONGSTRAW_CACHE")
