import os
import signal

import pytest
import torch

from longstraw.testing.models import TINY_CONFIGS, TINY_MULTIMODAL, tiny_model

ARCHS = list(TINY_CONFIGS) + list(TINY_MULTIMODAL)


#: the files whose numbers depend on how the CPU's kernels round (sums, softmaxes, matrix products): marked
#: `numerics`, run a second time by `.ci/run` with AVX2 kernels (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
#: MKL_ENABLE_INSTRUCTIONS=AVX2 LONGSTRAW_NATIVE_ARCH=x86-64-v3`, MKL's vendor check preloaded off Intel CPUs), as on
#: a machine without AVX-512
NUMERICS = {"test_equivalence", "test_exact", "test_bf16", "test_distributed", "test_distributed_trainer", "test_fsdp",
            "test_fsdp_trainer", "test_kernels", "test_native_kernel", "test_attention", "test_latent_attention",
            "test_compressed_attention", "test_quant", "test_shared_prefix", "test_shared_prefix_step",
            "test_ssm", "test_logprobs", "test_segments", "test_agent", "test_layer_major", "test_batched"}
#: files whose tests start several processes (gloo process groups, torchrun): `multiprocess`
MULTIPROCESS = {"test_distributed", "test_distributed_trainer", "test_fsdp", "test_fsdp_trainer"}


def pytest_collection_modifyitems(config, items):
    """Tests in `NUMERICS` files get the `numerics` marker, those in `MULTIPROCESS` files `multiprocess`. Tests marked
    `cuda` skip on machines without a CUDA device (CI); `bench/gpu.sh` runs them on one."""
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in NUMERICS:
            item.add_marker(pytest.mark.numerics)
        if item.module.__name__.rsplit(".", 1)[-1] in MULTIPROCESS:
            item.add_marker(pytest.mark.multiprocess)
    if torch.cuda.is_available() or os.environ.get("LONGSTRAW_TEST_DEVICE"):
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _real(name: str):
    """The real model's folder. Missing, the test skips on a developer's machine, but fails under CI (`CI` set, as
    `.ci/run` runs): CI installs both real models, so a missing one means the real-model tests would pass unrun."""
    from longstraw.tools.real_models import installed

    path = installed(name)
    if path is None:
        message = f"the real model is not installed: run `longstraw real {name}` once"
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail(f"{message} (CI installs it: a real-model test must not skip there)", pytrace=False)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def real_smollm2():
    """The folder of the project's real model, SmolLM2-135M-Instruct (`longstraw.tools.real_models`), when it is in the
    cache (`longstraw real smollm2` puts it there; `.ci/run` does); the tests marked `real` skip without it, and fail
    without it under CI."""
    return _real("smollm2")


@pytest.fixture(scope="session")
def real_gemma3():
    """The folder of Gemma 3 270M (`longstraw real gemma3`), the real sliding-window model; skips without it (fails
    under CI)."""
    return _real("gemma3")


@pytest.fixture(autouse=True)
def _process_state():
    """Each test leaves the process as it found it, so that the suite passes in any order: a SIGINT or SIGTERM
    handler or torch's default dtype left changed fails the test that changed it; these, the environment and torch's
    thread count (which the trainer sets from `threads`) are put back for the tests after it. Set up before the
    other autouse fixtures, so checked after `monkeypatch` has undone its own changes."""
    signals = (signal.SIGINT, signal.SIGTERM)
    handlers = {s: signal.getsignal(s) for s in signals}
    threads, dtype, env = torch.get_num_threads(), torch.get_default_dtype(), dict(os.environ)
    yield
    changed = [signal.Signals(s).name + " handler" for s in signals if signal.getsignal(s) != handlers[s]]
    if torch.get_default_dtype() != dtype:
        changed.append(f"torch's default dtype ({torch.get_default_dtype()}, was {dtype})")
    for s, handler in handlers.items():
        if handler is not None:  # None: set outside Python, not restorable from here
            signal.signal(s, handler)
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)
    for key in set(os.environ) | set(env):
        if key != "PYTEST_CURRENT_TEST" and os.environ.get(key) != env.get(key):  # pytest's own, per phase
            if key in env:
                os.environ[key] = env[key]
            else:
                del os.environ[key]
    if changed:
        pytest.fail(f"the test left the process changed: {', '.join(changed)}; restore it in the test", pytrace=False)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _nan_poisoned_state(monkeypatch):
    """Fresh durable-state buffers start as NaN: a slot capture never writes makes replays NaN, not plausible."""
    from longstraw.kinds import base

    monkeypatch.setattr(base, "empty_state", lambda like, shape: like.new_full(shape, float("nan")))


