#!/usr/bin/env bash
# The GPU serving check in one command, from the checkout root (docs/gpu.md):
#
#   bash scripts/gpu_serve/run.sh          # on the GPU machine; .gpukit/ (scripts/gpu_serve/build.py) carried along
#   bash scripts/gpu_serve/run.sh --cpu    # the CPU rehearsal of the same steps (.venv's python)
#
# Extra arguments go to check.py (e.g. --drafters eagle3, --greedy-tokens 64). Results in $OUT (default
# /tmp/gpu_serve_out): run.log, imports.json, gpu_serve.json, gpu_serve.md, server_logs.tar.gz.
# Exit status: 0 every server passed; 1 a check failed; 3 no wheelhouse; 4 the import check failed;
# 5 the wheel install failed. Each step runs under `timeout`, inside a budget for the whole run
# ($GPU_SERVE_BUDGET_S, 540 s: the device call's 10 minutes, less a margin).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
MODE=gpu
if [[ "${1:-}" == "--cpu" ]]; then
  MODE=cpu
  shift
fi
KIT="${GPU_SERVE_KIT:-$ROOT/.gpukit}"
SITE="${GPU_SERVE_SITE:-/tmp/gpu_serve_site}"
WORK="${GPU_SERVE_WORK:-/tmp/gpu_serve_work}"
BUDGET="${GPU_SERVE_BUDGET_S:-540}"
export OUT="${OUT:-/tmp/gpu_serve_out}"
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
TEE_PID=$!
# On exit, let tee write the log's last lines before the device tool collects $OUT.
trap 'status=$?; exec 1>&- 2>&-; wait "$TEE_PID" 2>/dev/null; exit "$status"' EXIT

if [[ "$MODE" == gpu ]]; then PY="${PYTHON:-python3}"; else PY="${PYTHON:-$ROOT/.venv/bin/python}"; fi
say() { printf '[run %4ds] %s\n' "$SECONDS" "$*"; }
left() { echo $((BUDGET - SECONDS)); }

say "mode $MODE, budget ${BUDGET} s, kit $KIT, out $OUT"
date
if [[ "$MODE" == gpu ]]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  if [[ -d /usr/local/cuda ]]; then export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" PATH="$PATH:/usr/local/cuda/bin"; fi
  say "nvcc: $(command -v nvcc >/dev/null && nvcc --version | tail -1 || echo none)"
fi
"$PY" -c "import sys, torch, triton, transformers as t; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', t.__version__)"

# Keep SGLang on torch and Triton: no sglang-kernel, no flashinfer, no Rust extensions (docs/gpu.md).
export SGLANG_FORCE_FUSED_OP_BACKEND=torch SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 \
  SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python TVM_FFI_DISABLE_TORCH_C_DLPACK=1 PYTHONUNBUFFERED=1 \
  SGLANG_TTS_GPU_SAMPLING=torch
STANDIN_KERNELS="$HERE/standin/kernels"
STANDIN_PLUGINS="$HERE/standin/plugins"

# 1. The wheelhouse: installed into $SITE for this interpreter (on CPU: the repacked SGLang alone, its
#    dependencies coming from .venv; the whole wheelhouse is installed for the GPU's python 3.12 into a
#    scratch folder, which checks every wheel's tags without running anything).
SGLANG_WHEEL=$(ls "$KIT"/whl/sglang-*-py3-none-any.whl 2>/dev/null | head -1)
PIP=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade)
rm -rf "$SITE"
if [[ -z "$SGLANG_WHEEL" ]]; then
  if [[ "$MODE" == gpu ]]; then
    say "no wheelhouse in $KIT: build it where PyPI is reachable (python scripts/gpu_serve/build.py) and carry .gpukit"
    exit 3
  fi
  say "no wheelhouse in $KIT: the rehearsal imports and serves .venv's SGLang"
elif [[ "$MODE" == gpu ]]; then
  say "installing $(ls "$KIT"/whl/*.whl | wc -l) wheels into $SITE"
  timeout 180 "${PIP[@]}" --target "$SITE" "$KIT"/whl/*.whl || { say "wheel install failed"; exit 5; }
  timeout 120 "$PY" -m compileall -q -j 0 "$SITE/sglang" >/dev/null 2>&1 || say "compileall did not finish (imports compile instead)"
else
  if [[ $(ls "$KIT"/whl/*.whl | wc -l) -gt 1 ]]; then
    say "installing the wheelhouse for python 3.12 (tags only) into $SITE.py312"
    read -r -a TARGET_ARGS <<<"$("$PY" "$HERE/build.py" --print-target-args)"
    timeout 180 "${PIP[@]}" --target "$SITE.py312" "${TARGET_ARGS[@]}" "$KIT"/whl/*.whl \
      || { say "wheel install for python 3.12 failed"; exit 5; }
    rm -rf "$SITE.py312"
  fi
  say "installing $(basename "$SGLANG_WHEEL") into $SITE"
  timeout 120 "${PIP[@]}" --target "$SITE" "$SGLANG_WHEEL" || { say "SGLang wheel install failed"; exit 5; }
fi
SITE_PATH=""
[[ -d "$SITE" ]] && SITE_PATH="$SITE:"

# 2. Import SGLang's serving modules and load the plugins as a server process will (on CPU under faked CUDA);
#    both of the gpu_serve plugin's routes on, each routed op run once on tiny inputs.
say "import check"
IMPORT_ARGS=(--json "$OUT/imports.json")
[[ "$MODE" == cpu ]] && IMPORT_ARGS+=(--fake-cuda)
PYTHONPATH="$SITE_PATH$STANDIN_KERNELS:$STANDIN_PLUGINS:$ROOT" SGLANG_TTS_CPU_SUPPORT=0 SGLANG_TTS_GPU_TREE=triton \
  timeout 240 "$PY" "$HERE/imports.py" "${IMPORT_ARGS[@]}" || { say "import check failed ($OUT/imports.json)"; exit 4; }

# 3. Serve and check. On the GPU: the sgl_kernel / flash_mla stand-ins, the CPU layer off, fp32 Triton dots
#    in full precision (the default dtype is float32: greedy ties then come from no TF32 rounding).
if [[ "$MODE" == gpu ]]; then
  export PYTHONPATH="$SITE_PATH$STANDIN_KERNELS:$STANDIN_PLUGINS:$ROOT" SGLANG_TTS_CPU_SUPPORT=0 TRITON_F32_DEFAULT=ieee
  CHECK_ARGS=()
else  # the CPU layer brings its own sgl_kernel: no kernel stand-ins on the path
  export PYTHONPATH="$SITE_PATH$STANDIN_PLUGINS:$ROOT"
  CHECK_ARGS=(--cpu)
fi
BUDGET_CHECK=$(($(left) - 20))
say "serving check, ${BUDGET_CHECK} s"
timeout -k 15 "$BUDGET_CHECK" "$PY" "$HERE/check.py" "${CHECK_ARGS[@]}" --out "$OUT" --work "$WORK" \
  --budget-s "$((BUDGET_CHECK - 5))" "$@"
status=$?
say "done: check.py exit $status"
exit "$status"
