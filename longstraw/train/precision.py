"""float32 master weights for trainable bf16 parameters (full fine-tuning of a bf16 model, or bf16 embeddings
trained beside a LoRA adapter).

A bf16 weight keeps 8 significant bits: an AdamW update below ~2⁻⁹ of the weight rounds away entirely, and a
gradient summed over many responses in bf16 loses the small terms. So each trainable bf16 parameter p gets a
float32 master copy m:

    backward     p's bf16 gradient of this backward is added into m.grad (float32) by a post-accumulate hook,
                 and p.grad is dropped: gradients accumulate over branches and prompts in float32
    optimizer    steps on the masters (its state, AdamW's moments, is float32 too); clipping and the
                 finite check read the masters' gradients
    after step   p ← m rounded to bf16, once per step

float32 parameters (LoRA adapters) are their own masters, untouched. Memory: 4 bytes per trainable bf16
parameter for the master and 4 for its gradient, on top of the optimizer's 8.

fp16 parameters are not handled: fp16 gradients underflow without loss scaling, which the trainer does not do
(`TrainConfig` refuses trainable fp16 weights).
"""

from __future__ import annotations

import torch

HALF = (torch.bfloat16,)


class MasterWeights:
    """The float32 tensors an optimizer should update for `params` (in order), with the hooks that route each
    bf16 parameter's gradient into its master. `params`: the trainable parameters of the model."""

    def __init__(self, params):
        self.model_params = list(params)
        #: (model parameter, its float32 master) for the bf16 ones
        self.pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        #: what the optimizer updates: a float32 parameter itself, else its master
        self.params: list[torch.Tensor] = []
        self._handles = []
        for p in self.model_params:
            if p.dtype not in HALF:
                self.params.append(p)
                continue
            master = torch.nn.Parameter(p.detach().float().clone())
            self.pairs.append((p, master))
            self.params.append(master)
            self._handles.append(p.register_post_accumulate_grad_hook(_accumulate_into(master)))

    def copy_to_model(self) -> None:
        """After an optimizer step: each bf16 parameter ← its master, rounded."""
        with torch.no_grad():
            for p, master in self.pairs:
                p.copy_(master)

    def state(self) -> list[torch.Tensor]:
        """The masters' values (for a checkpoint: the model's bf16 weights alone would round them)."""
        return [master.detach().clone() for _, master in self.pairs]

    def load_state(self, values: list[torch.Tensor] | None) -> None:
        """Restore the masters from `state()`, or (None: a checkpoint written without masters) from the model's
        current weights; then the model from the masters."""
        with torch.no_grad():
            if values is None:
                for p, master in self.pairs:
                    master.copy_(p)
                return
            if len(values) != len(self.pairs):
                raise ValueError(
                    f"checkpoint holds {len(values)} master weights; this model has {len(self.pairs)} "
                    "trainable bf16 parameters"
                )
            for (p, master), value in zip(self.pairs, values):
                master.copy_(value)
                p.copy_(master)

    def remove(self) -> None:
        """Detach the gradient hooks (the model's bf16 parameters accumulate their own gradients again)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _accumulate_into(master: torch.Tensor):
    def hook(p: torch.Tensor) -> None:
        assert p.grad is not None  # a post-accumulate-grad hook: the gradient was just accumulated
        if master.grad is None:
            master.grad = p.grad.float()
        else:
            master.grad.add_(p.grad)
        p.grad = None

    return hook