def lora(model, seed: int = 0):
    """Wrap in a PEFT LoRA adapter with non-zero B (so adapter gradients are informative). MoE routers stay
    unwrapped: Llama 4's router is an `nn.Linear` that returns a tuple, which PEFT 0.21's LoRA layer rejects."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    names = [name for name, _ in model.named_modules()]
    exclude = [r".*router"] if any(name.endswith("router") for name in names) else []
    if model.config.model_type in ("falcon_h1", "nemotron_h"):  # PEFT 0.21 refuses LoRA on their Mamba out_proj
        exclude.append(r".*out_proj")
    if any(name.endswith("o_a_proj") for name in names):
        # DeepSeek-V4's grouped output projection subclasses nn.Linear but multiplies block-diagonally (5.24,
        # `DeepseekV4GroupedLinear`): PEFT 0.21 would wrap it as a plain Linear and break the model itself
        exclude.append(r".*o_a_proj")
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False,
                                            exclude_modules="|".join(exclude) or None))


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
    carries rounding noise there: its error is the rounding of the terms that cancelled, which are of the size
    of the other gradients, so it is held to `tol` × floor × the largest norm (an absolute bound at the scale of
    the gradient) instead.
    """
    pairs = [(a, b) for a, b in zip(got, want) if b is not None]
    assert all(a is not None for a, _ in pairs)
    scale = max(b.norm().item() for _, b in pairs)
    for a, b in pairs:
        assert (a - b).norm().item() <= tol * max(b.norm().item(), floor * scale)
    assert rel_err(torch.cat([a.flatten() for a, _ in pairs]), torch.cat([b.flatten() for _, b in pairs])) <= tol


def _indexer_calls(model, layers, ids: torch.Tensor, indexer_of) -> list:
    """(decoder layer, indexer module, its positional inputs) of every indexer call in one full-sequence forward
    over `ids`; `indexer_of(layer)` finds a layer's indexer (or None)."""
    seen, handles = [], []
    for block in layers:
        indexer = indexer_of(block)
        if indexer is not None:
            handles.append(indexer.register_forward_hook(
                lambda mod, args, out, block=block: seen.append((block, mod, args))))
    try:
        with torch.no_grad():
            model(input_ids=ids[None])
    finally:
        for h in handles:
            h.remove()
    assert seen
    return seen


