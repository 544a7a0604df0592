"""Scale-out over torch.distributed: the prompt's state split by position over the ranks of a process group.

    state = longstraw.capture(model, prompt_ids, chunk_size=4096, group=pg)   # collective: same prompt on every rank
    out = state.replay(my_response)      # collective: each rank its own branch; out.logprobs [R_mine], with grad
    (-(adv * out.logprobs).sum()).backward()    # collective too (the backward exchanges query gradients)
    torch.distributed.all_reduce(p.grad) ...    # parameter gradients: each rank holds those of its own branch

Context-parallel capture, replay (detached and exact) and sampling (`context_parallel/`, one file per layer kind,
DSA's sparse selection in `context_parallel/sparse_attention.py`), FSDP2 for the weights (`fsdp.py`), expert
parallelism (`expert_parallel.py`), named and checked collectives (`collectives.py`), the trainer on N processes
(`ranks.py`), spread once when a run starts (`parallelize.py`). What each rank holds and does, the costs and the
failure modes: docs/distributed.md, "How it works, rank by rank".
"""

from .collectives import CollectiveError, Group, MismatchError
from .context_parallel import ContextParallelState, slice_bounds
from .fsdp import gradient_sync, replicated_parameters, shard, sharded_layers
from .parallelize import Parallel, StepShare, parallelize

__all__ = [
    "CollectiveError",
    "ContextParallelState",
    "Group",
    "MismatchError",
    "Parallel",
    "StepShare",
    "gradient_sync",
    "parallelize",
    "replicated_parameters",
    "shard",
    "sharded_layers",
    "slice_bounds",
]
