"""PromptState: the durable state of one captured prompt, and branch replay against it.

`longstraw.capture(model, prompt_ids)` runs the prompt once, chunk by chunk, under `no_grad`, and
keeps per decoder layer only what later tokens can read (`longstraw.kinds`). The last prompt token
is not captured: each replay runs `[prompt[-1]] + response[:-1]`, so every response log-prob, the
first one included, comes out of the replay's autograd graph.

Memory: capture holds the durable state plus one chunk's activations (O(chunk · hidden) and
O(heads · chunk · block) attention scores); a replay holds the durable state (read, never copied) plus
one branch's graph, O(R) in the response length and independent of P beyond reading the state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .branch import Branch
from .hf.cache import BranchCache
from .hf.decoder import run_decoder
from .hf.parts import ModelParts, model_device
from .kinds import LayerState
from .model.capability import layer_states, model_parts
from .model.chunking import auto_chunk_size
from .model.prepare import prepare
from .ops import quant
from .ops.attention import DEFAULT_BLOCK
from .sampler import Replay, Samples, TokenIds, as_ids, check_length, replay_tokens, sample

#: token ids as the public functions take them: a 1-D (or `[1, T]`) integer tensor, or a sequence of ints

PROMPT_GRAD_MODES = ("detached", "exact")


class PromptState:
    """Durable state of a captured prompt of P tokens (P − 1 captured, the last one replayed).

    Use `replay(response_ids)` any number of times, in any order: replays never write the state.
    Free it with `release()` or by using the state as a context manager.
    """

    def __init__(
        self,
        parts: ModelParts,
        layers: list[LayerState],
        last_token: torch.Tensor,
        prompt_length: int,
        chunk_size: int,
        prompt_grad: str,
        block: int,
    ):
        #: the model's parts the state was captured with (decoder, LM head, config: `longstraw.hf.parts.ModelParts`),
        #: what its branches, sampler and replays run
        self.parts = parts
        self.layers: list[LayerState] | None = layers
        self.last_token = last_token
        self.prompt_length = prompt_length
        self.chunk_size = chunk_size
        self.prompt_grad = prompt_grad
        self.block = block
        self._chunks: list[tuple[int, int]] = []  # exact mode: captured chunk bounds
        self._prompt: torch.Tensor | None = None  # exact mode: the captured tokens
        self._backward_done = False

    # ------------------------------------------------------------------ bookkeeping
    @property
    def nbytes(self) -> int:
        """Bytes of durable state held (all layers)."""
        return sum(layer.nbytes for layer in self._live())

    def release(self) -> None:
        """Free the durable state; later replays raise."""
        if self.layers is not None:
            for layer in self.layers:
                layer.release()
        self.layers = None

    def __enter__(self) -> PromptState:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        status = "released" if self.layers is None else f"{self.nbytes / 2**20:.2f} MiB"
        return f"PromptState(prompt_length={self.prompt_length}, prompt_grad={self.prompt_grad!r}, {status})"

    def _live(self) -> list[LayerState]:
        if self.layers is None:
            raise RuntimeError("this PromptState was released")
        return self.layers

    def live_layers(self) -> list[LayerState]:
        """The state's layers; raises if the state was released (what a branch checks before it reads the state)."""
        return self._live()

    def branch_cache(self, batch: int = 1) -> BranchCache:
        """A cache of `batch` rows over this state (each layer's branch: reads the state, keeps what the rows add)."""
        return BranchCache([layer.branch(batch) for layer in self._live()], block=self.block)

    # ------------------------------------------------------------------ exact mode
    def backward(self) -> None:
        """Exact mode: push the gradient the replays accumulated on the durable state into the parameters.

        The prompt is recomputed chunk by chunk in reverse order with autograd. Chunk c reads the
        earlier positions' K/V from the state (leaves: what flows there is accumulated) and starts its
        linear-attention layers from the stored boundary states (leaves too); it back-propagates the
        accumulated gradient of what it produced (its own K/V, the states at its right boundary) and
        frees its graph before chunk c − 1. Memory: state + its gradient + one chunk's graph.
        Call it once, after the last replay's backward. In detached mode it does nothing.
        """
        if self.prompt_grad != "exact":
            return
        layers = self._live()
        if self._backward_done:
            raise RuntimeError("PromptState.backward() was already called for this state")
        parts = self.parts
        device = self.last_token.device
        bounds = self._chunks
        for c in range(len(bounds) - 1, -1, -1):
            s, e = bounds[c]
            branches = [layer.reverse_branch(c, s) for layer in layers]
            cache = BranchCache(branches, block=self.block)
            assert self._prompt is not None  # exact mode: the captured tokens (`capture_local`)
            with torch.enable_grad():
                run_decoder(parts, self._prompt[None, s:e], torch.arange(s, e, device=device), cache)
            outputs, grads = [], []
            for layer, branch in zip(layers, cache.layers):
                for t, g in layer.chunk_outputs(c, s, e, branch):
                    if t.requires_grad:
                        outputs.append(t)
                        grads.append(g.to(t.dtype))
            if outputs:
                torch.autograd.backward(outputs, grads)
            del cache, branches, outputs, grads
        self._backward_done = True

    # ------------------------------------------------------------------ replay
    def replay(
        self,
        response_ids: TokenIds,
        temperature: float = 1.0,
        checkpoint_layers: bool = False,
        prefix_ids: TokenIds | None = None,
    ) -> Replay:
        """Run `[prompt[-1]] + response[:-1]` with autograd against the state; log-probs of the response.

        Differentiable with respect to the trainable parameters through the response positions; with
        `prompt_grad="exact"` the backward also accumulates the gradient of the durable state, which
        `backward()` later pushes through the prompt (detached: the state is a constant). The LM head
        runs in chunks (`longstraw.ops.logprobs`): no `[R, vocab]` tensor is saved.

        `prefix_ids` `[L]`: tokens between the captured prompt and the response (a row's own question after a
        document it shares with other rows). The replay is then that of the prompt `prompt + prefix`: detached, the
        prefix runs without autograd (`chunk_size` tokens per forward), its K/V or states constants as a capture of
        the whole prompt would hold them; exact, it runs with autograd in the response's forward, so its share of the
        gradient reaches the parameters and the durable state. The log-probs are the response's `[R]` either way.

        `checkpoint_layers=True` keeps only each decoder layer's input in the graph and recomputes the
        layer during backward (activation checkpointing of the replay): replay memory drops from every
        layer's activations (MoE experts included) to one layer's, for one more forward of the response.
        Gradients are the same.
        """
        parts = self.parts
        device = self.last_token.device
        prefix = (
            torch.zeros(0, dtype=torch.long, device=device)
            if prefix_ids is None
            else as_ids(prefix_ids, "prefix_ids", parts.config.vocab_size, device, allow_empty=True)
        )
        n = prefix.numel()
        if n and self.prompt_grad == "detached":
            return self._replay_after(prefix, response_ids, temperature, checkpoint_layers)
        if n:  # exact: one forward of prefix + response, the log-probs taken after the prefix
            response_ids = torch.cat([prefix, as_ids(response_ids, "response_ids", parts.config.vocab_size, device)])
        response = self.checked_response(response_ids, checkpoint_layers)
        cache = self.replay_cache()
        start = self.prompt_length - 1
        return replay_tokens(parts, self.last_token, start, response, cache, temperature, checkpoint_layers, skip=n)

    def _replay_after(self, prefix: torch.Tensor, response_ids, temperature: float, checkpoint_layers: bool) -> Replay:
        """Detached `replay` after `prefix` `[L]`: the prefix through the branch cache without autograd, then the
        response with autograd. Memory: the state + the prefix's own K/V or states (no graph) + the response's graph."""
        with self.fork() as branch:  # the prefix read once without autograd, the response replayed after it
            branch.extend(prefix)
            return branch.replay(response_ids, temperature, checkpoint_layers)

    def checked_response(
        self, response_ids: TokenIds, checkpoint_layers: bool, length: int | None = None
    ) -> torch.Tensor:
        """The response of a replay as a 1-D LongTensor on the state's device, checked against the vocabulary and the
        model's positions after `length` tokens (default: the prompt's; a branch's replay gives its own)
        (`ContextParallelState` agrees it across the ranks)."""
        parts = self.parts
        response = as_ids(response_ids, "response_ids", parts.config.vocab_size, self.last_token.device)
        check_length(parts.config, (self.prompt_length if length is None else length) + response.numel())
        return response

    def checked_batch(
        self, rows: Sequence[TokenIds], checkpoint_layers: bool, length: int | None = None
    ) -> list[torch.Tensor]:
        """`checked_response` of each row of a batched replay (`longstraw.replay.batched.replay_batch`), as 1-D
        LongTensors (`ContextParallelState` agrees the batch across the ranks once)."""
        return [self.checked_response(r, checkpoint_layers, length) for r in rows]

    @property
    def batches_replays(self) -> bool:
        """Whether several responses of this state replay in one batch (`replay_batch`); every layer kind does on one
        process (`ContextParallelState`: not its DSA layers)."""
        return True

    def replay_cache(self, branch: Branch | None = None, batch: int = 1) -> BranchCache:
        """The cache a replay of `batch` responses reads its prompt state through: each layer's branch, or a snapshot
        of `branch`'s layers (a replay after a branch of this state), the prompt part shared by the rows
        (`ContextParallelState` reads the sliced layers across the ranks)."""
        return self.branch_cache(batch) if branch is None else branch.branch_cache(batch)

    def fork(self, chunk_size: int | None = None) -> Branch:
        """A `longstraw.branch.Branch` of this state: one trajectory that grows by `extend` (tool output) and
        `sample` (the policy's turns), reading this state without copying it. `chunk_size`: tokens per forward of
        an `extend` (default: the capture's)."""
        self._live()
        return Branch(self, chunk_size)

    def sample(
        self,
        num: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_token_ids: Sequence[int] = (),
        generator: torch.Generator | None = None,
        allowed_token_ids: Sequence[int] | torch.Tensor | None = None,
    ) -> Samples:
        """Decode `num` responses together from this one state (`longstraw.sampler.sample`)."""
        return sample(
            self,
            num,
            max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_token_ids=stop_token_ids,
            generator=generator,
            allowed_token_ids=allowed_token_ids,
        )


