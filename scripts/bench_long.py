#!/usr/bin/env python
"""Long-reasoning benchmark: frozen vs TTS drafters (and the plain target) on long outputs.

Launches one SGLang server per configuration at a time, interleaved over rounds of prompts (or
targets a running server with --base-url), records every request's per-round accept lengths,
tokens, wall time and TTS update counters, and writes results/<run>/results.json, report.md and
PNG plots (four per sampling mode). Requests go through the openai client (/v1/chat/completions,
meta_info via extra_body) unless --api generate. See sglang_tts/bench/ for the definitions and the
schedule, and docs/benchmarks.md for the outputs.

Examples::

    python scripts/bench_long.py --smoke                       # tiny offline models, a few minutes
    python scripts/bench_long.py --datasets aime2024 math500 --num-prompts 5 \\
        --configs no-spec stock frozen tts-s1 tts-s5 tts-s5-sync --drafter-kind eagle3 dflash
    python scripts/bench_long.py --base-url http://127.0.0.1:30000 --configs eagle3:tts-s5
    python scripts/bench_long.py --from-json results/RUN/results.json --bucket 128   # re-aggregate
    python scripts/bench_long.py --resume --run RUN        # continue an interrupted run (its saved plan)
    python scripts/bench_long.py --resume --extend --run RUN --num-prompts 4 --rounds 4   # grow it

Every finished request (or wave) is appended to results/<run>/requests.jsonl at once, and results.json is
rewritten after it: a stop (Ctrl-C, SIGTERM, kill -9, a reboot) loses only the requests in flight, and
--resume sends only the missing ones. The environment variable SGLANG_TTS_BENCH_TERM_AFTER=K (a test
hook) makes the process send itself SIGTERM after K finished requests or waves.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Runnable from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_tts.bench import smoke  # noqa: E402
from sglang_tts.bench.configs import (  # noqa: E402
    DEFAULT_CONFIGS,
    KINDS,
    BenchConfig,
    ConfigError,
    build_configs,
    check_context,
    external_config,
    kinds_needed,
    parse_config_name,
    parse_drafter_args,
    parse_eagle3_shape,
    parse_variants,
    resolve_drafters,
    resolve_reference,
    split_server_args,
)
from sglang_tts.bench.runner import (  # noqa: E402
    RequestRecord,
    RunnerSettings,
    SamplingSettings,
    Unit,
    get_json,
    split_rounds,
    waves,
)
from sglang_tts.bench.server import cpu_launch, waves_kv_tokens  # noqa: E402
from sglang_tts.bench.suite import (  # noqa: E402
    REQUESTS,
    BenchPlan,
    load_saved_plan,
    rerender,
    run_suite,
    summary_lines,
)
from sglang_tts.bench.workload import chat_prompts, prompt_token_counts, sample_prompts  # noqa: E402

DEFAULT_DATASETS = ("aime2024", "math500")
DEFAULT_TEMPERATURES = (0.0, 0.7)
# Flags a resumed run may change (where the run lives, how this session waits and shows progress, how the
# report aggregates); every other flag is part of the plan saved in plan.json.
SESSION_FLAGS = ("resume", "run", "out", "quiet", "request_timeout", "server_timeout", "bucket", "reference")
# Plan flags --resume --extend may change: more prompts after the saved ones, in more rounds.
EXTEND_FLAGS = ("num_prompts", "rounds")
TERM_AFTER_ENV = "SGLANG_TTS_BENCH_TERM_AFTER"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add(
        "--smoke",
        action="store_true",
        help="tiny offline models, 2 chat prompts, 256 greedy tokens, frozen + tts-s1 (flags below still apply)",
    )
    add("--from-json", type=Path, help="only re-aggregate an existing results.json (report.md and plots beside it)")
    what = parser.add_argument_group("configurations")
    what.add_argument(
        "--configs", nargs="+", help=f"names (default: {' '.join(DEFAULT_CONFIGS)}); KIND:NAME for one kind"
    )
    what.add_argument("--drafter-kind", nargs="+", choices=KINDS, help="drafter kinds to run (default eagle3)")
    what.add_argument("--drafter", action="append", default=[], help="[KIND=]PATH (default: trained drafters in cache)")
    what.add_argument(
        "--model",
        help="target model: a folder or a prepare_model.py name, e.g. Qwen2.5-Coder-0.5B-Instruct "
        "(default: SmolLM2-135M-Instruct)",
    )
    what.add_argument(
        "--eagle3-shape",
        default="chain",
        help="EAGLE-3 draft shape: chain (3 steps, top-k 1, 4 tokens; default), sglang (SGLang's own choice: "
        "5,4,8 for Llama targets) or STEPS,TOPK,DRAFT_TOKENS",
    )
    what.add_argument("--tts-lr", type=float, help="--tts-lr for the TTS configurations (default: the server's)")
    what.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra launch flags for every server, e.g. --server-arg=--tts-scope=global",
    )
    what.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="TAG=FLAGS",
        help="named extra launch flags: a configuration name ending in +TAG gets FLAGS, e.g. "
        "--variant ctl='--tts-controller policy.json' --configs tts-s5 tts-s5+ctl",
    )
    what.add_argument(
        "--base-url", help="benchmark this running server instead (one configuration: name it with --configs)"
    )
    what.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="cpu adds the CPU launch flags")
    data = parser.add_argument_group("prompts and sampling")
    data.add_argument("--datasets", nargs="+", help=f"prompt sources (default: {' '.join(DEFAULT_DATASETS)})")
    data.add_argument("--num-prompts", type=int, default=None, help="prompts per dataset (default 4; all: 0)")
    data.add_argument("--seed", type=int, default=0, help="seed of the prompt sample")
    data.add_argument("--max-new-tokens", type=int, help="tokens per answer (default 2048)")
    data.add_argument(
        "--temperature",
        type=float,
        nargs="+",
        help="every prompt runs once per temperature, 0 = greedy (default: 0 0.7; smoke: 0)",
    )
    data.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1],
        help="requests in flight: each mode runs once per value; N > 1 sends waves of N requests (default 1)",
    )
    data.add_argument(
        "--sampling-seed",
        type=int,
        help="seed sampled requests (the same seed per prompt in every configuration; on CPU the same "
        "answer with or without speculation, so outputs are compared as greedy ones are; default: unseeded)",
    )
    data.add_argument("--top-p", type=float, default=1.0)
    data.add_argument("--top-k", type=int, default=-1)
    data.add_argument("--ignore-eos", action="store_true", default=None, help="always generate --max-new-tokens")
    data.add_argument(
        "--api",
        choices=("openai", "generate"),
        default="openai",
        help="openai: /v1/chat/completions through the openai client (default); generate: SGLang's /generate",
    )
    data.add_argument(
        "--stream",
        action="store_true",
        help="with --api generate: stream each response and record its time to first token (client-side)",
    )
    run = parser.add_argument_group("run and report")
    run.add_argument(
        "--rounds", type=int, help="prompt chunks, every configuration per chunk (default min(3, prompts))"
    )
    run.add_argument("--bucket", type=int, help="output-position bucket in tokens (default 256; smoke 32)")
    run.add_argument(
        "--reference",
        help="a configuration to compare every other one with (report: tokens/s as x this one, per concurrency); "
        "also with --from-json",
    )
    run.add_argument(
        "--warmup-tokens", type=int, help="unrecorded warm-up request per server (default 32, smoke 8; 0: none)"
    )
    run.add_argument(
        "--no-warm-prompts",
        action="store_true",
        help="at --concurrency > 1, do not prefill each wave's prompts (unrecorded) before its clock starts; "
        "a wave that repeats a prompt then shares its prefix or not as the requests happen to arrive",
    )
    run.add_argument(
        "--request-timeout",
        type=float,
        help="seconds to wait for one request (default: sized for --max-new-tokens at 0.5 tokens/s, at least 3600)",
    )
    run.add_argument("--server-timeout", type=float, default=900.0, help="seconds for a server to become healthy")
    run.add_argument("--out", type=Path, default=Path("results"), help="parent folder of the run folder")
    run.add_argument("--run", help="run folder name (default: a timestamp)")
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted run --run NAME: keep its finished requests, send only the missing ones. "
        "Its plan is read from the run folder: give no other plan flags, or exactly the same ones "
        f"(may change: {', '.join('--' + f.replace('_', '-') for f in SESSION_FLAGS[1:])})",
    )
    run.add_argument(
        "--extend",
        action="store_true",
        help="with --resume: grow the run by --num-prompts (new prompts come after the saved ones) and --rounds, "
        "keeping every finished request (each saved prompt must stay in its round)",
    )
    run.add_argument("--smoke-dir", type=Path, help="where --smoke writes its tiny models (default: the cache)")
    run.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return parser


def _external_config(args: argparse.Namespace, server_info: dict) -> BenchConfig:
    """The one configuration a --base-url run measures, named by --configs (checked against the server)."""
    speculative = server_info.get("speculative_algorithm") is not None
    names = args.configs or (["no-spec"] if not speculative else [])
    if len(names) != 1:
        raise ConfigError("--base-url measures one configuration: name it with --configs, e.g. eagle3:tts-s5")
    return external_config(names[0], server_info, args.drafter_kind[0] if args.drafter_kind else None)


def plan_from_args(args: argparse.Namespace, argv: list[str]) -> BenchPlan:
    """Resolve models, drafters, prompts and configurations (smoke defaults where flags are absent)."""
    temperatures = tuple(args.temperature or ((0.0,) if args.smoke else DEFAULT_TEMPERATURES))
    if any(t < 0 for t in temperatures) or len(set(temperatures)) != len(temperatures):
        raise ConfigError(f"--temperature: distinct values >= 0 please, got {' '.join(map(str, temperatures))}")
    concurrencies = tuple(args.concurrency)
    if any(c < 1 for c in concurrencies) or len(set(concurrencies)) != len(concurrencies):
        raise ConfigError(f"--concurrency: distinct values >= 1 please, got {' '.join(map(str, concurrencies))}")
    sampling = SamplingSettings(
        max_new_tokens=args.max_new_tokens or (smoke.MAX_NEW_TOKENS if args.smoke else 2048),
        temperature=temperatures[0],
        top_p=args.top_p,
        top_k=args.top_k,
        ignore_eos=bool(args.ignore_eos if args.ignore_eos is not None else args.smoke),
        seed=args.sampling_seed,
    )
    run_name = args.run or time.strftime("%Y%m%d-%H%M%S") + ("-smoke" if args.smoke else "")
    settings: dict = {}
    server_info = None
    tts_lr = args.tts_lr if args.tts_lr is not None else (smoke.TTS_LR if args.smoke else None)
    kinds = list(args.drafter_kind or (smoke.KINDS if args.smoke else ("eagle3",)))
    names = list(args.configs or (smoke.CONFIGS if args.smoke else DEFAULT_CONFIGS))
    for name in names:  # refuse a bad name before preparing models or contacting servers
        parse_config_name(name)
    shape = parse_eagle3_shape(args.eagle3_shape)
    variants = parse_variants(args.variant)

    if args.smoke:
        models = smoke.prepare_smoke_models(args.smoke_dir)
        model = str(models.target)
        drafters = {**models.drafters, **parse_drafter_args(args.drafter, kinds)}
    elif args.base_url:
        try:
            server_info = get_json(args.base_url.rstrip("/") + "/server_info")
        except OSError as error:  # URLError, refused, timeout
            raise ConfigError(f"--base-url {args.base_url}: cannot read /server_info ({error})") from None
        model = args.model or server_info.get("tokenizer_path") or server_info.get("model_path")
        drafters = {}
    else:
        from sglang_tts.assets import resolve_model

        model = str(resolve_model(args.model))
        wanted = kinds_needed(names, kinds)
        drafters = resolve_drafters(wanted, parse_drafter_args(args.drafter, kinds), Path(model).name)

    if args.base_url:
        configs = [_external_config(args, server_info or {})]
    else:
        extra = split_server_args(args.server_arg)
        configs = build_configs(
            names, kinds, drafters, tts_lr=tts_lr, extra_server_args=extra, eagle3_shape=shape, variants=variants
        )

    if args.reference:
        settings["reference"] = resolve_reference(args.reference, [c.name for c in configs])

    # /generate sends token ids: apply the chat template here, with the target's tokenizer.
    tokenizer = model if args.api == "generate" else None
    if args.smoke and not args.datasets:
        # The tiny model is no instruction follower: the bare text, no reasoning instruction.
        prompts = chat_prompts(list(smoke.PROMPTS), tokenizer, instruction=None)
        settings["datasets"] = ", ".join(dict.fromkeys(p.dataset for p in smoke.PROMPTS))
    else:
        datasets = list(args.datasets or DEFAULT_DATASETS)
        n = None if args.num_prompts == 0 else (args.num_prompts or 4)
        prompts = chat_prompts(sample_prompts(datasets, n, args.seed), tokenizer)
        settings["datasets"] = ", ".join(datasets)
        settings["prompts per dataset"] = n if n is not None else "all"
        settings["seed"] = args.seed

    settings.update(
        {
            "model": model,
            "drafters": ", ".join(f"{k}={v}" for k, v in drafters.items()) or "none",
            "prompts": len(prompts),
            "max_new_tokens": sampling.max_new_tokens,
            "temperatures": ", ".join(f"{t:g}" for t in temperatures),
            "concurrency": ", ".join(map(str, concurrencies)),
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "ignore_eos": sampling.ignore_eos,
            "sampling_seed": sampling.seed if sampling.seed is not None else "none",
            "api": "/v1/chat/completions (openai client)"
            if args.api == "openai"
            else "/generate (token ids" + (", streamed)" if args.stream else ")"),
            "tts_lr": tts_lr if tts_lr is not None else "server default",
            "eagle3_shape": args.eagle3_shape,
            "smoke": args.smoke,
        }
    )
    rounds = args.rounds or (1 if args.smoke else min(3, len(prompts)))
    kv_tokens = None
    if not args.base_url:
        lengths = dict(zip([p.id for p in prompts], prompt_token_counts(prompts, model)))
        check_context(configs, model, max(lengths.values(), default=0), sampling.max_new_tokens)
        if cpu_launch(args.device):
            # Enough KV cache for the largest wave, whole answers included: otherwise SGLang queues part of it
            # (CPU_DEFAULT_ARGS' pool holds one long request); a --server-arg=--max-total-tokens=N still wins.
            wave_lengths = [
                [lengths[p.id] for p in wave]
                for chunk in split_rounds(prompts, rounds)
                for c in concurrencies
                for wave in waves(chunk, c)
            ]
            kv_tokens = waves_kv_tokens(wave_lengths, sampling.max_new_tokens)
            settings["kv_pool_tokens"] = kv_tokens
    warmup = args.warmup_tokens if args.warmup_tokens is not None else (smoke.WARMUP_TOKENS if args.smoke else 32)
    runner = RunnerSettings(
        model=model,
        sampling=sampling,
        temperatures=temperatures,
        concurrencies=concurrencies,
        api=args.api,
        stream=args.stream,
        warmup_tokens=warmup,
        warm_prompts=not args.no_warm_prompts,
        request_timeout_s=args.request_timeout,
        server_timeout_s=args.server_timeout,
        cpu_defaults=cpu_launch(args.device),
        kv_tokens=kv_tokens,
        base_url=args.base_url.rstrip("/") if args.base_url else None,
        served_model=(server_info or {}).get("served_model_name"),
    )
    return BenchPlan(
        run_dir=args.out / run_name,
        argv=argv,
        configs=configs,
        prompts=prompts,
        runner=runner,
        rounds=rounds,
        bucket=args.bucket or (smoke.BUCKET if args.smoke else 256),
        settings=settings,
        server_info=server_info,
        progress=not args.quiet,
    )


def _given_flags(argv_tail: list[str]) -> set[str]:
    """The destinations of the flags a command line gives explicitly (defaults left out)."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv_tail)))