def assert_tie_free(model, ids: torch.Tensor, margin: float = 1e-4) -> int:
    """DSA models: run the full-sequence forward, recompute every indexer's scores from its inputs and check the
    top-k boundary has a gap (tests/kinds/test_latent_attention.py says why); returns how many queries had more
    visible keys than top-k. Other models: 0, nothing to check.

    The gap must exceed `margin` relative (+ 1e-7 absolute): longstraw's and the reference's index scores differ
    by float32 rounding of sums over the index head dim (eps 1.19e-7 × at most 2^8 here = 3e-5 relative), and the
    absolute floor covers scores that are themselves about 0; a pair closer than that could rank either way on
    another machine."""
    import longstraw
    from longstraw.archs import family
    from longstraw.kinds.latent_attention import indexer_inputs
    from longstraw.ops.latent_attention import index_scores

    base = longstraw.hf.parts.base_model(model)
    layers = longstraw.hf.parts.decoder_of(base).layers
    if any(getattr(getattr(getattr(b, "self_attn", None), "compressor", None), "indexer", None) is not None
           for b in layers):
        return _assert_compressed_tie_free(model, layers, ids, margin)
    if not any(getattr(getattr(b, "self_attn", None), "indexer", None) is not None for b in layers):
        return 0
    seen = _indexer_calls(model, layers, ids, lambda block: getattr(block.self_attn, "indexer", None))
    sparse = 0
    for block, indexer, args in seen:
        rotary = family(base.config.model_type).latent_rotary(block.self_attn)[1]
        q, k, w = indexer_inputs(indexer, args[0], args[1], args[2], rotary)
        scores = index_scores(q, w, k, indexer.softmax_scale)[0]
        for i in range(scores.shape[0]):
            v = scores[i, : i + 1].sort(descending=True).values
            if v.numel() > indexer.index_topk:
                sparse += 1
                kth, nxt = v[indexer.index_topk - 1], v[indexer.index_topk]
                assert (kth - nxt).item() > margin * kth.abs().item() + 1e-7, f"tie at query {i}"
    return sparse


def _assert_compressed_tie_free(model, layers, ids, margin: float) -> int:
    """DeepSeek-V4 CSA: the same top-k gap check over the indexer's compressed entries (a query at t sees the
    entries whose window closed by t), on the scores recomputed from each indexer's inputs."""
    from longstraw.kinds.compressed_attention import full_indexer_scores

    seen = _indexer_calls(model, layers, ids,
                          lambda block: getattr(getattr(block.self_attn, "compressor", None), "indexer", None))
    sparse = 0
    for _, indexer, args in seen:
        scores = full_indexer_scores(indexer, args[0], args[1])[0]
        for i in range(scores.shape[0]):
            v = scores[i][scores[i] > float("-inf")].sort(descending=True).values
            if v.numel() > indexer.index_topk:
                sparse += 1
                kth, nxt = v[indexer.index_topk - 1], v[indexer.index_topk]
                assert (kth - nxt).item() > margin * kth.abs().item() + 1e-7, f"tie at query {i}"
    return sparse


def spawn_ranks(worker, args: tuple, n: int, preload: list[str], timeout_s: float, what: str) -> None:
    """Run `worker(rank, *args)` in `n` processes and wait for them; any rank still running after `timeout_s` is
    killed and the test fails (a hung collective never hangs CI). The ranks come from a forkserver that imported
    `preload` once, so starting one costs a fork."""
    import multiprocessing
    import time

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(preload)
    ctx = mp.start_processes(worker, args=args, nprocs=n, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"{n} ranks did not finish {what} within {timeout_s} s")


def full_and_resumed(make_trainer, stop_after: int = 2):
    """(uninterrupted trainer, resumed trainer): `make_trainer(name)` builds a Trainer writing to its own folder per
    name; the "part" run is interrupted after step `stop_after`, then a fresh trainer resumes it to the end."""
    full = make_trainer("full")
    full.train()

    class Stop(Exception):
        pass

    def stop(m):
        if m["step"] == stop_after:
            raise Stop

    with pytest.raises(Stop):
        make_trainer("part").train(on_step=stop)
    resumed = make_trainer("part")
    resumed.train()
    return full, resumed


def tie_free_tokens(model, p: int, r: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt, response) of lengths p, r from `seed`, or for DSA models from the first of the next seeds whose
    full sequence has no top-k near-tie (`assert_tie_free`); on the model's device."""
    device = next(model.parameters()).device
    for s in range(seed, seed + 20):
        prompt, response = tokens(p, s).to(device), tokens(r, s + 1000).to(device)
        try:
            assert_tie_free(model, torch.cat([prompt, response]))
        except AssertionError:
            continue
        return prompt, response
    raise AssertionError("no tie-free tokens in 20 seeds")
