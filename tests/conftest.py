import pytest
import torch

from longstraw.models import TINY_CONFIGS, TINY_MULTIMODAL, tiny_model

ARCHS = list(TINY_CONFIGS) + list(TINY_MULTIMODAL)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    torch.set_num_threads(1)


def lora(model, seed: int = 0):
    """Wrap in a PEFT LoRA adapter with non-zero B (so adapter gradients are informative). MoE routers stay
    unwrapped: Llama 4's router is an `nn.Linear` that returns a tuple, which PEFT 0.21's LoRA layer rejects."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    routers = any(name.endswith("router") for name, _ in model.named_modules())
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                                            exclude_modules=r".*router" if routers else None))


def make_model(arch: str, use_lora: bool = False):
    model = tiny_model(arch)
    return lora(model) if use_lora else model


def tokens(n: int, seed: int, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_grads_close(got, want, tol: float, floor: float = 1e-3):
    """Every gradient within `tol` relative, and the concatenation too.

    A parameter whose gradient norm is below `floor` × the largest one (e.g. a gated-DeltaNet decay
    bias whose gradient cancels down to 1e-4 of the others, computed by transformers in float32) only
    carries rounding noise there: it is held to `tol` × floor × the largest norm instead.
    """
    pairs = [(a, b) for a, b in zip(got, want) if b is not None]
    assert all(a is not None for a, _ in pairs)
    scale = max(b.norm().item() for _, b in pairs)
    for a, b in pairs:
        assert (a - b).norm().item() <= tol * max(b.norm().item(), floor * scale)
    assert rel_err(torch.cat([a.flatten() for a, _ in pairs]), torch.cat([b.flatten() for _, b in pairs])) <= tol
