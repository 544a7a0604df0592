"""Stand-ins installed by subclassing: a longstraw mixin put in front of a transformers module's class.

The way `torch.distributed.fsdp.fully_shard` extends a module's class: the module keeps its parameters, adapters,
hooks and state dict, and its class becomes `type(name, (mixin, cls), ...)`, made once per (mixin, class) pair. The
mixin's `longstraw_base` is the class behind it (`unprepare` puts it back).
"""

from __future__ import annotations

from torch import nn

_SUBCLASSES: dict[tuple[type, type], type] = {}


def stand_in(mixin: type, cls: type) -> type:
    """`mixin` in front of `cls`, made once per pair and reachable by name from this module (pickling)."""
    key = (mixin, cls)
    if key not in _SUBCLASSES:
        name = f"{mixin.__name__}_{cls.__module__.replace('.', '_')}_{cls.__name__}"
        sub = type(name, (mixin, cls), {"longstraw_base": cls, "__module__": __name__, "__qualname__": name})
        globals()[name] = sub
        _SUBCLASSES[key] = sub
    return _SUBCLASSES[key]


def install(module: nn.Module, mixin: type) -> None:
    """Put `mixin` in front of `module`'s class (nothing if it is there already: a module shared by layers)."""
    if not isinstance(module, mixin):
        module.__class__ = stand_in(mixin, type(module))


def is_stand_in(cls: type) -> bool:
    """Whether `cls` is a class `stand_in` made."""
    return cls in _SUBCLASSES.values()
