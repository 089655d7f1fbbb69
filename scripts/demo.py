"""The main job in one command: the default model served without speculation, then with its trained
EAGLE-3 drafter frozen, with TTS, and with TTS plus hybrid drafting, on one long answer; prints what
each changed and writes it as JSON and a PNG.

    .venv/bin/python scripts/demo.py [--max-tokens 512] [--question TEXT] [--out tts-demo]

1. prepares SmolLM2-135M-Instruct (scripts/prepare_model.py; cached after the first run);
2. takes the EAGLE-3 drafter that ships with the package (sglang_tts/drafters/shipped/, trained by
   scripts/train_drafter.py; its training.json has the commands), or --drafter PATH;
   --untrained writes a random drafter instead (acceptance then stays near 1: the path, not the gain);
3. starts `python -m sglang.launch_server` four times, one server after the other: the target alone,
   then `--speculative-algorithm TTS` with --tts-freeze (the same drafter, never updated), as it is,
   and with --tts-hybrid on (a suffix chain where it beats the drafter's), and sends each the same
   greedy chat request through the OpenAI client;
4. prints the TTS answer, then acceptance by quarter of the output, the updates made, which proposer
   the hybrid verified, tokens/s of each, whether the answers are identical, and a warning if the
   answer loops;
   writes OUT/demo.json, OUT/demo.md and OUT/demo.png; stops the servers.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from sglang_tts.assets import cache_root, resolve_model
from sglang_tts.bench.demo import QUESTION, render, run_demo, write_outputs
from sglang_tts.drafters.checkpoints import write_tiny_eagle3
from sglang_tts.drafters.shipped import shipped_drafter

CHAIN_3 = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]


def untrained_drafter(model_dir: Path) -> Path:
    # Not named <model>-eagle3-len*: the benchmarks' drafter lookup must never pick it.
    out = cache_root() / "drafters" / f"untrained-{model_dir.name}-eagle3-v2"
    if not (out / "config.json").exists():
        print(f"[demo] writing an untrained EAGLE-3 drafter to {out}", file=sys.stderr)
        target_config = json.loads((model_dir / "config.json").read_text())
        write_tiny_eagle3(out, target_config, layout="midlayer", draft_vocab_size=16384, draft_vocab="first", seed=0)
    return out


def attach_extra_args(argv: list[str]) -> list[str]:
    """`--extra-args --tts-sync` as `--extra-args=--tts-sync`: argparse takes a lone value that starts
    with `--` for an option of its own and refuses the pair."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--extra-args" and i + 1 < len(argv):
            out.append(f"--extra-args={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    argv = attach_extra_args(sys.argv[1:] if argv is None else list(argv))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        help="target model: a folder or a prepare_model.py name, e.g. Qwen2.5-Coder-0.5B-Instruct "
        "(default: SmolLM2-135M-Instruct)",
    )
    ap.add_argument("--drafter", type=Path, help="EAGLE-3 drafter folder (default: the one shipped for the model)")
    ap.add_argument("--untrained", action="store_true", help="use a random, untrained drafter (shows the path only)")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--question", default=QUESTION)
    ap.add_argument("--out", type=Path, default=Path("tts-demo"), help="where demo.json, demo.md and demo.png go")
    ap.add_argument(
        "--extra-args", default="", help="more launch_server flags for the speculative servers, e.g. '--tts-lr 3e-4'"
    )
    args = ap.parse_args(argv)

    model = resolve_model(args.model)
    if args.drafter:
        drafter, trained = args.drafter, True
    elif args.untrained:
        drafter, trained = untrained_drafter(model), False
    else:
        found = shipped_drafter(model.name)
        if found is None:
            ap.error(f"no drafter ships for {model.name}: pass --drafter PATH (or --untrained)")
        drafter, trained = found, True
    print(f"[demo] drafter: {drafter}", file=sys.stderr)
    result = run_demo(
        model,
        drafter,
        drafter_trained=trained,
        question=args.question,
        max_tokens=args.max_tokens,
        launch_args=[*CHAIN_3, *args.extra_args.split()],
        say=lambda line: print(line, file=sys.stderr),
    )
    print(result.answers["TTS"].text)
    print()
    print(render(result))
    command = shlex.join(["python", "scripts/demo.py", *argv])
    written = write_outputs(result, args.out, command=command)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0 if result.identical else 1


if __name__ == "__main__":
    sys.exit(main())