def validate_capture(model, prompt_ids, chunk_size, prompt_grad, block_size, state_dtype, progress):
    """`capture`'s checks of its arguments and of the model, before anything is allocated: (the model's parts, the
    prompt as a 1-D LongTensor on the model's device, the 8-bit state dtype or None)."""
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable progress(done, total); got {type(progress).__name__}")
    check_capture_options(prompt_grad, chunk_size, block_size)
    compressed = quant.state_dtype(state_dtype)
    if compressed is not None and prompt_grad == "exact":
        raise ValueError(
            "state_dtype (a quantized prompt state) is a constant: prompt_grad='exact' needs the state in "
            "the model's dtype; use prompt_grad='detached' or state_dtype=None"
        )
    parts = model_parts(model)
    prompt = as_ids(prompt_ids, "prompt_ids", parts.config.vocab_size, model_device(parts.model))
    check_length(parts.config, prompt.numel())
    return parts, prompt, compressed


def capture_local(
    model,
    prompt_ids,
    chunk_size: int | None = None,
    prompt_grad: str = "detached",
    block_size: int = DEFAULT_BLOCK,
    state_dtype=None,
    state_device=None,
    progress=None,
    *,
    validated=None,
) -> PromptState:
    """`longstraw.capture` in this process, without the self-check (which `longstraw.api.capture` runs first where it
    applies): the same arguments (but `group` and `verify`), the same state. `validated`: what `validate_capture`
    returned for these arguments, when the caller has checked them already."""
    parts, prompt, compressed = validated or validate_capture(
        model, prompt_ids, chunk_size, prompt_grad, block_size, state_dtype, progress
    )
    device = prompt.device
    prepare(model)
    if chunk_size is None:  # after the support check and self-check, which name what is wrong with a model first
        chunk_size = default_chunk_size(parts, prompt.numel())
    captured = prompt.numel() - 1
    layers = layer_states(parts.config, captured, parts.plan)
    if compressed is not None:
        quant.check_device(compressed, device)
        for layer in layers:
            if layer.supports_compression:
                layer.state_dtype = compressed
    offload = False
    if state_device is not None:
        where = torch.device(state_device)
        if where.type != "cpu" and where != device:
            raise ValueError(
                f"state_device must be 'cpu' (host memory) or the model's device {device}; got {state_device!r}"
            )
        offload = where.type == "cpu" and device.type != "cpu"
    if offload:
        if prompt_grad == "exact":
            raise ValueError("state_device='cpu' (an offloaded prompt state) supports prompt_grad='detached' only")
        for layer in layers:
            if layer.supports_offload:
                layer.state_device = torch.device("cpu")
    exact = prompt_grad == "exact"
    if exact:
        unsupported = sorted({type(layer).__name__ for layer in layers if not layer.supports_exact})
        if unsupported:
            raise NotImplementedError(f"prompt_grad='exact' is not supported yet for layer kinds {unsupported}")
    # the last token copied: a view would keep the caller's whole prompt (8 bytes per position) alive with the state
    state = PromptState(parts, layers, prompt[-1:].clone(), prompt.numel(), chunk_size, prompt_grad, block_size)
    with torch.no_grad():
        for s in range(0, captured, chunk_size):
            e = min(s + chunk_size, captured)
            if exact:
                for layer in layers:
                    layer.mark_boundary()
                state._chunks.append((s, e))
            cache = state.branch_cache()
            run_decoder(parts, prompt[None, s:e], torch.arange(s, e, device=device), cache)
            for layer, branch in zip(layers, cache.layers):
                layer.commit(branch, e - s)
            del cache
            if progress is not None:
                progress(e, captured)
    if exact:
        state._prompt = prompt[:captured]
        first = first_trainable_layer(parts)
        for layer in layers[first:]:
            layer.require_grad()
    return state


