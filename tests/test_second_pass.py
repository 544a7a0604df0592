"""`.ci/run`'s second pass runs the `numerics` tests under another CPU's kernels: the settings it exports must change
the outputs of the kernels it names, or the pass repeats the first one.

The settings are read from `.ci/run` itself (the line that runs `pytest -m numerics`), and two fresh processes compute
the same softmax and matrix product, one with them and one without: on an x86 CPU with AVX-512, ATen's softmax takes
its AVX2 kernel (`ATEN_CPU_CAPABILITY`) and MKL, which does the matrix products, its AVX2 kernels
(`MKL_ENABLE_INSTRUCTIONS`; without that setting a matmul is bit-identical). MKL honours the setting only where it
dispatches by ISA, on Intel CPUs; elsewhere it takes a generic path whatever the setting, so `.ci/run` preloads
`.ci/mkl_intel_dispatch.c` there, which answers MKL's vendor check "Intel". MKL_VERBOSE's banner names the path taken.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: a softmax over rows longer than any vector width and a product whose inner dimension spans several MKL blocks
KERNELS = """
import hashlib, json, torch
torch.manual_seed(0)
s = torch.randn(64, 4099)
a, b = torch.randn(257, 1031), torch.randn(1031, 263)
out = dict(softmax=torch.softmax(s, -1), matmul=a @ b, capability=None)
print(json.dumps({k: (torch.backends.cpu.get_cpu_capability() if v is None else
                      hashlib.sha1(v.numpy().tobytes()).hexdigest()) for k, v in out.items()}))
"""


def _second_pass_settings() -> dict[str, str]:
    """The environment `.ci/run` gives its second pass, `$preload` being what `.ci/mkl_intel_dispatch` prints."""
    line = next(ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if "ATEN_CPU_CAPABILITY=" in ln)
    settings = dict(re.findall(r"\b([A-Z_]+)=(\S+)", line))
    if settings.get("LD_PRELOAD") == "$preload":
        shim = subprocess.run([str(ROOT / ".ci" / "mkl_intel_dispatch")], capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL, check=True).stdout.strip()
        settings["LD_PRELOAD"] = shim
    return settings


def _cpu_flags() -> tuple[str, set[str]]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    vendor = re.search(r"vendor_id\s*:\s*(\S+)", text)
    flags = re.search(r"flags\s*:\s*(.*)", text)
    return (vendor.group(1) if vendor else "", set(flags.group(1).split()) if flags else set())


def _run(env: dict[str, str]) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-c", KERNELS], env=env | {"MKL_VERBOSE": "1"}, capture_output=True,
                         text=True, timeout=120, stdin=subprocess.DEVNULL, check=True)
    lines = out.stdout.strip().splitlines()
    # MKL_VERBOSE's banner names the code path MKL dispatched to: "... for Intel(R) 64 architecture <path>, Lnx ..."
    banner = next((ln for ln in lines if ln.startswith("MKL_VERBOSE") and "architecture" in ln), "no MKL_VERBOSE banner")
    isa = re.search(r"64 architecture (.*?), Lnx", banner)
    return json.loads(lines[-1]) | {"mkl": isa.group(1) if isa else banner}


def test_the_second_pass_changes_the_kernels_it_names():
    vendor, flags = _cpu_flags()
    if "avx512f" not in flags:
        pytest.skip("no AVX-512 here: the first pass already runs the AVX2 kernels")
    settings = _second_pass_settings()
    assert {"ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"} <= set(settings), settings
    assert bool(settings.get("LD_PRELOAD")) == (vendor != "GenuineIntel"), (vendor, settings.get("LD_PRELOAD"))
    plain = {k: v for k, v in os.environ.items() if k not in settings} | {"OMP_NUM_THREADS": "1"}
    first, second = _run(plain), _run(plain | settings)
    assert (first["capability"], second["capability"]) == ("AVX512", "AVX2")
    assert first["softmax"] != second["softmax"], "ATen's softmax is bit-identical under the second pass's settings"
    # MKL: AVX-512 kernels on Intel, a generic path elsewhere (it dispatches by vendor) -> its AVX2 kernels on both
    assert ("AVX-512" in first["mkl"]) == (vendor == "GenuineIntel"), first["mkl"]
    assert "AVX2" in second["mkl"], f"MKL did not take its AVX2 kernels in the second pass: {second['mkl']}"
    assert first["matmul"] != second["matmul"], "MKL's matmul is bit-identical under the second pass's settings"
