#!/bin/bash
# bash profile.sh CONFIG NAME OUT: one rollout step (1 prompt x 4 samples, seeded, T=1) under py-spy
# e.g. bash docs/results/qwen-rollout-scope-profile-c4/profile.sh tts-group+hybrid group /tmp/prof  (raw collapsed stacks of the
# scheduler process at 50 Hz in OUT/NAME.txt, gzipped here; the rollout report beside them)
set -u
config=$1; name=$2; out=$3
mkdir -p "$out"
cd "$(git rev-parse --show-toplevel)"
.venv/bin/python scripts/bench_rollout.py --model Qwen2.5-Coder-0.5B-Instruct --datasets reasoning --prompts-per-step 1 \
    --samples 4 --steps 1 --max-new-tokens 512 --sampling-seed 0 --configs "$config" --out "$out" --run "$name" -q > "$out/$name.log" 2>&1 &
bench=$!
until pid=$(pgrep -f '^sglang::scheduler' | head -1) && [ -n "$pid" ]; do sleep 1; done
.venv/bin/py-spy record -p "$pid" --rate 50 --nonblocking -f raw -o "$out/$name.txt" > /dev/null 2>&1 &
wait $bench
wait
