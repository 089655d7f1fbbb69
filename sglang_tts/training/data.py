"""The drafter training set: the target's own greedy answers to offline prompts.

Each prompt (``sglang_tts.data.prompts.load_prompts``) is rendered with the target's chat template
(``format_chat``: question + step-by-step instruction) and answered by the target with greedy
decoding, at most ``max_new_tokens`` new tokens (stopping at EOS, which is kept). A sequence is
the prompt ids followed by the answer ids; only answer tokens are ever predicted by the drafters,
the prompt is context. Generation runs in left-padded batches (fp32, CPU).

The set is cached with ``torch.save`` under a name derived from everything that shapes it (target
weights, prompt source, count, seed, lengths), and written after every generation batch, so an
interrupted build resumes where it stopped and a rerun costs nothing. Answers can also come from
another cached set of the same target, or from an exported file (``export_answers``: the answer ids
only, as a shipped drafter carries the answers it was trained on), so a fresh machine or a grown set
generates only what no set holds yet.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from sglang_tts.data.prompts import DEFAULT_INSTRUCTION, Prompt, format_chat, load_prompts
from sglang_tts.data.split import balanced_sample

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DATA_FORMAT = 1  # bump when the cached layout changes


@dataclass
class DataConfig:
    """What the generated training set is made of."""

    source: str = "math500"  # builtin set name, a workload part (workloads:held-in), a .jsonl path, or hf:<name>
    num_prompts: int = 256
    max_new_tokens: int = 256  # answer length cap: the sets are deliberately short
    max_prompt_tokens: int = 256  # longer prompts are skipped
    seed: int = 0
    batch_size: int = 16  # generation batch
    batch_prompt_tokens: int = 16384  # ...and at most this many prompt tokens per batch (long prompts batch small)
    instruction: str | None = DEFAULT_INSTRUCTION
    extra_source: str | None = None  # a second source added to the first one's prompts (e.g. code-edit)
    extra_prompts: int = 0  # how many of it (a seeded sample)

    @property
    def has_extra(self) -> bool:
        return self.extra_source is not None and self.extra_prompts > 0


@dataclass
class SequenceSet:
    """Token ids of prompt + greedy answer per sequence, and where each answer starts."""

    ids: list[torch.Tensor]  # int64 [L_i]
    prompt_lens: list[int]
    keys: list[str]  # Prompt.id of each sequence
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    def answer_ids(self) -> Iterator[torch.Tensor]:
        for ids, start in zip(self.ids, self.prompt_lens):
            yield ids[start:]

    def num_answer_tokens(self) -> int:
        return sum(len(ids) - start for ids, start in zip(self.ids, self.prompt_lens))

    def subset(self, indices: list[int]) -> SequenceSet:
        return SequenceSet(
            [self.ids[i] for i in indices],
            [self.prompt_lens[i] for i in indices],
            [self.keys[i] for i in indices],
            dict(self.meta),
        )

    def window_starts(self, context: int | None) -> list[int]:
        """Where each sequence's training window starts: at most `context` prompt tokens before
        the answer (None: the whole prompt)."""
        if context is None:
            return [0] * len(self)
        return [max(0, start - context) for start in self.prompt_lens]

    def windowed(self, context: int | None) -> SequenceSet:
        """The sequences cut to their training windows (see `window_starts`); the answers are kept whole."""
        starts = self.window_starts(context)
        return SequenceSet(
            [ids[s:] for ids, s in zip(self.ids, starts)],
            [n - s for n, s in zip(self.prompt_lens, starts)],
            list(self.keys),
            dict(self.meta),
        )

    def split_indices(self, eval_count: int, seed: int, among: int | None = None) -> tuple[list[int], list[int]]:
        """(train, held-out) indices: a seeded choice of `eval_count` of the first `among` sequences (default: all)
        is held out (at least one sequence always stays for training); the rest always train. With the extra
        source's sequences after the first source's, the held-out choice is the same with or without them."""
        among = len(self) if among is None else among
        eval_count = max(0, min(eval_count, among - 1))
        order = torch.randperm(among, generator=torch.Generator().manual_seed(seed)).tolist()
        return sorted(order[eval_count:] + list(range(among, len(self)))), sorted(order[:eval_count])


def fingerprint(payload: dict[str, Any]) -> str:
    """Short stable hash of a JSON-able dict (cache file names)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]


