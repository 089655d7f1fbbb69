#!/bin/bash
# One benchmark request under py-spy: bash profile.sh DATASET CONFIG NAME OUT [more bench_long.py flags]
# e.g. bash profile.sh long-gen eagle3:tts+hybrid+retire retire /tmp/prof
# Samples the scheduler process (start-up, warm-up and prefill included) at 50 Hz until it exits;
# the collapsed stacks land in OUT/NAME.txt, the benchmark's results in OUT/NAME/.
set -u
dataset=$1; config=$2; name=$3; out=$4; shift 4
mkdir -p "$out"
.venv/bin/python scripts/bench_long.py --model Qwen2.5-Coder-0.5B-Instruct --datasets "$dataset" --num-prompts 1 \
    --max-new-tokens 1024 --temperature 0 --rounds 1 --concurrency 1 --out "$out" --run "$name" \
    --configs "$config" --variant 'retire=--tts-hybrid-retire-below 0.35' "$@" > "$out/$name.log" 2>&1 &
bench=$!
until pid=$(pgrep -f '^sglang::scheduler' | head -1) && [ -n "$pid" ]; do sleep 1; done
.venv/bin/py-spy record -p "$pid" --rate 50 --nonblocking -f raw -o "$out/$name.txt" &
wait $bench
wait
