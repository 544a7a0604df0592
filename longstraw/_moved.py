"""Old import paths of moved modules, kept for one release: `import longstraw.trainer` still works, gives the module
at its new home (`longstraw.train.trainer`, the same module object, so `monkeypatch` and `isinstance` agree) and
warns with a DeprecationWarning naming the new path.

`MOVED` maps each old module name to its new one; `install()` (run by `longstraw/__init__.py`) appends the finder to
`sys.meta_path`, after the regular finders, so it only answers for names no file holds any more.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: old module name → new module name (moved in 0.1.0 → removed in the next release)
MOVED = {f"longstraw.{m}": f"longstraw.train.{m}" for m in (
    "config", "data", "rewards", "rollout", "update", "precision", "trainer", "checkpoint", "export", "devices",
    "metrics", "memory", "plots")}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old name goes in the next release", DeprecationWarning,
                      stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module):
        """Nothing to run: the module is the one at the new path, already imported."""


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
