"""Rollouts from a vLLM server (`rollout_backend: vllm`): token ids in, token ids and the sampler's log-probs out.

The server is vLLM's OpenAI-compatible one (`longstraw vllm-serve`, `longstraw.train.vllm_server`), on localhost. A
request sends the prompt as **token ids** (never text: what the trainer replays is exactly what vLLM read), `n` = G,
the run's temperature, top-p, top-k, stop token, `max_tokens`, `allowed_token_ids` and a seed, and reads back each
sample's token ids (`return_token_ids`) and the log-probs of the distribution vLLM sampled from (the server runs with
`--logprobs-mode processed_logprobs`). With LoRA the requests name the adapter the trainer last loaded
(`sync_adapter`: saved atomically, hot-loaded by `/v1/load_lora_adapter`, the previous one unloaded). With full
fine-tuning the weights are saved atomically as a safetensors checkpoint and reloaded in place (`sync_weights`: vLLM
0.32's `reload_weights` through `/collective_rpc`, then `/reset_prefix_cache`: cached prompts were computed by the old
weights); the server runs with its development endpoints on (`longstraw.train.vllm_server.start`).

A server that is not there, dies, or does not answer within `timeout_s` is an error naming its URL, never a hang.

`VLLMSampler` stands where the rollout's `TurnSampler` stands for a single-turn row (`sample(num, max_new_tokens,
prefix_ids)`); the responses it gives carry the sampler's log-probs apart (`Response.sampler_logprobs`), and the
trainer's own old log-probs come from the first replay of the update (`longstraw.train.update`).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..sampler import Samples


class VLLMError(RuntimeError):
    """The vLLM server is unreachable, failed a request, or answered something the backend cannot use."""


class VLLMClient:
    """HTTP client of one vLLM server at `url` (e.g. "http://127.0.0.1:8000"), serving the base model as `model`."""

    def __init__(self, url: str, model: str = "policy", timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        #: the adapter requests name (None: the base model)
        self.adapter: str | None = None
        self.sync_seconds: list[float] = []
        #: this client's adapters' prefix on the server (several runs may share one server)
        self._tag = f"lora-{uuid.uuid4().hex[:8]}"

    # ------------------------------------------------------------------ transport
    def _post(self, path: str, body: dict, expect_json: bool = True):
        data = json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            raise VLLMError(f"the vLLM server at {self.url} refused {path} (HTTP {err.code}): {detail}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
            raise VLLMError(
                f"the vLLM server at {self.url} did not answer {path} ({err}); start it with "
                f"`longstraw vllm-serve MODEL` or check `vllm_url`"
            ) from None
        return json.loads(raw) if expect_json else raw.decode(errors="replace")

    def health(self) -> None:
        """Raise `VLLMError` unless the server answers `/health`."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=min(self.timeout_s, 10.0)) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
            raise VLLMError(f"the vLLM server at {self.url} is not reachable ({err})") from None
        raise VLLMError(f"the vLLM server at {self.url} is not healthy")

    # ------------------------------------------------------------------ sampling
    def generate(
        self,
        prompt_ids: torch.Tensor,
        n: int,
        max_tokens: int,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_token_ids=(),
        seed: int | None = None,
        allowed_token_ids=None,
    ) -> Samples:
        """`n` samples after `prompt_ids` `[P]`: each one's token ids (its stop token included, as longstraw's own
        sampler returns them) and vLLM's log-probs of them, float32; truncated when it hit `max_tokens`."""
        ids = [int(t) for t in torch.as_tensor(prompt_ids).reshape(-1).tolist()]
        greedy = temperature == 0  # vLLM refuses n > 1 with greedy decoding: one sample, repeated
        body: dict = dict(
            model=self.adapter or self.model,
            prompt=ids,
            n=1 if greedy else n,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k if top_k > 0 else -1,
            logprobs=0,
            return_token_ids=True,
            return_tokens_as_token_ids=True,
            skip_special_tokens=False,
            stop_token_ids=[int(t) for t in stop_token_ids],
            ignore_eos=not stop_token_ids,
        )
        if seed is not None:
            body["seed"] = int(seed)
        if allowed_token_ids is not None:
            body["allowed_token_ids"] = [int(t) for t in allowed_token_ids]
        out = self._post("/v1/completions", body)
        choices = sorted(out.get("choices", []), key=lambda c: c["index"])
        if greedy:
            choices = choices * n
        if len(choices) != n:
            raise VLLMError(f"the vLLM server at {self.url} returned {len(choices)} samples for n={n}")
        tokens, logprobs, truncated = [], [], []
        for c in choices:
            t = c.get("token_ids")
            lp = (c.get("logprobs") or {}).get("token_logprobs")
            if t is None or lp is None or len(t) != len(lp):
                raise VLLMError(
                    f"the vLLM server at {self.url} did not return token ids and their log-probs (vLLM "
                    "≥ 0.10.2 with return_token_ids; the backend is tested on 0.32)"
                )
            tokens.append(torch.tensor(t, dtype=torch.long))
            logprobs.append(torch.tensor([float("nan") if x is None else x for x in lp], dtype=torch.float32))
            truncated.append(c.get("finish_reason") == "length")
        return Samples(tokens=tokens, logprobs=logprobs, truncated=torch.tensor(truncated, dtype=torch.bool))

    # ------------------------------------------------------------------ weights
    def sync_adapter(self, model, folder: str | Path, step: int, state_dict: dict | None = None) -> float:
        """Save `model`'s LoRA adapter (a PEFT model; its tensors from `state_dict` when given: sharded layers
        gathered whole) to `folder`/step-`step` (written beside, then renamed: the server never reads a half-written
        adapter) and hot-load it; the previous one is unloaded. Seconds taken."""
        t0 = time.perf_counter()
        folder = Path(folder)
        extra = {} if state_dict is None else {"state_dict": state_dict}
        final = _written(folder, step, lambda tmp: model.save_pretrained(str(tmp), **extra))
        name = f"{self._tag}-step-{step}"
        self._post("/v1/load_lora_adapter", dict(lora_name=name, lora_path=str(final.resolve())), expect_json=False)
        previous, self.adapter = self.adapter, name
        if previous is not None:
            self._post("/v1/unload_lora_adapter", dict(lora_name=previous), expect_json=False)
            shutil.rmtree(folder / previous.removeprefix(f"{self._tag}-"), ignore_errors=True)
        seconds = time.perf_counter() - t0
        self.sync_seconds.append(seconds)
        return seconds

    def sync_weights(self, model, folder: str | Path, step: int, state_dict: dict | None = None) -> float:
        """Save `model`'s weights (a transformers model, full fine-tuning) to `folder`/step-`step` as safetensors
        (written beside, then renamed; `save_untied`) and reload them into the server in place; its prefix cache is
        then emptied. The previous step's folder is removed. Seconds taken. The server must serve an untied copy of
        a model with tied embeddings (`save_untied`; `longstraw vllm-serve --lora-rank 0` and the trainer's own
        server do)."""
        t0 = time.perf_counter()
        folder = Path(folder)
        final = _written(folder, step, lambda tmp: save_untied(model, tmp, state_dict=state_dict))
        try:
            self._post(
                "/collective_rpc",
                dict(method="reload_weights", kwargs=dict(weights_path=str(final.resolve()))),
                expect_json=False,
            )
        except VLLMError as err:
            if "HTTP 404" in str(err):
                raise VLLMError(
                    f"the vLLM server at {self.url} has no /collective_rpc: full fine-tuning reloads the weights "
                    "through it; start the server with VLLM_SERVER_DEV_MODE=1 (`longstraw vllm-serve MODEL "
                    "--lora-rank 0` does)"
                ) from None
            raise
        self._post("/reset_prefix_cache", {}, expect_json=False)
        for old in folder.glob("step-*"):
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        seconds = time.perf_counter() - t0
        self.sync_seconds.append(seconds)
        return seconds

    def sync(self, model, folder: str | Path, step: int, state_dict: dict | None = None) -> float:
        """The policy as it is now into the server: its LoRA adapter (a PEFT model) or its whole weights
        (`state_dict`: its tensors whole, when its layers are sharded)."""
        if hasattr(model, "peft_config"):
            return self.sync_adapter(model, folder, step, state_dict)
        return self.sync_weights(model, folder, step, state_dict)


