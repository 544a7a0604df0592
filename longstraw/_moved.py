"""Old import paths of moved modules, kept for one release: `import longstraw.trainer` still works, gives the module
at its new home (`longstraw.train.trainer`, the same module object, so `monkeypatch` and `isinstance` agree) and
warns with a DeprecationWarning naming the new path.

`MOVED` maps each old module name to its new one; `install()` (run by `longstraw/__init__.py`) puts the finder first
in `sys.meta_path`: it answers only for the old names (no file holds them any more), and it must answer before the
regular finder would load a moved package's submodule a second time under its old name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

#: old module name → new module name (moved in 0.1.0 → removed in the next release); a moved package's submodules
#: follow it (`longstraw.kernels.native` → `longstraw.ops.kernels.native`)
MOVED = {
    **{
        f"longstraw.{m}": f"longstraw.train.{m}"
        for m in (
            "config",
            "data",
            "rewards",
            "rollout",
            "update",
            "precision",
            "trainer",
            "checkpoint",
            "export",
            "devices",
            "metrics",
            "memory",
            "plots",
        )
    },
    **{
        f"longstraw.{m}": f"longstraw.ops.{m}"
        for m in ("attention", "logprobs", "quant", "latent_attention", "compressed_attention", "kernels")
    },
    "longstraw.hf_attention": "longstraw.hf.cache",
    "longstraw.parallel": "longstraw.distributed.ranks",
    # the tiers (docs/design.md): layer kinds, what longstraw knows about a model, the tools above the trainer
    "longstraw.layers": "longstraw.kinds",
    "longstraw.support": "longstraw.model.capability",
    "longstraw.prepare": "longstraw.model.prepare",
    "longstraw.observe": "longstraw.model.observe",
    "longstraw.reference": "longstraw.model.oracles",
    "longstraw.positions": "longstraw.model.positions",
    "longstraw.plan": "longstraw.tools.planner",
    "longstraw.compare": "longstraw.tools.compare",
    "longstraw.real_models": "longstraw.tools.real_models",
    "longstraw.models": "longstraw.testing.models",
    "longstraw.state": "longstraw.prompt_state",
}


def new_name(name: str) -> str | None:
    """The module an old name now is, or None for a name that did not move."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if new_name(name) is None:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        new = new_name(spec.name)
        warnings.warn(
            f"{spec.name} moved to {new}; the old name goes in the next release", DeprecationWarning, stacklevel=2
        )
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__  # the import system sets the old name's spec on it: put it back after
        return module

    def exec_module(self, module):
        """Nothing to run: the module is the one at the new path, already imported; it keeps its own `__spec__`
        (relative imports inside its functions resolve against it)."""
        module.__spec__ = module.__spec__.loader_state


class _Package(types.ModuleType):
    """The class of the `longstraw` module: an old name is an attribute too (`longstraw.support`, as after
    `import longstraw` before the move), and importing an old path never replaces a public function of the same name
    (`import longstraw.prepare` would bind the module to `longstraw.prepare`, hiding `longstraw.prepare(model)`)."""

    def __getattr__(self, name: str):
        if new_name(f"{self.__name__}.{name}") is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        return importlib.import_module(f"{self.__name__}.{name}")

    def __setattr__(self, name: str, value) -> None:
        current = self.__dict__.get(name)
        if isinstance(value, types.ModuleType) and callable(current) and not isinstance(current, types.ModuleType):
            return
        super().__setattr__(name, value)


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())
    package = sys.modules[__name__.rsplit(".", 1)[0]]
    if not isinstance(package, _Package):
        package.__class__ = _Package
