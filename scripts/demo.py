"""The main job in one command: a TTS server on the default model, then a chat request.

    .venv/bin/python scripts/demo.py [--max-tokens 256] [--drafter PATH] [--keep-server]

1. prepares SmolLM2-135M-Instruct (scripts/prepare_model.py; cached after the first run);
2. takes the EAGLE-3 drafter given with --drafter, else the newest one scripts/train_drafter.py
   trained for the model, else writes an UNTRAINED random one into the cache (acceptance then
   starts near 1 and TTS adapts it during the request);
3. launches `python -m sglang.launch_server ... --speculative-algorithm TTS` (the sglang_tts plugin
   loads through SGLang's entry point) and waits for health;
4. sends one request through the OpenAI client and prints the answer and TTS's counters;
5. stops the server.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sglang_tts.assets import cache_root, prepare_default_model
from sglang_tts.bench.server import start_server, stop_server
from sglang_tts.drafters.checkpoints import write_tiny_eagle3

QUESTION = "Explain, step by step, why the sum of two odd numbers is always even."


def trained_drafter(model_dir: Path) -> Path | None:
    """The newest EAGLE-3 drafter scripts/train_drafter.py wrote for this model, if any."""
    found = [
        d
        for d in (cache_root() / "drafters").glob(f"{model_dir.name}-eagle3-len*")
        if (d / "config.json").exists() and (d / "model.safetensors").exists()
    ]
    return max(found, key=lambda d: (d / "model.safetensors").stat().st_mtime) if found else None


def default_drafter(model_dir: Path) -> Path:
    trained = trained_drafter(model_dir)
    if trained is not None:
        print(f"[demo] using the trained EAGLE-3 drafter {trained}", file=sys.stderr)
        return trained
    # Not named <model>-eagle3-len*: the benchmarks' drafter lookup must never pick it.
    out = cache_root() / "drafters" / f"untrained-{model_dir.name}-eagle3-v2"
    if not (out / "config.json").exists():
        print(f"[demo] writing an untrained EAGLE-3 drafter to {out}", file=sys.stderr)
        target_config = json.loads((model_dir / "config.json").read_text())
        write_tiny_eagle3(out, target_config, layout="midlayer", draft_vocab_size=16384, draft_vocab="first", seed=0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", help="EAGLE-3 drafter folder (default: an untrained one in the cache)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--question", default=QUESTION)
    ap.add_argument("--extra-args", default="", help="more launch_server flags, e.g. '--tts-update-stride 2'")
    args = ap.parse_args()

    model = prepare_default_model()
    drafter = Path(args.drafter) if args.drafter else default_drafter(model)
    launch = [
        "--speculative-algorithm", "TTS",
        "--speculative-draft-model-path", str(drafter),
        "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4",
        *args.extra_args.split(),
    ]  # fmt: skip
    print(f"[demo] launching SGLang with TTS on {model.name} (about a minute on CPU)", file=sys.stderr)
    server = start_server(str(model), launch, timeout_s=600)
    try:
        from openai import OpenAI

        client = OpenAI(base_url=server.base_url + "/v1", api_key="none")
        t0 = time.perf_counter()
        reply = client.chat.completions.create(
            model=str(model),
            messages=[{"role": "user", "content": args.question}],
            max_tokens=args.max_tokens,
            temperature=0,
            extra_body={"return_meta_info": True, "custom_params": {"tts_return_accept_lengths": True}},
        )
        seconds = time.perf_counter() - t0
        choice = reply.choices[0]
        meta = (choice.model_extra or {}).get("meta_info") or {}
        print(choice.message.content)
        print("\n--- TTS ---")
        lengths = meta.get("tts_accept_lengths") or []
        print(f"tokens: {reply.usage.completion_tokens} in {seconds:.1f} s")
        print(f"spec_accept_length: {meta.get('spec_accept_length')}  verify rounds: {meta.get('spec_verify_ct')}")
        print(
            f"tts_num_updates: {meta.get('tts_num_updates')}  skipped: {meta.get('tts_num_skipped_updates')}  "
            f"update time: {meta.get('tts_update_ms')} ms"
        )
        if lengths:
            half = len(lengths) // 2
            first, second = lengths[:half] or [0], lengths[half:] or [0]
            print(
                f"accept length, first half of the output: {sum(first) / len(first):.2f}; "
                f"second half: {sum(second) / len(second):.2f}"
            )
    finally:
        stop_server(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