def default_chunk_size(parts: ModelParts, prompt_length: int) -> int:
    """`capture`'s chunk when none is given: `longstraw.model.chunking.auto_chunk_size` for the model's config and
    dtype (`parts`: `longstraw.model.capability.model_parts` of the model, derived once per capture)."""
    dtype = {torch.float32: "fp32", torch.float16: "fp16"}.get(next(parts.model.parameters()).dtype, "bf16")
    return auto_chunk_size(parts.config, prompt_length, dtype)


def check_capture_options(prompt_grad, chunk_size, block_size) -> None:
    """`capture`'s scalar options (one process or a group): a clear error naming the option."""
    if prompt_grad not in PROMPT_GRAD_MODES:
        raise ValueError(f"prompt_grad must be one of {PROMPT_GRAD_MODES}; got {prompt_grad!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None (chosen for the model); got {chunk_size!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int; got {block_size!r}")


def first_trainable_layer(parts: ModelParts) -> int:
    """Index of the first decoder layer whose durable state depends on a trainable parameter.

    The state of layer l is a function of the embeddings and layers ≤ l only: where none of those
    trains (e.g. LoRA on the attention projections of a hybrid whose first layers are linear
    attention), the state is a constant and gets no gradient buffer, and the reverse pass keeps no
    graph for those layers.
    """
    decoder = parts.decoder
    embed = getattr(decoder, "embed_tokens", None)
    blocks = getattr(decoder, "layers", None)
    if blocks is None or (embed is not None and any(p.requires_grad for p in embed.parameters())):
        return 0
    for i, block in enumerate(blocks):
        if any(p.requires_grad for p in block.parameters()):
            return i
    return len(blocks)
