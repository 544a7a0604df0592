"""Context parallelism over torch.distributed (`longstraw.distributed`): gloo on CPU, N ∈ {2, 4} processes of 1 thread.

Each spawn runs every scenario in one set of processes (started from a forkserver that has imported torch,
transformers and longstraw once, so a spawn costs well under a second after the first); the single-process
reference runs in the test process. The ranks write what they measured with `torch.save`; the test compares.
"""

from __future__ import annotations

import copy
import datetime
import functools
import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import longstraw
import longstraw.testing.models
from longstraw.distributed import slice_bounds
from longstraw.model.observe import observe_attention

from ..conftest import assert_tie_free, lora, rel_err, spawn_ranks, tokens
from .test_distributed_trainer import EPS32, GRAD_TOL
from ..test_equivalence import FLOOR_FACTOR, FP32_GRAD_TOL, FP32_LOGPROB_TOL

#: one family per layer kind the context-parallel capture serves: full attention (sliced K/V), sliding window +
#: full attention (replicated window), gated DeltaNet + full attention (recurrent state relayed rank to rank), MLA
#: (sliced latents), DSA (sliced latents and indexer keys, selection merged across ranks), attention sinks with
#: sliding and full layers (gpt-oss: the sink folded in as one more key of value 0)
ARCHS = ("llama", "gemma3_text", "qwen3_next", "deepseek_v3", "glm_moe_dsa", "gpt_oss")
ARCH = "llama"  # the cases that are not about layer kinds
SPARSE = ("glm_moe_dsa",)  # DSA: prompts chosen tie-free (`_tie_free_seed`)
RESPONSE_LENGTHS = (5, 7, 3, 6)
TIMEOUT_S = 60
SAMPLE = dict(num=3, max_new_tokens=6, temperature=1.0, top_k=50, stop_token_ids=(1, 183, 229))


def _response(rank: int, n: int, round_: int) -> torch.Tensor:
    """Rank r's response in a round; with 4 ranks, rank 3 passes the same response as rank 0."""
    r = 0 if (n == 4 and rank == 3) else rank
    return tokens(RESPONSE_LENGTHS[r] + round_, seed=100 + 10 * round_ + r)


#: the replay rounds of each case: plain, with activation checkpointing, after a row's own suffix (`prefix_ids`:
#: the tokens between a shared captured prefix and the response, read into a branch of the state without autograd),
#: and two responses of each rank after the suffix replayed together (`BATCHED`: one collective for the batch)
ROUNDS = 4
BATCHED = 3
SUFFIX = tokens(5, seed=77)


def _prefix(round_: int) -> torch.Tensor | None:
    return SUFFIX if round_ >= 2 else None


def _advantage(rank: int, length: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0 + rank, length)