def resumed_args(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> argparse.Namespace:
    """--resume: the saved command's flags, with this command's session flags (SESSION_FLAGS), when it gives
    no plan flags; else this command line as it is (run_suite then checks it asks for the saved plan).
    --extend: the saved command with this command's EXTEND_FLAGS and session flags."""
    if not args.run:
        parser.error("--resume needs --run NAME: the run folder (under --out) to continue")
    saved = load_saved_plan(args.out / args.run)
    given = _given_flags(argv[1:])
    may_change = set(SESSION_FLAGS) | ({"extend", *EXTEND_FLAGS} if args.extend else set())
    if args.extend and given - may_change:
        flags = " ".join(sorted("--" + f.replace("_", "-") for f in given - may_change))
        parser.error(f"--extend grows the saved plan by --num-prompts and --rounds only; not by {flags}")
    if given - may_change:
        return args
    merged = parser.parse_args(saved["argv"][1:])
    for dest in given | {"run", "out", "resume"}:
        setattr(merged, dest, getattr(args, dest))
    return merged


def extended_argv(saved_argv: list[str], args: argparse.Namespace) -> list[str]:
    """The saved command with --num-prompts and --rounds set to ``args``' values: the grown run's command,
    which plan.json keeps for later resumes."""
    out, skip = [], False
    flags = {"--" + dest.replace("_", "-") for dest in EXTEND_FLAGS}
    for token in saved_argv:
        if skip:
            skip = False
        elif token in flags:
            skip = True
        elif token.split("=", 1)[0] not in flags:
            out.append(token)
    for dest in EXTEND_FLAGS:
        if getattr(args, dest) is not None:
            out += ["--" + dest.replace("_", "-"), str(getattr(args, dest))]
    return out


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _term_after_hook() -> Callable[[Unit, list[RequestRecord]], None] | None:
    """SGLANG_TTS_BENCH_TERM_AFTER=K: SIGTERM this process after K units were saved (a kill, for the tests)."""
    limit = int(os.environ.get(TERM_AFTER_ENV) or 0)
    if limit <= 0:
        return None
    count = 0

    def hook(unit: Unit, records: list[RequestRecord]) -> None:
        nonlocal count
        count += 1
        if count >= limit:
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


def _run(plan: BenchPlan, args: argparse.Namespace) -> int:
    """Run (or resume) the plan and print the report; on Ctrl-C or SIGTERM, say how to continue (130)."""
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # so the runner stops its server
    try:
        result = run_suite(plan, resume=args.resume, on_record=_term_after_hook(), extend=args.extend)
    except KeyboardInterrupt:
        again = ["python", "scripts/bench_long.py", "--resume", "--run", plan.run_dir.name]
        if args.out != Path("results"):
            again += ["--out", str(args.out)]
        print(
            f"[bench] stopped; every finished request is in {plan.run_dir / REQUESTS}. Continue with: "
            + shlex.join(again),
            file=sys.stderr,
        )
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(result.report.read_text())
    for line in summary_lines(result):
        print(line)
    return 1 if result.failures else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else [sys.argv[0], *argv])
    parser = build_parser()
    args = parser.parse_args(argv[1:])
    if args.stream and args.api != "generate":
        parser.error("--stream needs --api generate (the OpenAI path does not return meta_info when streaming)")
    if args.resume and args.from_json:
        parser.error("--resume continues a run; --from-json only re-aggregates one")
    try:
        if args.from_json:
            result = rerender(args.from_json, args.bucket, args.reference)
            print(result.report.read_text())
            for line in summary_lines(result):
                print(line)
            return 1 if result.failures else 0
        if args.extend and not args.resume:
            parser.error("--extend grows an existing run: use it with --resume --run NAME")
        if args.resume:
            args = resumed_args(parser, args, argv)
        if args.extend:
            argv = extended_argv(load_saved_plan(args.out / args.run)["argv"], args)
        plan = plan_from_args(args, argv)
        n_configs, n_prompts = len(plan.configs), len(plan.prompts)
        print(
            f"[bench] {n_configs} configurations x {n_prompts} prompts in {plan.rounds} round(s) -> {plan.run_dir}",
            file=sys.stderr,
        )
        return _run(plan, args)
    except ConfigError as error:
        parser.error(str(error))


if __name__ == "__main__":
    sys.exit(main())
