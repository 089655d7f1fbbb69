"""Seconds of the scheduler's main thread per part of a round, from py-spy's collapsed stacks.

python categories.py pyspy-retire.txt.gz   (raw or gzipped; samples at 50 Hz; a stack counts once per part)
"""

import gzip
import sys

PARTS = {
    "worker rounds and prefills": ["Scheduler.run_batch"],
    "target verify forward (EAGLE worker)": ["EAGLEWorkerV2.verify", "TpModelWorker.forward_batch_generation"],
    "target forward (NGRAM worker, prefill included)": [
        "NGRAMWorker.forward_batch_generation",
        "TpModelWorker.forward_batch_generation",
    ],
    "drafter steps (one-time compile included)": ["hybrid_run", "draft_forward"],
    "one-time torch.compile of select_top_k_tokens": ["select_top_k_tokens", "ConvertFrame"],
    "drafter extend after verify": ["hybrid_extend"],
    "TTS after verify": ["TTSEagleWorker._after_verify"],
    "of which the updates (inline on CPU)": ["TTSEagleWorker._after_verify", "Distiller.observe"],
    "TTS before the draft (scope, barrier)": ["TTSRuntime.before_draft"],
    "the hybrid's plan": ["HybridDrafting.plan_round"],
    "prefill (EAGLE worker)": ["_forward_prefill_batch"],
}


def contains(frames: list[str], sequence: list[str]) -> bool:
    i = 0
    for frame in frames:
        if sequence[i] in frame:
            i += 1
            if i == len(sequence):
                return True
    return False


totals = dict.fromkeys(PARTS, 0)
opener = gzip.open if sys.argv[1].endswith(".gz") else open
for line in opener(sys.argv[1], "rt"):
    stack, count = line.rstrip().rsplit(" ", 1)
    frames = stack.split(";")
    for part, sequence in PARTS.items():
        if contains(frames, sequence):
            totals[part] += int(count)
for part, samples in totals.items():
    if samples:
        print(f"{samples / 50:7.2f} s  {part}")