def _responses(rank: int, n: int, round_: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank r's (response, per-token advantage) pairs in a round: one, or in the batched round two of different
    lengths (the second shorter, its advantages of the other sign)."""
    first = _response(rank, n, round_)
    pairs = [(first, _advantage(rank, first.numel()))]
    if round_ == BATCHED:
        r = 0 if (n == 4 and rank == 3) else rank
        second = tokens(RESPONSE_LENGTHS[r] - 1, seed=500 + r)
        pairs.append((second, -0.5 * _advantage(rank, second.numel())))
    return pairs


def _replay_round(state, rank: int, n: int, round_: int, checkpoint_layers: bool = False):
    """Replay rank r's responses of a round with their advantage-weighted backward, as the trainer does
    (`replay_backward`: the batched round's two in one batch where the state batches replays); (log-probs
    concatenated, collective replays run)."""
    from longstraw.replay.order import ReplayOrder, replay_backward

    pairs = _responses(rank, n, round_)
    logprobs = []

    def loss_of(j, sl, out):
        logprobs.append(out.logprobs.detach())
        return (pairs[j][1] * out.logprobs).sum()

    before = getattr(state, "_replays", 0)
    replay_backward(state, [(t, None) for t, _ in pairs], loss_of, ReplayOrder(batch=len(pairs)),
                    checkpoint_layers=checkpoint_layers, prefix_ids=_prefix(round_))
    return torch.cat(logprobs), getattr(state, "_replays", 0) - before


@functools.cache
def _tie_free_seed(arch: str, p: int, n: int) -> int:
    """DSA: the first prompt seed whose full sequences with every rank's responses have no top-k near-tie (a near-tie
    may select differently under any change of summation order; `conftest.assert_tie_free`)."""
    from longstraw.testing.models import tiny_model

    model = tiny_model(arch)
    for seed in range(1, 40):
        prompt = tokens(p, seed=seed)
        try:
            for round_ in range(ROUNDS):
                for r in range(n):
                    middle = [] if _prefix(round_) is None else [_prefix(round_)]
                    for response, _ in _responses(r, n, round_):
                        assert_tie_free(model, torch.cat([prompt, *middle, response]))
        except AssertionError:
            continue
        return seed
    raise AssertionError(f"no tie-free prompt for {arch} in 40 seeds")


def _prompt(p: int, rank: int = 0, differ: bool = False, arch: str = ARCH, n: int = 1) -> torch.Tensor:
    t = tokens(p, seed=_tie_free_seed(arch, p, n) if arch in SPARSE else 1)
    if differ and rank == 1:
        t = t.clone()
        t[3] = (t[3] + 1) % 256
    return t


def _worker(rank: int, n: int, init: str, out_dir: str, cases: tuple[tuple[str, int, bool], ...], check_timeout: bool,
            exact_cases: tuple[tuple[str, int, bool, int], ...] = ()):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)  # peft, as pyproject
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    from longstraw.distributed import CollectiveError, MismatchError
    from longstraw.kinds import base
    from longstraw.hf.parts import base_model, decoder_of
    from longstraw.testing.models import tiny_model

    # as in conftest: fresh state buffers start as NaN, so a slot capture never writes cannot look plausible
    base.empty_state = lambda like, shape: like.new_full(shape, float("nan"))
    result = {}
    for arch, p, use_lora in cases:
        model = lora(tiny_model(arch)) if use_lora else tiny_model(arch)
        params = [q for q in model.parameters() if q.requires_grad]
        # the most positions a linear-attention mixer and a feed-forward module saw in one call during capture
        # (chunk_size bounds both; attention layers take the whole slice)
        mixed, fed = [0], [0]
        observe_attention(model)  # the one short probe forward of the unmodified model, before the hooks count
        mixers = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
        hooks = [m.register_forward_hook(lambda mod, a, kw, out: mixed.__setitem__(0, max(
            mixed[0], kw.get("hidden_states", a[0] if a else None).shape[1])), with_kwargs=True) for m in mixers]
        def feed(mod, a, out):  # what the feed-forward module's parts see: [B, T, h] or [tokens, h]
            if a and isinstance(a[0], torch.Tensor) and a[0].dim() >= 2:
                fed[0] = max(fed[0], a[0].shape[-2])

        hooks += [m.register_forward_hook(feed) for block in decoder_of(base_model(model)).layers
                  for m in block.mlp.modules() if m is not block.mlp]
        t0 = time.perf_counter()
        state = longstraw.capture(model, _prompt(p, arch=arch, n=n), chunk_size=4, block_size=4, group=dist.group.WORLD)
        t_capture = time.perf_counter() - t0
        for h in hooks:
            h.remove()
        rounds = []
        for round_ in range(ROUNDS):  # replays of the same state: replays never write it
            model.zero_grad(set_to_none=True)
            # the second with activation checkpointing: its backward recomputes each layer, collectives included;
            # the third after a suffix (a collective branch of the state, replayed with its own K/V as constants);
            # the fourth two responses per rank after the suffix, together
            logprobs, replays = _replay_round(state, rank, n, round_, checkpoint_layers=round_ == 1)
            grads = [q.grad.clone() if q.grad is not None else torch.zeros_like(q) for q in params]
            for g in grads:  # the sum over the ranks' branches
                dist.all_reduce(g)
            rounds.append(dict(logprobs=logprobs, grads=grads, replays=replays))
        refused = None
        if arch in SPARSE:  # DSA layers replay one response per rank: a batch is refused by name, on every rank
            from longstraw.replay.batched import replay_batch

            try:
                replay_batch(state, [t for t, _ in _responses(rank, n, BATCHED)])
            except ValueError as err:
                refused = str(err)
        # sampling: every rank decodes all the sequences alike, the prompt attention split over the ranks
        samples = state.sample(**SAMPLE, generator=torch.Generator().manual_seed(7))
        # what the state's tensors keep alive, not just what their views show
        storage = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for layer in state.layers
                   for t in layer.tensors()}
        result[arch, p, use_lora] = dict(rounds=rounds, refused=refused, nbytes=state.nbytes, storage=sum(storage.values()),
                               slice=state.slice, sliced=state.sliced_nbytes, replicated=state.replicated_nbytes,
                               t_capture=t_capture, samples=(samples.tokens, samples.logprobs, samples.truncated),
                               mixed=mixed[0] if mixers else None,
                               # (a mixture of experts' experts see each position once per expert it picks)
                               fed=fed[0] / getattr(model.config, "num_experts_per_tok", 1))
        state.release()

    # exact mode: each rank replays its branch, then the collective reverse pass over the slices
    for arch, p, use_lora, round_ in exact_cases:  # round 0, or the batched round (each row's suffix in its forward)
        model = lora(tiny_model(arch)) if use_lora else tiny_model(arch)
        params = [q for q in model.parameters() if q.requires_grad]
        state = longstraw.capture(model, _prompt(p, arch=arch, n=n), chunk_size=4, block_size=4, prompt_grad="exact",
                                  group=dist.group.WORLD)
        logprobs, replays = _replay_round(state, rank, n, round_)
        state.backward()
        grads = [q.grad.clone() if q.grad is not None else torch.zeros_like(q) for q in params]
        for g in grads:
            dist.all_reduce(g)
        result["exact", arch, p, use_lora, round_] = dict(logprobs=logprobs, grads=grads, replays=replays)
        state.release()

    model = tiny_model(ARCH)
    if n == 1:  # nothing can differ between the ranks of a group of one
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
        return

    # refused on every rank with the same message: a different prompt on rank 1, a different chunk size on rank 0
    errors = {}
    for what, kwargs in (("prompt", dict(prompt_ids=_prompt(12, rank, differ=True), chunk_size=4)),
                         ("chunk_size", dict(prompt_ids=_prompt(12), chunk_size=4 + (rank == 0)))):
        try:
            longstraw.capture(model, group=dist.group.WORLD, **kwargs)
            errors[what] = None
        except MismatchError as err:
            errors[what] = str(err)
    # an invalid response on one rank: every rank refuses the replay
    state = longstraw.capture(model, _prompt(12), chunk_size=4, group=dist.group.WORLD)
    try:  # generators seeded differently would sample different tokens: refused before decoding
        state.sample(num=2, max_new_tokens=2, generator=torch.Generator().manual_seed(rank))
        errors["generator"] = None
    except MismatchError as err:
        errors["generator"] = str(err)
    try:
        state.replay(torch.tensor([1, 2, 999]) if rank == n - 1 else torch.tensor([1, 2, 3]))
        errors["response"] = None
    except ValueError as err:
        errors["response"] = str(err)
    result["errors"] = errors

    if check_timeout:  # rank 1 never arrives: rank 0 raises after the group's timeout, naming the collective
        short = dist.new_group(list(range(n)), timeout=datetime.timedelta(seconds=2))
        if rank == 0:
            t0 = time.perf_counter()
            try:
                longstraw.capture(model, _prompt(12), chunk_size=4, group=short)
                result["timeout"] = None
            except CollectiveError as err:
                result["timeout"] = (str(err), time.perf_counter() - t0)
        dist.barrier()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _run(n: int, tmp_path, cases, check_timeout=False, exact_cases=()) -> list[dict]:
    spawn_ranks(_worker, (n, str(tmp_path / "init"), str(tmp_path), tuple(cases), check_timeout, tuple(exact_cases)), n,
                ["torch", "torch.distributed", "longstraw", "longstraw.distributed", "longstraw.testing.models",
                 "transformers.models.llama.modeling_llama", "transformers.models.gemma3.modeling_gemma3",
                 "transformers.models.qwen3_next.modeling_qwen3_next",
                 "transformers.models.deepseek_v3.modeling_deepseek_v3",
                 "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa",
                 "transformers.models.gpt_oss.modeling_gpt_oss"], 3 * TIMEOUT_S, "their cases")
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(n)]


def _reference(arch: str, p: int, n: int, use_lora: bool, chunk: int = 4, block: int = 4):
    """Single-process capture of the same prompt; per round, every rank's replay log-probs and the gradient summed over
    the n branches; the state's bytes, and those of its layers whose state grows with P (full attention)."""
    from longstraw.kinds import IndexedLatentState, KVState, LatentState

    model = longstraw.testing.models.tiny_model(arch)
    model = lora(model) if use_lora else model
    params = [q for q in model.parameters() if q.requires_grad]
    state = longstraw.capture(model, _prompt(p, arch=arch, n=n), chunk_size=chunk, block_size=block)
    rounds = []
    for round_ in range(ROUNDS):
        model.zero_grad(set_to_none=True)
        logprobs = _replay_branches(state, n, round_)
        # parameters no branch reaches (the DSA indexer runs without grad, experts no token routes to): zero
        rounds.append(dict(logprobs=logprobs, grads=[q.grad.clone() if q.grad is not None else torch.zeros_like(q)
                                                     for q in params]))
    growing = sum(layer.nbytes for layer in state.layers if type(layer) in (KVState, LatentState, IndexedLatentState))
    samples = state.sample(**SAMPLE, generator=torch.Generator().manual_seed(7))
    return rounds, state.nbytes, growing, samples