def target_identity(target_path: Path) -> dict[str, Any]:
    """What identifies a target checkpoint for caching: its config and the size of its weights."""
    weights = sorted(target_path.glob("*.safetensors")) or sorted(target_path.glob("*.bin"))
    return {
        "name": target_path.name,
        "config": fingerprint(json.loads((target_path / "config.json").read_text())),
        "weights": [(w.name, w.stat().st_size) for w in weights],
    }


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save through a temporary file, so an interrupted write never leaves a torn cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, prompt: Prompt, instruction: str | None) -> list[int]:
    """The chat-templated prompt with the generation prompt appended, as ids."""
    text = tokenizer.apply_chat_template(format_chat(prompt, instruction), add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    configured = model.generation_config.eos_token_id
    if configured is None:
        configured = tokenizer.eos_token_id
    ids = configured if isinstance(configured, list) else [configured]
    return [int(i) for i in ids if i is not None]


def prompt_pool(cfg: DataConfig) -> list[Prompt]:
    """The seeded sample of prompts the target answers (all of the source if it has fewer). A source that mixes
    datasets (``workloads:held-in``) is sampled evenly over them (:func:`balanced_sample`), so a small workload
    is not crowded out by a large one. ``extra_source`` adds a seeded sample of ``extra_prompts`` of its prompts
    after those (the first source's sample is the same with or without it)."""
    prompts = load_prompts(cfg.source)
    n = min(cfg.num_prompts, len(prompts))
    if len({p.dataset for p in prompts}) > 1:
        pool = balanced_sample(prompts, n, cfg.seed)
    else:
        pool = load_prompts(cfg.source, n, seed=cfg.seed)
    if not cfg.has_extra:
        return pool
    available = len(load_prompts(cfg.extra_source))
    extra = load_prompts(cfg.extra_source, min(cfg.extra_prompts, available), seed=cfg.seed)
    taken = {p.id for p in pool}
    return pool + [p for p in extra if p.id not in taken]


def write_prompt_split(path: Path, pool: list[Prompt], keys: list[str]) -> Path:
    """The prompts of ``pool`` (:func:`prompt_pool`) behind ``keys`` as JSONL (id, question, answer): a prompt
    file the benchmark reads, so acceptance can be measured on exactly the prompts a drafter was trained on
    (held in) or not."""
    by_id = {p.id: p for p in pool}
    rows = [{"id": k, "question": by_id[k].question, "answer": by_id[k].answer} for k in keys]
    for row in rows:
        if by_id[row["id"]].self_contained:
            row["self_contained"] = True  # the benchmark then adds no instruction either
    lines = [json.dumps(row) for row in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


@torch.no_grad()
def greedy_answers(
    model: PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    pad_id: int,
    eos_ids: list[int],
) -> list[list[int]]:
    """Greedy answers to a batch of prompt id lists (left padded), each cut after its first EOS."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention[row, width - len(ids) :] = 1
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        pad_token_id=pad_id,
        eos_token_id=eos_ids,
    )
    answers = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, tok in enumerate(row) if tok in eos_ids), len(row))
        answers.append(row[:cut])
    return answers


def generation_batches(
    todo: list[tuple[str, list[int]]], batch_size: int, batch_prompt_tokens: int
) -> Iterator[list[tuple[str, list[int]]]]:
    """Consecutive batches of at most batch_size prompts whose padded size (batch x longest prompt)
    stays within batch_prompt_tokens; a prompt longer than the budget goes alone."""
    start = 0
    while start < len(todo):
        end = start + 1
        longest = len(todo[start][1])
        while end < len(todo) and end - start < batch_size:
            longest = max(longest, len(todo[end][1]))
            if (end - start + 1) * longest > batch_prompt_tokens:
                break
            end += 1
        yield todo[start:end]
        start = end


ANSWER_SHAPING = ("format", "target", "max_new_tokens", "instruction")  # what a greedy answer depends on


def prompt_digest(ids: list[int]) -> str:
    """A short hash of a prompt's token ids: exported answers name their prompt by it, not by its ids."""
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


@dataclass
class AnswerSet:
    """Greedy answers another set holds, by prompt: what `reuse_answers` can take from it."""

    shaping: str  # fingerprint of the ANSWER_SHAPING settings they were made with
    keys: list[str]
    prompt_lens: list[int]
    prompt_digests: list[str]
    answers: list[torch.Tensor]  # int64 [A_i]: the answer ids only


def shaping_fingerprint(meta: dict[str, Any]) -> str:
    return fingerprint({name: meta.get(name) for name in ANSWER_SHAPING})


def read_answer_set(path: Path) -> AnswerSet:
    """The answers of a cached set (``*-seqs-*.pt``) or of an exported file (`export_answers`, safetensors)."""
    if path.suffix == ".pt":
        saved = torch.load(path, map_location="cpu", weights_only=True)
        starts = [int(n) for n in saved["prompt_lens"]]
        return AnswerSet(
            shaping_fingerprint(saved["meta"]),
            list(saved["keys"]),
            starts,
            [prompt_digest(ids[:n].tolist()) for ids, n in zip(saved["ids"], starts)],
            [ids[n:] for ids, n in zip(saved["ids"], starts)],
        )
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        header = f.metadata()
    lens = tensors["answer_lens"].tolist()
    return AnswerSet(
        header["shaping"],
        json.loads(header["keys"]),
        tensors["prompt_lens"].tolist(),
        json.loads(header["prompt_digests"]),
        [a.long() for a in tensors["answers"].split(lens)],
    )


def export_answers(cache_file: Path, path: Path) -> dict[str, int]:
    """Write the answers of the cached set `cache_file` compactly to `path` (safetensors: the answer ids as one
    int32 tensor; the keys, prompt digests and answer-shaping fingerprint in its header). Prompts are not stored:
    they are rendered again from their source and must match the digest. A fresh machine whose cache lacks
    the set then generates none of these answers (`build_sequence_set(..., exported=[path])`)."""
    got = read_answer_set(Path(cache_file))
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        "answers": torch.cat(got.answers).to(torch.int32),
        "answer_lens": torch.tensor([len(a) for a in got.answers], dtype=torch.int64),
        "prompt_lens": torch.tensor(got.prompt_lens, dtype=torch.int64),
    }
    header = {"shaping": got.shaping, "keys": json.dumps(got.keys), "prompt_digests": json.dumps(got.prompt_digests)}
    save_file(tensors, str(path), metadata=header)
    return {"sequences": len(got.keys), "answer_tokens": int(tensors["answers"].numel())}


def reuse_answers(
    sources: Sequence[Path],
    meta: dict[str, Any],
    encoded: list[tuple[str, list[int]]],
    done: dict[str, tuple[torch.Tensor, int]],
) -> int:
    """Fill ``done`` with answers other sets already hold (cached sets of the same target, exported files): a set
    made with the same answer-shaping settings (``ANSWER_SHAPING``) whose sequence has the same key and the same
    prompt ids (length and digest). Greedy answers depend on nothing else, so a set that adds prompts to an
    older one generates only the new ones. Returns how many were reused."""
    wanted = {key: ids for key, ids in encoded if key not in done}
    shaping = shaping_fingerprint(meta)
    count = 0
    for source in sources:
        if not wanted:
            break
        other = read_answer_set(source)
        if other.shaping != shaping:
            continue
        for key, start, digest, answer in zip(other.keys, other.prompt_lens, other.prompt_digests, other.answers):
            prompt = wanted.get(key)
            if prompt is not None and start == len(prompt) and digest == prompt_digest(prompt):
                done[key] = (torch.cat([torch.tensor(prompt, dtype=torch.long), answer]), start)
                del wanted[key]
                count += 1
    return count


def build_sequence_set(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    target_path: Path,
    cfg: DataConfig,
    cache_dir: Path,
    progress: bool = True,
    exported: Sequence[Path] = (),
) -> SequenceSet:
    """Generate (or load from cache / resume) the training set; see the module docstring. Answers found in other
    cached sets of the target or in the `exported` answer files (`export_answers`) are not generated again."""
    meta = {"format": DATA_FORMAT, "target": target_identity(target_path), **asdict(cfg)}
    meta.pop("batch_size")  # neither changes the greedy answers' meaning
    meta.pop("batch_prompt_tokens")
    if not cfg.has_extra:  # sets made before the option keep their names
        meta.pop("extra_source")
        meta.pop("extra_prompts")
    cache_file = cache_dir / f"{target_path.name}-seqs-{fingerprint(meta)}.pt"

    done: dict[str, tuple[torch.Tensor, int]] = {}
    if cache_file.is_file():
        saved = torch.load(cache_file, map_location="cpu", weights_only=True)
        done = {k: (ids, int(n)) for k, ids, n in zip(saved["keys"], saved["ids"], saved["prompt_lens"])}
        logger.info("loaded %d cached sequences from %s", len(done), cache_file)

    prompts = prompt_pool(cfg)
    encoded: list[tuple[str, list[int]]] = []
    for prompt in prompts:
        ids = prompt_token_ids(tokenizer, prompt, cfg.instruction)
        if len(ids) > cfg.max_prompt_tokens:
            logger.warning(
                "skipping prompt %s: %d tokens > max_prompt_tokens %d", prompt.id, len(ids), cfg.max_prompt_tokens
            )
            continue
        encoded.append((prompt.id, ids))

    others = [f for f in sorted(cache_dir.glob(f"{target_path.name}-seqs-*.pt")) if f != cache_file]

    def save() -> None:
        keys = [k for k, _ in encoded if k in done]
        atomic_save(
            {"meta": meta, "keys": keys, "ids": [done[k][0] for k in keys], "prompt_lens": [done[k][1] for k in keys]},
            cache_file,
        )

    reused = reuse_answers([*others, *exported], meta, encoded, done)
    if reused:
        logger.info("reused %d answers from other cached sets of this target or exported files", reused)
        save()
    todo = sorted((item for item in encoded if item[0] not in done), key=lambda item: len(item[1]))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids(model, tokenizer)[0]
    eos_ids = eos_token_ids(model, tokenizer)
    model.eval()
    bar = tqdm(
        total=len(encoded), initial=len(encoded) - len(todo), desc="generating", unit="prompt", disable=not progress
    )
    for chunk in generation_batches(todo, cfg.batch_size, cfg.batch_prompt_tokens):
        answers = greedy_answers(model, [ids for _, ids in chunk], cfg.max_new_tokens, pad_id, eos_ids)
        for (key, ids), answer in zip(chunk, answers):
            done[key] = (torch.tensor(ids + answer, dtype=torch.long), len(ids))
        save()
        bar.update(len(chunk))
    bar.close()

    keys = [k for k, _ in encoded]
    return SequenceSet([done[k][0] for k in keys], [done[k][1] for k in keys], keys, {**meta, "cache": str(cache_file)})
