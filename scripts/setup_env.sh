#!/usr/bin/env bash
# One-command setup: a virtual environment at .venv with the CPU build of torch 2.13.0,
# SGLang 0.5.23 (its CUDA-only dependencies left out), the test tools and sglang-tts (editable).
# Idempotent: a second run with unchanged requirement files only checks and exits.
#
#   bash scripts/setup_env.sh            # create or update .venv
#   PYTHON=python3.11 bash scripts/setup_env.sh
#
# Where PyPI's default torch is a CUDA build (most x86_64 machines), point pip at a CPU wheel
# index first, e.g. PIP_EXTRA_INDEX_URL=<PyTorch's CPU wheel index>. On this project's machines the
# CPU wheel of torch 2.13.0 is already on local disk and pip picks it up.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
SGLANG_VERSION="0.5.23"
TORCH_VERSION="2.13.0"
WHEELS="$ROOT/.cache/wheels"
STAMP="$VENV/.sglang_tts_setup"

say() { printf '[setup] %s\n' "$*"; }

# SGLang's NGRAM speculation drafts from a C++ corpus that SGLang compiles on first use (cached under
# ~/.cache/sglang/jit). Compiled at a server's launch, it slows that launch, and until the CPU layer
# counted only a server's own memory (docs/cpu.md#memory) the compiler's memory was charged to the KV
# cache, which failed NGRAM launches on fresh machines: build it here, once.
build_ngram_corpus() {
  local out
  if out=$("$VPY" -W ignore -c "from sglang.kernels.ops.speculative.ngram_corpus import get_ngram_corpus_cls as g; g()" 2>&1); then
    say "SGLang's NGRAM corpus is built (~/.cache/sglang/jit)"
  else
    say "WARNING: could not build SGLang's NGRAM corpus (NGRAM servers will try at launch): ${out##*$'\n'}"
  fi
}

fingerprint() {
  cat requirements/sglang-cpu.txt requirements/constraints-cpu.txt requirements/dev.txt setup.py \
      patches/torchvision_cpu_guard.py | sha256sum | cut -d' ' -f1
  echo "sglang=$SGLANG_VERSION torch=$TORCH_VERSION"
}

if [[ ! -x "$VPY" ]]; then
  say "creating virtual environment at .venv ($($PY --version))"
  "$PY" -m venv "$VENV"
fi

want="$(fingerprint)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]] && "$VPY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec(\"sglang\") and u.find_spec(\"sglang_tts\") else 1)" 2>/dev/null; then
  say ".venv is up to date (sglang $SGLANG_VERSION, torch $TORCH_VERSION CPU, sglang-tts editable)"
  build_ngram_corpus
  exit 0
fi

PIP=("$VPY" -m pip --disable-pip-version-check)
export PIP_CONSTRAINT="$ROOT/requirements/constraints-cpu.txt${PIP_CONSTRAINT:+ $PIP_CONSTRAINT}"

say "installing torch $TORCH_VERSION (CPU build)"
"${PIP[@]}" install -q "torch==$TORCH_VERSION"
if ! "$VPY" -W ignore -c "import torch, sys; sys.exit(1 if torch.version.cuda else 0)"; then
  say "ERROR: pip installed a CUDA build of torch; point PIP_EXTRA_INDEX_URL at a CPU wheel index and rerun"
  exit 1
fi

say "installing sglang $SGLANG_VERSION without its CUDA-only dependencies (--no-deps)"
mkdir -p "$WHEELS"
if ! ls "$WHEELS"/sglang-"$SGLANG_VERSION"-*.whl >/dev/null 2>&1; then
  "${PIP[@]}" download -q --no-deps -d "$WHEELS" "sglang==$SGLANG_VERSION"
fi
"${PIP[@]}" install -q --no-deps "$WHEELS"/sglang-"$SGLANG_VERSION"-*.whl

say "installing the dependencies SGLang really needs on CPU (requirements/sglang-cpu.txt)"
"${PIP[@]}" install -q -r requirements/sglang-cpu.txt

say "installing test and benchmark tools (requirements/dev.txt)"
"${PIP[@]}" install -q -r requirements/dev.txt

say "guarding torchvision's CUDA-only fake ops (patches/torchvision_cpu_guard.py)"
"$VPY" patches/torchvision_cpu_guard.py

say "installing sglang-tts in editable mode (registers the sglang.srt.plugins entry point)"
"${PIP[@]}" install -q --no-deps --no-build-isolation -e .

"$VPY" - <<'PYEOF'
import importlib.metadata as md
import sglang, torch
eps = [e.value for e in md.entry_points(group="sglang.srt.plugins") if e.name == "sglang_tts"]
assert eps, "sglang_tts plugin entry point missing"
print(f"[setup] ok: sglang {sglang.__version__}, torch {torch.__version__}, plugin {eps[0]}")
PYEOF
build_ngram_corpus
echo "$want" > "$STAMP"
say "done. Activate with: source .venv/bin/activate"