def _replay_branches(state, n: int, round_: int = 0) -> list[torch.Tensor]:
    """One process: replay every rank's responses of a round one at a time, each with its advantage-weighted backward;
    per rank, their log-probs concatenated."""
    logprobs = []
    for r in range(n):
        mine = []
        for response, advantage in _responses(r, n, round_):
            out = state.replay(response, prefix_ids=_prefix(round_))
            (advantage * out.logprobs).sum().backward()
            mine.append(out.logprobs.detach())
        logprobs.append(torch.cat(mine))
    return logprobs


def _exact_reference(arch: str, p: int, n: int, use_lora: bool, round_: int = 0, chunk: int = 4, block: int = 4):
    """Single-process exact mode over the same branches, one at a time: every rank's replay log-probs, the summed
    gradient."""
    model = longstraw.testing.models.tiny_model(arch)
    model = lora(model) if use_lora else model
    params = [q for q in model.parameters() if q.requires_grad]
    state = longstraw.capture(model, _prompt(p, arch=arch, n=n), chunk_size=chunk, block_size=block,
                              prompt_grad="exact")
    logprobs = _replay_branches(state, n, round_)
    state.backward()
    return dict(logprobs=logprobs, grads=[q.grad if q.grad is not None else torch.zeros_like(q) for q in params])


