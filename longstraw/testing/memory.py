"""Exact counts of the tensor memory a piece of code holds, for tests: `LiveBytes`.

RSS (`longstraw.train.memory.MemoryMeter`) is what a user sees, but it moves with the allocator and the machine;
a test of a memory bound wants the bytes of live tensors, which depend on shapes only. `LiveBytes` counts every
tensor storage created while it is active (by any ATen operator, autograd's backward included) from its creation to
its release; storages created before it (the model's weights, a captured prompt state) are not counted.

    with LiveBytes() as live:
        run()
    live.peak  # the most bytes held at once by storages created inside
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """The bytes of tensor storages created inside the mode and still alive (`now`), and their maximum (`peak`).

    A storage is counted once however many tensors view it, from the operator that made it until Python's reference
    to it is released (views, in-place results and outputs that alias an input add nothing). Kernels' internal
    workspaces are not tensors the dispatcher sees and are not counted. Tensors on `device` only.

    `existing`: tensors made before (the weights, a captured state) whose storages an operator inside may return
    again (`alias`, a transpose of a weight): not counted. Without it such a storage counts as new."""

    def __init__(self, device: str = "cpu", existing=()):
        super().__init__()
        self.device = torch.device(device).type
        self.now = 0
        self.peak = 0
        self._live: dict[int, int] = {}
        self._old = {t.untyped_storage().data_ptr() for t in existing if isinstance(t, torch.Tensor)}

    def _release(self, ptr: int) -> None:
        self.now -= self._live.pop(ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != self.device:
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0 or ptr in self._live or ptr in self._old:
                continue
            self._live[ptr] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._release, ptr)
        return out


__all__ = ["LiveBytes"]