def _written(folder: Path, step: int, save) -> Path:
    """`save(tmp)` into a folder beside `folder`/step-`step`, then renamed to it (the server never reads a
    half-written one); returns the final folder."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step-{step}"
    tmp = folder / f".step-{step}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def save_untied(model, folder: str | Path, tokenizer=None, state_dict: dict | None = None) -> None:
    """Save `model` (a transformers model; its tensors from `state_dict` when given) to `folder` as a safetensors
    checkpoint whose tied weights are tensors of their own (the LM head beside the embeddings; `tie_word_embeddings`
    false in the saved config), with `tokenizer` if given. Why: vLLM 0.32 on a CPU packs the LM head's weight for its
    GEMM when it loads it; a reload in place (`reload_weights`) repacks the layers whose weights it reads, and a tied
    head is read as the embedding, so its packed copy stays the old one (measured on SmolLM2: log-probs 0.23 off
    after a change of the embeddings, every other layer's change within 1.4e-5). Served untied, the head is a
    layer of its own, read and repacked."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    tensors = {}
    for name, t in (model.state_dict() if state_dict is None else state_dict).items():
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.detach().clone() if ptr in seen else t.detach().contiguous()
        seen.add(ptr)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    config.save_pretrained(str(folder))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))


class VLLMBranch:
    """One agent trajectory sampled by vLLM: the token ids so far (the row's prompt, then what the trajectory added),
    as `longstraw.Branch` keeps a trajectory's state — `extend(tokens)` appends tool output, `sample(...)` sends the
    whole trajectory (vLLM's prefix cache makes the earlier turns cheap) and keeps the sampled turn. The tokens are the
    ones the trainer replays, so what vLLM read is exactly what the replay reads."""

    def __init__(self, client: VLLMClient, prompt_ids: torch.Tensor):
        self.client = client
        self.ids = [int(t) for t in torch.as_tensor(prompt_ids).reshape(-1).tolist()]
        self.prompt_length = len(self.ids)

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def added(self) -> int:
        return len(self.ids) - self.prompt_length

    def extend(self, tokens) -> None:
        self.ids += [int(t) for t in torch.as_tensor(tokens).reshape(-1).tolist()]

    def sample(
        self,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_token_ids=(),
        generator: torch.Generator | None = None,
        allowed_token_ids=None,
    ) -> Samples:
        """The next turn (one sample), its seed drawn from `generator`; its tokens stay in the branch."""
        seed = None if generator is None else int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        out = self.client.generate(
            torch.tensor(self.ids),
            1,
            max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_token_ids=stop_token_ids,
            seed=seed,
            allowed_token_ids=allowed_token_ids,
        )
        self.extend(out.tokens[0])
        return out

    def release(self) -> None:
        self.ids = []

    def __enter__(self) -> VLLMBranch:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class VLLMSampler:
    """A rollout's sampler for one row whose responses vLLM draws: `sample(num, max_new_tokens, prefix_ids)` after the
    row's whole prompt (`prompt_ids`) and `prefix_ids`, with the run's settings and a seed per (step, row); `fork()` a
    `VLLMBranch` for an agent trajectory (`longstraw.agent`), as `TurnSampler.fork()` gives a `Branch`."""

    def __init__(self, client: VLLMClient, prompt_ids: torch.Tensor, policy, settings, seed: int, max_positions=None):
        self.client, self.prompt_ids, self.settings, self.seed = client, prompt_ids, settings, seed
        self.policy = policy
        self.tokenizer, self.eos_token_id = policy.tokenizer, policy.eos_token_id
        #: the tokens the policy may write (None: all); what a turn's sampler is restricted to
        self.allowed_token_ids = policy.allowed_token_ids
        self.calls = 0
        #: what agent turns draw their seeds from (`VLLMBranch.sample`)
        self.generator = torch.Generator().manual_seed(seed)
        #: the model's positions (None: unbounded), which a trajectory may not pass
        self.max_positions = max_positions

    is_main = True

    def on_main(self, name: str, fn):
        return fn()

    def fork(self) -> VLLMBranch:
        return VLLMBranch(self.client, self.prompt_ids)

    def split(self, i: int) -> VLLMSampler:
        """The sampler of trajectory `i` of the row: the same prompt, a seed of its own, so that trajectories run at
        once (`longstraw.agent.rollout.EnvironmentRollout`) draw what they would draw one after another."""
        return VLLMSampler(
            self.client, self.prompt_ids, self.policy, self.settings, self.seed * 1_000_003 + i + 1, self.max_positions
        )

    def sample(self, num: int, max_new_tokens: int | None = None, prefix_ids=None) -> Samples:
        s = self.settings
        prompt = self.prompt_ids
        if prefix_ids is not None and len(prefix_ids) > 0:
            prompt = torch.cat([prompt, torch.as_tensor(prefix_ids, dtype=torch.long).reshape(-1).cpu()])
        self.calls += 1
        return self.client.generate(
            prompt,
            num,
            max_new_tokens or s.max_completion_length,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            stop_token_ids=[] if s.ignore_eos else [self.eos_token_id],
            seed=self.seed + 7919 * (self.calls - 1),
            allowed_token_ids=self.allowed_token_ids,
        )