def float32_floor(model, prompt: torch.Tensor, branches: list, exact: bool = False) -> dict:
    """The model's own float32 rounding over `branches` ((suffix or None, response, advantage) after `prompt`),
    measured on transformers, not on longstraw: its reference (the detached mode's cache reference, the suffix
    prefilled with the prompt; or exact mode's full-sequence forward) in float32 against the same reference of a float64
    copy, for the log-probs (absolute), each trainable parameter's gradient summed over the branches (absolute norm, in
    `model.parameters()` order) and the summed gradient (relative). Each is capped at the float32 bound (log-probs at
    `FP32_LOGPROB_TOL`, each parameter at `FP32_GRAD_TOL` relative with the parameters below 1e-3 of the largest norm
    held at that scale, as tests/test_equivalence.py holds one process), so a model whose float32 is far from its
    float64 cannot widen the bound the ranks are held to beyond what the one-process test allows."""
    from longstraw.model.oracles import cache_reference_logprobs, full_sequence_logprobs

    def run(model) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        params = [q for q in model.parameters() if q.requires_grad]
        dtype = params[0].dtype
        sums = [torch.zeros_like(q) for q in params]
        logprobs = []
        for suffix, response, advantage in branches:
            with torch.autograd.graph.allow_mutation_on_saved_tensors():
                if exact:  # the suffix differentiated with the response, as exact mode's replay reads it
                    lp = full_sequence_logprobs(model, prompt if suffix is None else torch.cat([prompt, suffix]),
                                                response)
                else:
                    lp = cache_reference_logprobs(model, prompt if suffix is None else torch.cat([prompt, suffix]),
                                                  response)
                grads = torch.autograd.grad((advantage.to(dtype) * lp).sum(), params, allow_unused=True)
            sums = [s if g is None else s + g for s, g in zip(sums, grads)]
            logprobs.append(lp.detach())
        return logprobs, sums

    model64 = copy.deepcopy(model).double()
    model64.set_experts_implementation("eager")  # grouped_mm (the default) has no float64 kernel
    lp32, g32 = run(model)
    lp64, g64 = run(model64)
    lp_floor = max((a.double() - b).abs().max().item() for a, b in zip(lp32, lp64))
    scale = max(b.norm().item() for b in g64)
    grads = [min((a.double() - b).norm().item(), FP32_GRAD_TOL * max(b.norm().item(), 1e-3 * scale))
             for a, b in zip(g32, g64)]
    whole = sum(f * f for f in grads) ** 0.5 / sum(b.norm().item() ** 2 for b in g64) ** 0.5
    return dict(logprobs=min(lp_floor, FP32_LOGPROB_TOL), grads=grads, whole=whole)


def _floors(arch: str, p: int, n: int, use_lora: bool, round_: int = 0, exact: bool = False) -> dict:
    """`float32_floor` of one round's n branches (the ranks' responses after the prompt and the round's suffix)."""
    model = longstraw.testing.models.tiny_model(arch)
    model = lora(model) if use_lora else model
    branches = [(_prefix(round_), response, advantage) for r in range(n) for response, advantage in
                _responses(r, n, round_)]
    return float32_floor(model, _prompt(p, arch=arch, n=n), branches, exact)


def planted_index(arch: str, use_lora: bool, want: list) -> int:
    """Which trainable parameter a planted error goes into: a small one (an SSM's `A_log`, else a norm weight, else,
    with LoRA, an adapter matrix) whose gradient in `want` carries signal (at least 1e-3 of the largest norm: below,
    the bound holds a parameter at that scale), as `model.parameters()` orders them."""
    model = longstraw.testing.models.tiny_model(arch)
    model = lora(model) if use_lora else model
    names = [name for name, q in model.named_parameters() if q.requires_grad]
    scale = max(g.norm().item() for g in want)
    live = [i for i, g in enumerate(want) if g.norm().item() >= 1e-3 * scale]
    for key in ("A_log", "norm", "lora_"):
        hits = [i for i in live if key in names[i]]
        if hits:
            return hits[0]
    raise AssertionError(f"{arch}: no small parameter with a gradient to plant an error in")


