"""longstraw: GRPO on very long prompts by capturing the shared prompt once and replaying branches.

Public surface (DESIGN.md):

    state = longstraw.capture(model, prompt_ids, chunk_size=4096, prompt_grad="detached")
    out = state.replay(response_ids)   # out.logprobs: [R], differentiable
    state.nbytes; state.release()      # or: with longstraw.capture(...) as state: ...
"""

from .models import SUPPORTED_ARCHITECTURES, UnsupportedArchitectureError
from .state import PromptState, Replay, capture

__version__ = "0.1.0"

__all__ = ["PromptState", "Replay", "SUPPORTED_ARCHITECTURES", "UnsupportedArchitectureError", "capture"]
