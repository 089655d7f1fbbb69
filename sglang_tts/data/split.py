"""Seeded held-in / held-out splits and balanced samples of prompt sets.

The split ranks the prompts of each group by ``sha256(f"{seed}:{id}")`` and holds out the lowest-ranked
share. A prompt's side therefore depends only on the seed, its id and its group's size: not on the order
the set was read in, not on Python's ``random`` implementation, and adding a prompt to one group never
moves a prompt of another group.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from sglang_tts.data.prompts import Prompt

T = TypeVar("T")


@dataclass(frozen=True)
class Split:
    """Held-in prompts (drafter training may use them) and held-out prompts (benchmarks only)."""

    held_in: tuple[Prompt, ...]
    held_out: tuple[Prompt, ...]


def interleave(groups: Sequence[Sequence[T]]) -> list[T]:
    """Round-robin over groups (a1, b1, a2, b2, ...; a group that runs out is passed over)."""
    return [group[i] for i in range(max((len(g) for g in groups), default=0)) for group in groups if i < len(group)]


def rank_key(seed: int, prompt_id: str) -> str:
    """The prompt's position in the seeded order (a hex digest: compared as a string)."""
    return hashlib.sha256(f"{seed}:{prompt_id}".encode()).hexdigest()


def held_out_count(size: int, fraction: float) -> int:
    """``round(fraction * size)``, but at least one held-out and one held-in prompt when the group has two."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"held-out fraction must be in (0, 1), got {fraction}")
    if size < 2:
        return 0
    return min(size - 1, max(1, round(fraction * size)))


def split_prompts(
    prompts: Sequence[Prompt],
    fraction: float,
    seed: int,
    group: Callable[[Prompt], str] = lambda prompt: prompt.dataset,
) -> Split:
    """Hold out ``fraction`` of each group (:func:`held_out_count`); both sides keep the input order."""
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"prompt ids must be unique to split them; repeated: {duplicates[:5]}")
    groups: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        groups.setdefault(group(prompt), []).append(prompt)
    out_ids: set[str] = set()
    for members in groups.values():
        ranked = sorted(members, key=lambda p: rank_key(seed, p.id))
        out_ids.update(p.id for p in ranked[: held_out_count(len(members), fraction)])
    return Split(
        held_in=tuple(p for p in prompts if p.id not in out_ids),
        held_out=tuple(p for p in prompts if p.id in out_ids),
    )


def balanced_sample(prompts: Sequence[Prompt], n: int, seed: int) -> list[Prompt]:
    """``n`` prompts spread as evenly as possible over their datasets, interleaved (a1, b1, c1, a2, ...).

    Each dataset gets an equal share; a dataset with fewer prompts gives all of them and the rest is shared
    by the others. Within a dataset the choice is a seeded random sample.
    """
    groups: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        groups.setdefault(prompt.dataset, []).append(prompt)
    if n > len(prompts):
        raise ValueError(f"asked for {n} prompts but the set has only {len(prompts)}")
    quota = dict.fromkeys(groups, 0)
    left = n
    while left:
        open_groups = [name for name in groups if quota[name] < len(groups[name])]
        share, extra = divmod(left, len(open_groups))
        for index, name in enumerate(open_groups):
            take = min(share + (index < extra), len(groups[name]) - quota[name])
            quota[name] += take
            left -= take
    return interleave([random.Random(seed).sample(groups[name], quota[name]) for name in groups])