def assert_plant_refused(got: list, want: list, floor: dict, index: int, what: str) -> None:
    """The bound `_assert_grads_within_floor` holds refuses `got` with a 1e-4 relative error planted in parameter
    `index`'s gradient (a bound that cannot see it would let a bug confined to a small parameter through)."""
    planted = [g * (1 + 1e-4) if i == index else g for i, g in enumerate(got)]
    with pytest.raises(AssertionError):
        _assert_grads_within_floor(planted, want, floor, what)


def _logprob_tol(floor: dict, want: torch.Tensor) -> float:
    """N ranks vs one process, log-probs, absolute: `FLOOR_FACTOR` × the model's float32 floor (`_floors`: the ranks
    regroup the same float32 sums, whose rounding is of that size), + one float32 rounding of the log-prob itself."""
    return FLOOR_FACTOR * floor["logprobs"] + EPS32 * want.abs().max().item()


def _assert_grads_within_floor(got: list, want: list, floor: dict, what: str) -> float:
    """Each parameter's summed gradient within `FLOOR_FACTOR` × its float32 floor (`_floors`) + `GRAD_TOL` (the
    all-reduce: the same sum of the branches in another order) relative, a parameter below 1e-3 of the largest norm
    held at that scale instead (`conftest.assert_grads_close`: its gradient is what is left of cancelling terms of the
    others' size, and longstraw's chunked scans cancel them in another order than transformers' one pass); the
    concatenation likewise, relative. Its relative error."""
    scale = max(b.norm().item() for b in want)
    for i, (a, b, f) in enumerate(zip(got, want, floor["grads"])):
        err = (a - b).norm().item()
        bound = FLOOR_FACTOR * f + GRAD_TOL * max(b.norm().item(), 1e-3 * scale)
        assert err <= bound, f"{what}: parameter {i} off by {err:.2e} (norm {b.norm().item():.2e}), bound {bound:.2e}"
    err = rel_err(torch.cat([a.flatten() for a in got]), torch.cat([b.flatten() for b in want]))
    assert err <= FLOOR_FACTOR * floor["whole"] + GRAD_TOL, f"{what}: summed gradient off by {err:.2e} relative"
    return err


def _replays_run(arch: str, round_: int) -> int:
    """The collective replays a rank runs in a round: the batched round's two responses in one batch, except where
    DSA layers replay one response per rank (`ContextParallelState.batches_replays`)."""
    return 2 if round_ == BATCHED and arch in SPARSE else 1


def _check_exact(results, n: int, cases, measured: dict):
    """Exact mode: the parameter gradients summed over the ranks equal one process's exact-mode gradient over the same
    branches replayed one at a time (which tests/test_exact.py holds equal to naive full-sequence GRPO), within the
    model's float32 floor; the batched round's responses replayed together on every rank."""
    for arch, p, use_lora, round_ in cases:
        want = _exact_reference(arch, p, n, use_lora, round_)
        floor = _floors(arch, p, n, use_lora, round_, exact=True)
        worst = 0.0
        for r in range(n):
            got = results[r]["exact", arch, p, use_lora, round_]
            assert got["replays"] == _replays_run(arch, round_), (arch, round_, got["replays"])
            err = (got["logprobs"] - want["logprobs"][r]).abs().max().item()
            assert err <= _logprob_tol(floor, want["logprobs"][r]), f"exact {arch} N={n} P={p} rank {r}: {err:.2e}"
            err = _assert_grads_within_floor(got["grads"], want["grads"], floor, f"exact {arch} N={n} P={p} rank {r}")
            worst = max(worst, err)
        assert_plant_refused(results[0]["exact", arch, p, use_lora, round_]["grads"], want["grads"], floor,
                             planted_index(arch, use_lora, want["grads"]), f"exact {arch}")
        measured[("exact", arch, n, p, use_lora, round_)] = dict(grad_rel_err=worst, grad_floor=floor["whole"])


