#!/usr/bin/env bash
# One machine with one CUDA GPU, under 8 minutes on an H200: (a) the CUDA-marked tests, (b) the pieces of a step
# against their candidates (bench/gpu_kernels.py), (c) one GRPO step of real-width models at P = 32K … 1M,
# G = 2 / 8, R = 256 for longstraw detached / exact and naive serial (bench/gpu_step.py). Results (JSON, markdown,
# PNG, gpu.log) go to $OUT, else bench/results/gpu/.
#
#   bash bench/gpu.sh                 # on the GPU machine
#   SMOKE=1 bash bench/gpu.sh         # rehearsal on a CPU: tiny sizes, the CUDA tests run on the CPU
#   TESTS_S=150 SECTIONS="kernels offload" TOTAL_S=440 bash bench/gpu.sh   # time boxes and sections to run
#
# Wheels in .whl/ (transformers, peft, flash-linear-attention, liger-kernel for a machine without a package
# registry) are installed into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SMOKE_ARGS=()
if [ -n "${SMOKE:-}" ]; then SMOKE_ARGS=(--smoke); export LONGSTRAW_TEST_DEVICE="${LONGSTRAW_TEST_DEVICE:-cpu}"; fi
T0=$(date +%s)
exec > >(tee -a "$OUT/gpu.log") 2>&1
"$PY" - <<'PYEOF' 
import torch, transformers, peft, platform
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| transformers", transformers.__version__, "| peft", peft.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("GPU", p.name, f"{p.total_memory / 2**30:.0f} GiB", f"sm_{p.major}{p.minor}", "| flash attention:",
          torch.backends.cuda.is_flash_attention_available())
else:
    print("GPU none")
for mod in ("fla", "liger_kernel"):
    try:
        m = __import__(mod)
        print(mod, getattr(m, "__version__", "installed"))
    except Exception as e:
        print(mod, "not available:", str(e)[:100])
PYEOF
echo "# (a) CUDA tests"
TESTS=(tests/ops/test_kernels.py tests/test_cuda.py)
if [ -n "${SMOKE:-}" ]; then TESTS=(tests/test_cuda.py); fi
PER_TEST=()  # a test that hangs (a kernel compiling for minutes) fails alone instead of ending the run
if "$PY" -c "import pytest_timeout" 2>/dev/null; then PER_TEST=(--timeout 60); fi
timeout "${TESTS_S:-200}" "$PY" -m pytest -v -m cuda -p no:cacheprovider -rfE --tb=short --durations=12 "${PER_TEST[@]}" \
    "${TESTS[@]}" > "$OUT/cuda_tests.log" 2>&1
grep -E "FAILED|ERROR|passed|failed" "$OUT/cuda_tests.log" | tail -40
echo "# (b) kernels, LM head, sampler, offload ($(( $(date +%s) - T0 )) s so far)"
timeout 110 "$PY" bench/gpu_kernels.py --out "$OUT" --sections ${SECTIONS:-kernels lm_head sampler offload flex} \
    "${SMOKE_ARGS[@]}" 2>&1 | grep -v '^{'
LEFT=$(( ${TOTAL_S:-460} - ($(date +%s) - T0) ))
echo "# (c) GRPO step grid, time box ${LEFT} s"
if [ "$LEFT" -lt 40 ]; then echo "# no time left for the grid"; exit 0; fi
timeout $(( LEFT + 20 )) "$PY" bench/gpu_step.py --out "$OUT" --budget-s $(( LEFT - 10 )) "${SMOKE_ARGS[@]}" 2>&1 \
    | grep -v '^{'
# (d) on a machine with several GPUs: expert parallelism over NCCL, one GPU per rank (bench/expert_parallel.py)
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${NGPU:-0}" -ge 2 ] && [ -z "${SMOKE:-}" ]; then
    CONFIGS=(1:1 2:1:fsdp 2:2 2:2:fsdp)
    if [ "$NGPU" -ge 4 ]; then CONFIGS+=(4:1:fsdp 4:4 4:4:fsdp); fi
    echo "# (d) expert parallelism over NCCL on ${NGPU} GPUs"
    timeout 300 "$PY" bench/expert_parallel.py --backend nccl --P 65536 --configs "${CONFIGS[@]}" \
        --out "$OUT/expert_parallel" 2>&1 | grep -v '^{'
fi
echo "# done in $(( $(date +%s) - T0 )) s"
