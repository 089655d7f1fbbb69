"""Ship a drafter trained by scripts/train_drafter.py: a compact (fp16) copy inside the package.

    .venv/bin/python scripts/ship_drafter.py --kind eagle3 \\
        --train-command "scripts/train_drafter.py --kind eagle3 --threads 2 --gen-batch-size 32 --epochs 5.5"

Takes the newest `<target>-<kind>-len*` folder train_drafter.py wrote to the cache (or --src), casts its
floating-point tensors to fp16 and writes config.json + model.safetensors + training.json (the commands
and the training summary) to sglang_tts/drafters/shipped/<target>-<kind>/, which scripts/demo.py and
the benchmarks use by default. The loaders cast the weights back to the server's dtype. Beside them goes
answers.safetensors: the target's greedy answers the drafter was trained on (from the training data cache;
answer ids only), which train_drafter.py on a fresh machine reuses instead of generating them again.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from sglang_tts.assets import DEFAULT_MODEL
from sglang_tts.bench.configs import ConfigError, drafters_root, find_default_drafter
from sglang_tts.drafters.shipped import ANSWERS, SHIPPED_ROOT, TRAINING_RECORD, write_compact
from sglang_tts.training.data import export_answers


def newest_trained(target: str, kind: str) -> Path:
    """The newest folder train_drafter.py wrote for `target` in the cache (never the shipped one)."""
    try:
        src = find_default_drafter(target, kind, root=drafters_root())
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    if not (src / "train" / "summary.json").is_file():
        raise SystemExit(f"{src} has no train/summary.json: its training did not finish (rerun with --resume)")
    return src


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=["eagle3", "dflash"], default="eagle3")
    ap.add_argument("--target", default=DEFAULT_MODEL.name, help="target model folder name (default: %(default)s)")
    ap.add_argument("--src", type=Path, help="trained checkpoint folder (default: the newest in the cache)")
    ap.add_argument("--dst", type=Path, help="default: sglang_tts/drafters/shipped/<target>-<kind>")
    ap.add_argument("--train-command", required=True, help="the train_drafter.py command(s) that produced --src")
    ap.add_argument("--no-answers", action="store_true", help="do not ship the answers it was trained on")
    args = ap.parse_args(argv)

    src = args.src or newest_trained(args.target, args.kind)
    dst = args.dst or SHIPPED_ROOT / f"{args.target}-{args.kind}"
    summary = json.loads((src / "train" / "summary.json").read_text())
    # Paths on the training machine: dropped, or reduced to their names.
    summary.pop("checkpoint", None)
    if "target" in summary:
        summary["target"] = Path(summary["target"]).name
    data_cache = (summary.get("data") or {}).pop("cache", None)
    record = {
        "train_command": args.train_command,
        "ship_command": shlex.join(["scripts/ship_drafter.py", *(sys.argv[1:] if argv is None else argv)]),
        "stored_dtype": "float16",
        "summary": summary,
    }
    if not args.no_answers and (data_cache is None or not Path(data_cache).is_file()):
        raise SystemExit(f"the training data of {src} is not in this cache ({data_cache}): pass --no-answers")
    write_compact(src, dst)
    if not args.no_answers:
        record["answers"] = {"file": ANSWERS, **export_answers(Path(data_cache), dst / ANSWERS)}
    (dst / TRAINING_RECORD).write_text(json.dumps(record, indent=1) + "\n")
    size = sum(f.stat().st_size for f in dst.iterdir())
    print(f"{dst} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
