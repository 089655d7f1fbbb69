"""Named server configurations of the benchmark and the drafters they serve.

Names (``--configs``): ``no-spec`` (the plain target), ``ngram`` (SGLang's own ``NGRAM`` speculation: drafts
looked up in a trie of the text generated so far, no drafter model: the baseline a user picks instead of
training one; shape in ``NGRAM_ARGS``), ``stock`` (SGLang's own ``EAGLE3`` or ``DFLASH``
algorithm with the same drafter: the throughput baseline without the plugin's worker), ``frozen`` (TTS
with ``--tts-freeze``: the same code path as TTS with no updates, tested equal to stock EAGLE3/DFLASH in
acceptance, and it reports per-round accept lengths, which stock servers do not), ``tts-s{S}``
(``--tts-update-stride S``) and ``tts-s{S}-sync`` (``--tts-sync`` too). A TTS name may end in a scope:
``-batch`` / ``-global`` (``--tts-scope``) or ``-request[-r{R}]`` / ``-group[-r{R}]`` (per-request or
per-group adapters, ``--tts-scope request|group --tts-adapter-rank R``; ``-rfull``: dense per-request
deltas), e.g. ``tts-s5-request-r8``: the per-request adaptation comparison (issue 9) runs every scope on
one server schedule. Without a suffix the server's
default scope applies. A name that serves a drafter (all but no-spec and ngram) applies to
every ``--drafter-kind``; ``KIND:NAME`` (e.g. ``eagle3:tts-s5``) to that kind only. Full names are
``no-spec``, ``ngram`` and ``KIND:NAME``.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sglang_tts.assets import cache_root
from sglang_tts.bench.server import context_length_arg, context_shortfall, model_context_length
from sglang_tts.config import ADAPTER_SCOPES, SCOPES
from sglang_tts.drafters.shipped import shipped_drafter

KINDS = ("eagle3", "dflash")
STRIDES = (1, 2, 5, 10, 20)
STOCK_ALGORITHM = {"eagle3": "EAGLE3", "dflash": "DFLASH"}
DEFAULT_CONFIGS = ("no-spec", "stock", "frozen", *(f"tts-s{s}" for s in STRIDES), "tts-s1-sync", "tts-s5-sync")
# EAGLE-3 draft shapes (steps, top-k, draft tokens). "chain" (3 drafts, 4 verified tokens) is the demo's
# and the serving tests'; "sglang" passes no shape flags, so SGLang picks its own default (for Llama
# targets such as SmolLM2: 5 steps, top-k 4, 8 draft tokens: a tree).
EAGLE3_SHAPES: dict[str, tuple[int, int, int] | None] = {"chain": (3, 1, 4), "sglang": None}


def parse_eagle3_shape(text: str) -> tuple[int, int, int] | None:
    """``chain``, ``sglang`` or ``STEPS,TOPK,DRAFT_TOKENS`` (e.g. ``5,4,8``) -> the shape (None: SGLang's)."""
    if text in EAGLE3_SHAPES:
        return EAGLE3_SHAPES[text]
    try:
        steps, topk, tokens = (int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(
            f"EAGLE-3 shape {text!r}: use chain, sglang or STEPS,TOPK,DRAFT_TOKENS (e.g. 5,4,8)"
        ) from None
    if min(steps, topk, tokens) < 1:
        raise ConfigError(f"EAGLE-3 shape {text!r}: every number must be >= 1")
    return steps, topk, tokens


# SGLang's NGRAM speculation, shaped like the EAGLE-3 "chain": 4 verified tokens per round (the last committed
# token and 3 drafted ones), one continuation per trie node (breadth 1: a chain, no tree). SGLang's own default
# verifies 12 tokens in a tree of breadth up to 10; `--variant` flags override these (they come last).
NGRAM_DRAFT_TOKENS = 4
NGRAM_MAX_BFS_BREADTH = 1
NGRAM_ARGS = (
    "--speculative-algorithm",
    "NGRAM",
    "--speculative-num-draft-tokens",
    str(NGRAM_DRAFT_TOKENS),
    "--speculative-ngram-max-bfs-breadth",
    str(NGRAM_MAX_BFS_BREADTH),
)
# Tags every run knows without --variant: `frozen+hybrid`, `tts+hybrid`, `tts-s2+hybrid` (hybrid drafting:
# the suffix proposer's chain where it beats the drafter's, sglang/hybrid.py).
BUILTIN_VARIANTS: dict[str, tuple[str, ...]] = {"hybrid": ("--tts-hybrid", "on")}
# Configurations that serve no drafter: one server each, never per kind, and no kind prefix.
DRAFTERLESS = ("no-spec", "ngram")


def eagle3_shape_args(shape: tuple[int, int, int] | None) -> list[str]:
    if shape is None:
        return []
    steps, topk, tokens = shape
    return [
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        str(topk),
        "--speculative-num-draft-tokens",
        str(tokens),
    ]


_TAG = r"[A-Za-z0-9_.-]+"  # a --variant tag, as written after "+" in a configuration name
_NAME = re.compile(
    r"^(?:(?P<kind>[a-z0-9]+):)?"
    r"(?P<base>no-spec|ngram|stock|frozen|tts(?:-s(?P<stride>[0-9]+))?(?P<sync>-sync)?"
    rf"(?:-(?P<scope>{'|'.join(SCOPES)})(?:-r(?P<rank>[0-9]+|full))?)?)"
    rf"(?P<tags>(?:\+{_TAG})*)$"
)


class ConfigError(ValueError):
    """A configuration name, drafter or argument that cannot be used; the message says what would."""


@dataclass(frozen=True)
class ConfigSpec:
    """One parsed ``--configs`` entry; ``kind`` None means every requested drafter kind."""

    variant: str  # "no-spec" | "ngram" | "stock" | "frozen" | "tts"
    kind: str | None = None
    stride: int | None = None  # "tts": None leaves the stride to the update budget (--tts-update-budget)
    sync: bool = False
    scope: str | None = None  # --tts-scope; None: the server's default
    adapter_rank: int | str | None = None  # --tts-adapter-rank: R or "full" (scope "request" only)
    tags: tuple[str, ...] = ()  # "+TAG" suffixes: extra launch flags defined with --variant TAG=FLAGS

    @property
    def base_name(self) -> str:
        name = self.variant
        if self.variant == "tts":
            name = ("tts" if self.stride is None else f"tts-s{self.stride}") + ("-sync" if self.sync else "")
            if self.scope is not None:
                name += f"-{self.scope}"
            if self.adapter_rank is not None:
                name += f"-r{self.adapter_rank}"
        return name + "".join(f"+{tag}" for tag in self.tags)

    @property
    def needs_drafter(self) -> bool:
        """Whether the configuration serves a drafter (so it runs once per drafter kind)."""
        return self.variant not in DRAFTERLESS


@dataclass(frozen=True)
class BenchConfig:
    """A server configuration: what to launch and how to label its results."""

    name: str  # "no-spec", "ngram" (each maybe with +TAGs) or "KIND:base_name"
    variant: str  # "no-spec" | "ngram" | "stock" | "frozen" | "tts"
    kind: str | None = None
    drafter: str | None = None
    stride: int | None = None
    sync: bool = False
    server_args: tuple[str, ...] = field(default_factory=tuple)
    scope: str | None = None  # --tts-scope of a TTS configuration (None: the server's default)

    @property
    def base_name(self) -> str:
        return self.name.split(":", 1)[-1]

    @property
    def speculative(self) -> bool:
        return self.variant != "no-spec"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["server_args"] = list(self.server_args)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BenchConfig:
        return cls(**{**data, "server_args": tuple(data.get("server_args", ()))})


def parse_config_name(text: str) -> ConfigSpec:
    """``frozen``, ``tts-s5``, ``eagle3:tts-s5-sync``, ``no-spec``, ``ngram`` -> :class:`ConfigSpec`."""
    match = _NAME.match(text.strip())
    if match is None:
        raise ConfigError(
            f"unknown configuration {text!r}: use no-spec, ngram, stock, frozen, tts (the update budget picks the "
            f"stride), tts-s<S> or tts-s<S>-sync, a TTS "
            f"name optionally ending in a scope (-batch, -global, -request[-r<R>], -group[-r<R>]), any name but "
            f"no-spec and ngram optionally prefixed by a drafter kind ({', '.join(KINDS)}), "
            f"e.g. eagle3:tts-s5-request-r8"
        )
    kind = match["kind"]
    if kind is not None and kind not in KINDS:
        raise ConfigError(f"{text!r}: unknown drafter kind {kind!r} (use {', '.join(KINDS)})")
    base = match["base"]
    tags = tuple(tag for tag in match["tags"].split("+") if tag)
    if base in DRAFTERLESS:
        if kind is not None:
            raise ConfigError(f"{text!r}: {base} serves no drafter, so it takes no kind prefix")
        return ConfigSpec(base, tags=tags)
    if base in ("stock", "frozen"):
        return ConfigSpec(base, kind, tags=tags)
    stride = None if match["stride"] is None else int(match["stride"])
    if stride is not None and stride < 1:
        raise ConfigError(f"{text!r}: the update stride must be >= 1")
    scope, rank = match["scope"], match["rank"]
    if rank is not None and scope not in ADAPTER_SCOPES:
        raise ConfigError(
            f"{text!r}: an adapter rank (-r<R>) only goes with the request or group scope (-request-r<R>, -group-r<R>)"
        )
    if rank is not None and rank != "full" and int(rank) < 1:
        raise ConfigError(f"{text!r}: the adapter rank must be >= 1 (or full)")
    if rank is not None and rank != "full":
        rank = int(rank)
    return ConfigSpec("tts", kind, stride, bool(match["sync"]), scope, rank, tags)


def resolve_reference(text: str, names: Sequence[str]) -> str:
    """``--reference``: a configuration's full name (``eagle3:tts-s2+best``), or its name without the kind
    prefix when that is unambiguous (``tts-s2+best``) -> the full name."""
    if text in names:
        return text
    matches = [name for name in names if name.split(":", 1)[-1] == text]
    if len(matches) == 1:
        return matches[0]
    what = "names several configurations" if matches else "is not one of the configurations"
    raise ConfigError(f"--reference {text!r} {what}: use one of {', '.join(names)}")


def split_server_args(values: Iterable[str]) -> tuple[str, ...]:
    """``--server-arg`` values, each possibly several shell words ("--tts-scope global"), as one argv list."""
    return tuple(word for value in values for word in shlex.split(value))


def parse_variants(values: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """``--variant TAG=FLAGS`` values -> {tag: argv words}; ``frozen+TAG`` / ``tts-s5+TAG`` then add FLAGS."""
    out: dict[str, tuple[str, ...]] = {}
    for value in values:
        tag, sep, flags = value.partition("=")
        if not sep or not re.fullmatch(_TAG, tag):
            raise ConfigError(f"--variant {value!r}: write TAG=FLAGS, e.g. ctl='--tts-controller policy.json'")
        if tag in out:
            raise ConfigError(f"--variant {tag} is defined twice")
        out[tag] = tuple(shlex.split(flags))
    return out


def tts_server_args(
    spec: ConfigSpec,
    drafter: Path,
    kind: str,
    tts_lr: float | None,
    eagle3_shape: tuple[int, int, int] | None = EAGLE3_SHAPES["chain"],
) -> list[str]:
    """Launch flags of one speculative configuration (before the user's ``--server-arg`` extras)."""
    algorithm = STOCK_ALGORITHM[kind] if spec.variant == "stock" else "TTS"
    args = ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(drafter)]
    if kind == "eagle3":
        args += eagle3_shape_args(eagle3_shape)
    if spec.variant == "stock":
        return args
    if spec.variant == "frozen":
        return [*args, "--tts-freeze"]
    if spec.stride is not None:
        args += ["--tts-update-stride", str(spec.stride)]
    if tts_lr is not None:
        args += ["--tts-lr", repr(tts_lr)]
    if spec.sync:
        args.append("--tts-sync")
    if spec.scope is not None:
        args += ["--tts-scope", spec.scope]
    if spec.adapter_rank is not None:
        args += ["--tts-adapter-rank", str(spec.adapter_rank)]
    return args


def build_configs(
    names: Sequence[str],
    kinds: Sequence[str],
    drafters: Mapping[str, Path],
    *,
    tts_lr: float | None = None,
    extra_server_args: Sequence[str] = (),
    eagle3_shape: tuple[int, int, int] | None = EAGLE3_SHAPES["chain"],
    variants: Mapping[str, Sequence[str]] | None = None,
) -> list[BenchConfig]:
    """Expand ``--configs`` over ``--drafter-kind`` into launchable configurations, in a stable order.

    Order: the configurations without a drafter (no-spec, ngram) in the order given, then per kind (in
    ``kinds`` order) the names in the order given. Duplicates collapse.
    ``drafters`` maps each kind that a drafter-serving configuration needs to its checkpoint folder.
    ``extra_server_args`` go after the generated flags (so they override them) on every configuration;
    a name's ``+TAG`` flags (``variants[TAG]``) go last.
    """
    specs = [parse_config_name(name) for name in names]
    variants = {**BUILTIN_VARIANTS, **(variants or {})}
    for spec in specs:
        missing = [tag for tag in spec.tags if tag not in variants]
        if missing:
            raise ConfigError(
                f"configuration {spec.base_name} uses +{missing[0]}, which no --variant defines "
                f"(add --variant {missing[0]}='--some-flag value')"
            )

    def tagged(spec: ConfigSpec) -> tuple[str, ...]:
        return tuple(word for tag in spec.tags for word in variants[tag])

    for spec in specs:
        if spec.kind is not None and spec.kind not in kinds:
            raise ConfigError(f"configuration {spec.kind}:{spec.base_name} names a kind missing from --drafter-kind")
    extra = tuple(extra_server_args)
    configs: dict[str, BenchConfig] = {}
    for spec in specs:
        if not spec.needs_drafter:
            own = NGRAM_ARGS if spec.variant == "ngram" else ()
            args = (*own, *extra, *tagged(spec))
            configs[spec.base_name] = BenchConfig(spec.base_name, spec.variant, server_args=args)
    for kind in kinds:
        for spec in specs:
            if not spec.needs_drafter or spec.kind not in (None, kind):
                continue
            if kind not in drafters:
                raise ConfigError(f"no {kind} drafter given for configuration {kind}:{spec.base_name}")
            name = f"{kind}:{spec.base_name}"
            args = (*tts_server_args(spec, Path(drafters[kind]), kind, tts_lr, eagle3_shape), *extra, *tagged(spec))
            configs[name] = BenchConfig(
                name, spec.variant, kind, str(drafters[kind]), spec.stride, spec.sync, tuple(args), spec.scope
            )
    if not configs:
        raise ConfigError("no configuration selected (check --configs and --drafter-kind)")
    return list(configs.values())


def kinds_needed(names: Sequence[str], kinds: Sequence[str]) -> list[str]:
    """The drafter kinds that the selected configurations serve (no-spec and ngram need none)."""
    specs = [parse_config_name(name) for name in names]
    return [k for k in kinds if any(s.needs_drafter and s.kind in (None, k) for s in specs)]


# ----------------------------------------------------------------------------------------------------------
# Drafters
# ----------------------------------------------------------------------------------------------------------


def drafter_kind_of(path: Path) -> str | None:
    """The kind a drafter folder's config.json declares (the plugin's own rule), or None if unreadable."""
    from sglang_tts.drafters.loading import IncompatibleDrafterError, drafter_kind

    try:
        return drafter_kind(path)
    except (OSError, ValueError, IncompatibleDrafterError):
        return None


def parse_drafter_args(values: Sequence[str], kinds: Sequence[str]) -> dict[str, Path]:
    """``--drafter [KIND=]PATH`` values -> {kind: path}; a bare PATH needs exactly one kind."""
    out: dict[str, Path] = {}
    for value in values:
        kind, sep, path = value.partition("=")
        if sep and kind in KINDS:
            out[kind] = Path(path).expanduser()
        elif len(kinds) == 1:
            out[kinds[0]] = Path(value).expanduser()
        else:
            raise ConfigError(f"--drafter {value!r}: with several drafter kinds write KIND=PATH, e.g. eagle3=/path")
    return out


def drafters_root() -> Path:
    """Where scripts/train_drafter.py writes drafters by default: ``cache_root()/drafters``."""
    return cache_root() / "drafters"


def find_default_drafter(target_name: str, kind: str, root: Path | None = None) -> Path:
    """The project's trained ``kind`` drafter for ``target_name``: ``<root>/<target>-<kind>-<tag>``.

    scripts/train_drafter.py names its output folders that way (tag ``len<max-len>`` by default).
    Untrained folders (the demo's ``*-untrained*``) never count. Of several, the newest wins. With
    none in the default cache, the drafter that ships with the package for the target, if any.
    """
    shipped = shipped_drafter(target_name, kind) if root is None else None
    root = Path(root) if root is not None else drafters_root()
    candidates = [
        path
        for path in root.glob(f"{target_name}-{kind}-*")
        if "untrained" not in path.name and (path / "config.json").is_file() and drafter_kind_of(path) == kind
    ]
    if not candidates and shipped is not None:
        return shipped
    if not candidates:
        raise ConfigError(
            f"no trained {kind} drafter for {target_name} under {root} "
            f"(looked for {target_name}-{kind}-*/config.json).\n"
            f"Build one with `.venv/bin/python scripts/train_drafter.py --kind {kind}` (it writes "
            f"{root}/{target_name}-{kind}-len256 by default), or pass --drafter {kind}=PATH."
        )
    return max(candidates, key=lambda path: (path / "config.json").stat().st_mtime)


def resolve_drafters(
    kinds: Sequence[str], given: Mapping[str, Path], target_name: str, root: Path | None = None
) -> dict[str, Path]:
    """One checked drafter folder per kind: the given one, else the project's default."""
    out: dict[str, Path] = {}
    for kind in kinds:
        path = Path(given[kind]) if kind in given else find_default_drafter(target_name, kind, root)
        if not (path / "config.json").is_file():
            raise ConfigError(f"{kind} drafter {path} has no config.json")
        found = drafter_kind_of(path)
        if found != kind:
            raise ConfigError(f"{path} is not an {kind} drafter (its config.json declares {found or 'neither kind'})")
        out[kind] = path
    return out


def check_context(configs: Sequence[BenchConfig], model: str, longest_prompt: int, max_new_tokens: int) -> None:
    """Refuse a plan whose longest prompt and answer exceed a server's context (the model's, or the
    configuration's --context-length): SGLang would answer each such request with HTTP 400."""
    model_context: list[int | None] = []  # read once, when a configuration does not set its own
    for config in configs:
        context = context_length_arg(config.server_args)
        if context is None:
            model_context = model_context or [model_context_length(model)]
            context = model_context[0]
        problem = None if context is None else context_shortfall(context, longest_prompt, max_new_tokens)
        if problem:
            raise ConfigError(
                f"{config.name}: {problem}, and SGLang refuses longer requests. Lower --max-new-tokens, use a "
                "model with a longer context (Qwen2.5-Coder-0.5B-Instruct: 32768), or give "
                "--server-arg=--context-length=N (beyond the model's own, SGLang also wants "
                "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 in the environment)"
            )


def external_config(name: str | None, server_info: Mapping[str, Any], kind: str | None) -> BenchConfig:
    """The one configuration a --base-url run measures, named by --configs (checked against the server)."""
    algorithm = server_info.get("speculative_algorithm")
    if name is None and algorithm is not None:
        raise ConfigError(f"--base-url: the server speculates ({algorithm}): name its configuration with --configs")
    spec = parse_config_name(name or "no-spec")
    if (spec.variant != "no-spec") != (algorithm is not None) or (spec.variant == "ngram") != (algorithm == "NGRAM"):
        raise ConfigError(f"--configs {name} does not match the server (speculative_algorithm={algorithm})")
    kind = spec.kind or (kind if spec.needs_drafter else None)
    if spec.needs_drafter and kind is None:
        raise ConfigError("name the drafter kind of the running server: --configs KIND:NAME (e.g. eagle3:frozen)")
    full = spec.base_name if not spec.needs_drafter else f"{kind}:{spec.base_name}"
    draft = server_info.get("speculative_draft_model_path")
    return BenchConfig(full, spec.variant, kind, draft, spec.stride, spec.sync, scope=spec.scope)