def _check(results, n: int, cases, measured: dict):
    for arch, p, use_lora in cases:
        ref, ref_bytes, ref_growing, ref_samples = _reference(arch, p, n, use_lora)
        floors = [_floors(arch, p, n, use_lora, round_) for round_ in range(len(ref))]
        bounds = slice_bounds(p - 1, n)
        worst_lp = worst_g = 0.0
        for round_, (want, floor) in enumerate(zip(ref, floors)):
            for r in range(n):
                got = results[r][arch, p, use_lora]["rounds"][round_]
                assert got["replays"] == _replays_run(arch, round_), (arch, round_, got["replays"])
                assert got["logprobs"].shape == want["logprobs"][r].shape
                err = (got["logprobs"] - want["logprobs"][r]).abs().max().item()
                worst_lp = max(worst_lp, err)
                assert err <= _logprob_tol(floor, want["logprobs"][r]), \
                    f"{arch} N={n} P={p} rank {r} round {round_}: log-probs off by {err:.2e}"
            # detached gradients summed over the ranks = the single-process sum over the same branches
            for r in range(n):
                got = results[r][arch, p, use_lora]["rounds"][round_]["grads"]
                err = _assert_grads_within_floor(got, want["grads"], floor, f"{arch} N={n} P={p} rank {r}")
                worst_g = max(worst_g, err)
            assert_plant_refused(results[0][arch, p, use_lora]["rounds"][round_]["grads"], want["grads"], floor,
                                 planted_index(arch, use_lora, want["grads"]), f"{arch} round {round_}")
        for r in range(n):
            refused = results[r][arch, p, use_lora]["refused"]
            assert (refused is not None and "DSA layers" in refused) if arch in SPARSE else refused is None, refused
        # sampling with a fixed generator: the same tokens as one process, on every rank; their log-probs are the
        # model's log-probs from the same state, held to the replays' floor
        for r in range(n):
            tokens, logprobs, truncated = results[r][arch, p, use_lora]["samples"]
            assert [t.tolist() for t in tokens] == [t.tolist() for t in ref_samples.tokens]
            assert torch.equal(truncated, ref_samples.truncated)
            floor = dict(logprobs=max(f["logprobs"] for f in floors))
            err = max((a - b).abs().max().item() for a, b in zip(logprobs, ref_samples.logprobs))
            assert err <= _logprob_tol(floor, torch.cat(ref_samples.logprobs)), \
                f"{arch} N={n} P={p} rank {r}: sampled log-probs off by {err:.2e}"
        # each rank holds its contiguous slice of the full-attention K/V (1/N of it; uneven: ⌈(P−1)/N⌉ tokens) and
        # the O(1) states (sliding windows, linear-attention states) every rank reads alike
        res = [results[r][arch, p, use_lora] for r in range(n)]
        # linear-attention layers ran chunk_size (4) positions at a time, not the whole slice
        assert all(x["mixed"] in (None, min(4, e - s)) for x, (s, e) in zip(res, bounds)), [x["mixed"] for x in res]
        assert all(0 < x["fed"] <= min(4, e - s) for x, (s, e) in zip(res, bounds)), (arch, [x["fed"] for x in res])
        per_rank = [x["nbytes"] for x in res]
        assert per_rank == [x["storage"] for x in res]
        assert sum(x["sliced"] for x in res) == ref_growing
        for r in range(n):
            s, e = bounds[r]
            assert res[r]["slice"] == (s, e)
            assert res[r]["sliced"] == ref_growing * (e - s) // (p - 1)
            assert res[r]["replicated"] == ref_bytes - ref_growing
            assert per_rank[r] <= ref_growing * -(-(p - 1) // n) / (p - 1) + (ref_bytes - ref_growing)
        measured[(arch, n, p, use_lora)] = dict(logprob_err=worst_lp, grad_rel_err=worst_g,
                                                grad_floor=max(f["whole"] for f in floors), bytes_single=ref_bytes,
                                      bytes_per_rank=per_rank, replicated=res[0]["replicated"],
                                      early_stops=int((~ref_samples.truncated).sum()))
    # sequences leaving the decode batch (a stop token) are part of what was compared
    assert sum(m["early_stops"] for m in measured.values()) > 0

    if n == 1:
        return
    errors = [res["errors"] for res in results]
    for what, needle in (("prompt", "prompt_ids"), ("chunk_size", "chunk_size (rank 0: 5, rank 1: 4"),
                         ("generator", "generator state")):
        msgs = {e[what] for e in errors}
        assert len(msgs) == 1 and None not in msgs, f"{what}: not refused alike on every rank: {msgs}"
        assert needle in msgs.pop()
    msgs = {e["response"] for e in errors}
    assert len(msgs) == 1 and None not in msgs
    assert f"rank(s) [{n - 1}]" in msgs.pop()


def test_context_parallel_two_ranks(tmp_path):
    """N = 2: an even (P − 1 = 30) and an uneven (29) prompt, the three layer kinds, LoRA; mismatches refused; a missing
    rank times out by name."""
    cases = (("llama", 31, False), ("llama", 30, True), ("gemma3_text", 30, False), ("qwen3_next", 30, False),
             ("deepseek_v3", 30, False), ("glm_moe_dsa", 30, False), ("gpt_oss", 30, False))
    t0 = time.perf_counter()
    # glm_moe_dsa at P = 10: slices of 5 and 4 in steps of 4 rows, so rank 1 has no rows in the second step; the
    # batched round's two responses per rank with their suffix, together
    exact = (("llama", 30, False, 0), ("deepseek_v3", 30, True, 0), ("qwen3_next", 30, False, 0),
             ("gemma3_text", 30, False, 0), ("glm_moe_dsa", 30, False, 0), ("glm_moe_dsa", 10, False, 0),
             ("llama", 30, False, BATCHED), ("gemma3_text", 30, True, BATCHED), ("qwen3_next", 30, False, BATCHED),
             ("deepseek_v3", 30, False, BATCHED), ("glm_moe_dsa", 30, False, BATCHED))
    results = _run(2, tmp_path, cases, check_timeout=True, exact_cases=exact)
    measured = {}
    _check(results, 2, cases, measured)
    _check_exact(results, 2, exact, measured)
    message, waited = results[0]["timeout"]
    assert "longstraw.capture: argument check" in message and "rank 0 of 2" in message
    assert 1.5 <= waited <= 20
    print(f"N=2: {measured}; spawn + ranks {time.perf_counter() - t0:.1f} s")


@pytest.mark.slow
def test_context_parallel_four_ranks(tmp_path):
    """N = 4, P − 1 = 29 over 4 ranks (8, 7, 7, 7), and 11 (3, 3, 3, 2: a sliding window of 5 reaches two slices
    back); rank 3 replays the same response as rank 0."""
    cases = (("llama", 30, False), ("llama", 12, False), ("gemma3_text", 12, False), ("qwen3_next", 12, True),
             ("deepseek_v3", 12, True), ("glm_moe_dsa", 12, True), ("gpt_oss", 12, False))
    t0 = time.perf_counter()
    exact = (("llama", 30, True, 0), ("deepseek_v3", 12, False, 0), ("qwen3_next", 12, True, 0),
             ("gemma3_text", 12, False, 0), ("glm_moe_dsa", 12, True, 0), ("gemma3_text", 12, False, BATCHED))
    results = _run(4, tmp_path, cases, exact_cases=exact)
    measured = {}
    _check(results, 4, cases, measured)
    _check_exact(results, 4, exact, measured)
    print(f"N=4: {measured}; spawn + ranks {time.perf_counter() - t0:.1f} s")


def test_context_parallel_group_of_one(tmp_path):
    """A group of one process: the whole prompt on one rank, every exchange with itself."""
    cases = (("llama", 12, False), ("qwen3_next", 12, False))
    exact = (("llama", 12, False, 0), ("llama", 12, False, BATCHED))
    results = _run(1, tmp_path, cases, exact_cases=exact)
    measured = {}
    _check(results, 1, cases, measured)
    _check_exact(results, 1, exact, measured)


def test_slice_bounds():
    assert slice_bounds(29, 4) == [(0, 8), (8, 15), (15, 22), (22, 29)]
    assert slice_bounds(30, 2) == [(0, 15), (15, 30)]
    assert slice_bounds(5, 5) == [(i, i + 1) for i in range(5)]


def test_group_needs_initialized_distributed():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    model = longstraw.testing.models.tiny_model(ARCH)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        longstraw.capture(model, tokens(8, 0), group=object())


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sparse_selection_is_the_same_for_any_number_of_slices(n):
    """DSA selection over keys with exact ties (every key appears 3 times): each slice's local top-k merged in slice
    order gives the positions the whole key list sorted by (score descending, position ascending) gives, for any N."""
    from longstraw.distributed.context_parallel.sparse_attention import local_topk, merge_topk
    from longstraw.ops.latent_attention import index_scores

    g = torch.Generator().manual_seed(0)
    p, own, s, heads, dim, topk = 27, 5, 6, 4, 8, 7
    keys = torch.randn(1, 9, dim, generator=g).repeat_interleave(3, dim=1)  # 27 prompt keys, ties in threes
    own_keys = torch.randn(1, own, dim, generator=g)
    q = torch.randn(1, s, heads, dim, generator=g)
    w = torch.rand(1, s, heads, generator=g)
    q_pos = torch.arange(p - 1, p - 1 + s)  # query i sees the prompt and the first i own keys
    q_pos[0] = p - 4  # ... the first query only the prompt keys up to p − 4
    scores = index_scores(q, w, torch.cat([keys, own_keys], dim=1), 0.5)[0]
    visible = torch.arange(p + own)[None, :] <= q_pos[:, None]
    want = torch.sort(scores.masked_fill(~visible, float("-inf")), dim=-1, descending=True, stable=True).indices
    want = want[:, :topk]
    bounds = slice_bounds(p, n)
    cands = [local_topk(q, w, 0.5, keys[:, a:b], a, q_pos, topk, block=2) for a, b in bounds]
    cands.append(local_topk(q, w, 0.5, own_keys, p, q_pos, topk, block=2))
    _, got = merge_topk(cands, topk)
    assert torch.equal(got[0], want)


#: (arch, P, state_dtype): P − 1 = 300 positions over 2 ranks in whole 64-position blocks: 192 and 108 (64 + a tail
#: of 44 kept in the model's dtype, as one process keeps its last 44)
QUANT_CASES = (("llama", 301, "fp8"), ("deepseek_v3", 301, "int8"), ("glm_moe_dsa", 301, "fp8"))
#: the ranks' 8-bit error against one process's, as a ratio: both are the same quantizer's rounding of the same values
#: (the ranks quantize each slice once, without the error one process's chunks add by reading the earlier chunks'
#: 8-bit state: measured ratios 0.37–0.99); 1.5 is tests/test_bf16.py's `BOUND` for two samples of one rounding
#: (1 + 3.3σ of the ratio of two such errors)
QUANT_BOUND = 1.5


def _quant_worker(rank: int, n: int, init: str, out_dir: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    from longstraw.testing.models import tiny_model

    result = {}
    for arch, p, dtype in QUANT_CASES:
        model = tiny_model(arch)
        state = longstraw.capture(model, _prompt(p, arch=arch, n=n), chunk_size=64, block_size=32, state_dtype=dtype,
                                  group=dist.group.WORLD)
        response = _response(rank, n, 0)
        out = state.replay(response)
        (_advantage(rank, response.numel()) * out.logprobs).sum().backward()
        grads = [q.grad.clone() if q.grad is not None else torch.zeros_like(q) for q in model.parameters()]
        for g in grads:
            dist.all_reduce(g)
        samples = state.sample(**SAMPLE, generator=torch.Generator().manual_seed(7))
        result[arch] = dict(logprobs=out.logprobs.detach(), grads=grads, sliced=state.sliced_nbytes, slice=state.slice,
                            samples=[t.tolist() for t in samples.tokens])
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_context_parallel_8bit_state(tmp_path):
    """`state_dtype` with `group=`: each rank keeps its slice in 8 bits (whole 64-position blocks, so the ranks' 8-bit
    bytes add up to one process's). Not bitwise one process's: its later chunks read the earlier ones' 8-bit state,
    while the ranks read each other's slices in full precision during capture and quantize their own once. So: the
    replay log-probs' and the summed detached gradients' error against the full-precision state is at most
    `QUANT_BOUND` × one process's with the same 8-bit state (dense K/V, MLA latents, DSA latents), and every rank
    samples alike."""
    from longstraw.kinds import IndexedLatentState, KVState, LatentState

    n = 2
    spawn_ranks(_quant_worker, (n, str(tmp_path / "init"), str(tmp_path)), n,
                ["torch", "torch.distributed", "longstraw", "longstraw.distributed", "longstraw.testing.models"], 3 * TIMEOUT_S,
                "the 8-bit cases")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(n)]
    for arch, p, dtype in QUANT_CASES:
        model = longstraw.testing.models.tiny_model(arch)
        prompt = _prompt(p, arch=arch, n=n)
        grads = {}
        for name, kw in (("8-bit", dict(state_dtype=dtype)), ("full", {})):
            model.zero_grad(set_to_none=True)
            state = longstraw.capture(model, prompt, chunk_size=64, block_size=32, **kw)
            logprobs = _replay_branches(state, n)
            grads[name] = (logprobs, torch.cat([q.grad.flatten() if q.grad is not None else torch.zeros(q.numel())
                                                for q in model.parameters()]))
            if name == "8-bit":
                growing = sum(layer.nbytes for layer in state.layers
                              if type(layer) in (KVState, LatentState, IndexedLatentState))
        (one_lp, one_g), (full_lp, full_g) = grads["8-bit"], grads["full"]
        assert [results[r][arch]["slice"] for r in range(n)] == [(0, 192), (192, 300)]
        assert sum(results[r][arch]["sliced"] for r in range(n)) == growing
        assert results[0][arch]["samples"] == results[1][arch]["samples"]
        for r in range(n):
            got = results[r][arch]
            cp_err = (got["logprobs"] - full_lp[r]).abs().max().item()
            one_err = (one_lp[r] - full_lp[r]).abs().max().item()
            assert 0 < cp_err <= QUANT_BOUND * one_err, f"{arch} {dtype} rank {r}: log-probs off by {cp_err:.2e} " \
                                                f"(one process: {one_err:.2e})"
            cp_g = rel_err(torch.cat([a.flatten() for a in got["grads"]]), full_g)
            assert 0 < cp_g <= QUANT_BOUND * rel_err(one_g, full_g), f"{arch} {dtype}: gradient off by {cp_g:.2e}"


def test_slice_bounds_in_whole_blocks():
    assert slice_bounds(300, 2, 64) == [(0, 192), (192, 300)]
    assert slice_bounds(256, 2, 64) == [(0, 128), (128, 256)]
    assert slice_bounds(257, 4, 64) == [(0, 128), (128, 192), (192, 256), (256, 257)]
