"""What one verify round hands to the drafter update.

A canvas is a batch of *chains*: for each request, the tokens the drafter consumed at each canvas
position and the target's distribution there. Tree drafts are reduced to a chain by the adapter
(the accepted path plus the next position, see docs/how-it-works.md, "Which canvas positions the loss uses").

Indexing convention (EAGLE-3 and DFlash alike). At a round anchored at verified token x_t
(the last token the target has accepted, whose target feature is not yet known):

    canvas position k = 0 .. C-1
    input_ids[:, k]      the token fed at position k: x_t, then the drafted d_1 .. d_{C-1}
    positions[:, k]      its absolute position in the sequence
    target_logits[:, k]  the target's logits for the token *after* input_ids[:, k],
                         i.e. p(X_{t+k+1} | x_{1:t}, d_{1:k}) from the verify forward

The teacher's vocabulary. A drafter that drafts in a reduced vocabulary (EAGLE-3's 8,192 of
Qwen's 151,936 ids) reads the target's logits at its own ids only, and drops positions whose target
top-1 lies outside them. Capture can do that reduction once (`TeacherVocab`): the canvas then holds
`target_logits` [B, C, V'] at `teacher_ids` and `valid` already excludes those positions, so the
canvases a stride's update keeps, stacks and trains on are V_target / V' times smaller.

Drafter-specific context lives in `features`/`context_*` (documented per drafter in
sglang_tts/drafters). Everything here is engine independent: plain tensors, no SGLang types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch


@dataclass
class Canvas:
    input_ids: torch.Tensor  # [B, C] int64
    positions: torch.Tensor  # [B, C] int64
    target_logits: torch.Tensor  # [B, C, V_target] float, teacher logits (temperature 1); [B, C, V'] at teacher_ids
    valid: torch.Tensor  # [B, C] bool: positions that enter the loss
    # Target hidden features the drafter conditions on.
    #  EAGLE-3: [B, F] aux hidden states (concat of 3 target layers) of the token before input_ids[:, 0]
    #  DFlash:  [B, L, F] aux hidden states of the last L context tokens (see context_mask)
    features: torch.Tensor
    # Detached drafter K/V of earlier context, per drafter layer: (k, v) each [B, H_kv, L, D],
    # keys already rotary-embedded; [1, H_kv, L, D] when every row reads one request's context
    # (stack_rounds at one request). None: the drafter attends only to what it recomputes.
    past_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    past_mask: torch.Tensor | None = None  # [B, L] bool, True where past_kv holds a real entry
    context_positions: torch.Tensor | None = None  # [B, L] int64 positions of `features` rows (DFlash)
    context_mask: torch.Tensor | None = None  # [B, L] bool for `features` rows (DFlash)
    num_accepted: torch.Tensor | None = None  # [B] int64 drafts accepted this round (bonus excluded)
    request_ids: list[str] = field(default_factory=list)
    # [B] int64 per-request adapter slot of each row (core/adapters.py; -1: none). None: no adapters.
    slots: torch.Tensor | None = None
    round_index: int = 0
    # [B] host ints: the entry of `past_kv` each row reads, which then holds one entry per request
    # ([R, H_kv, L, D]: stack_rounds at several requests). None: row i reads entry i (or the one entry).
    context_rows: list[int] | None = None
    # [V'] int64: the target ids target_logits' last dimension holds (TeacherVocab.ids; valid already
    # excludes positions whose target top-1 lies outside them). None: the whole target vocabulary.
    teacher_ids: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device | str) -> Canvas:
        """A copy on `device` (the executor moves canvases off the serving path's buffers)."""

        def mv(x):
            if x is None:
                return None
            if isinstance(x, torch.Tensor):
                return x.to(device)
            return [(k.to(device), v.to(device)) for k, v in x]

        return replace(
            self,
            input_ids=mv(self.input_ids),
            positions=mv(self.positions),
            target_logits=mv(self.target_logits),
            valid=mv(self.valid),
            features=mv(self.features),
            past_kv=mv(self.past_kv),
            past_mask=mv(self.past_mask),
            context_positions=mv(self.context_positions),
            context_mask=mv(self.context_mask),
            num_accepted=mv(self.num_accepted),
            request_ids=list(self.request_ids),
            slots=mv(self.slots),
            teacher_ids=mv(self.teacher_ids),
        )

    def prefix(self, length: int) -> Canvas:
        """The first `length` canvas positions (views; context, features and K/V as they are)."""
        n = max(1, min(length, self.length))
        return replace(
            self,
            input_ids=self.input_ids[:, :n],
            positions=self.positions[:, :n],
            target_logits=self.target_logits[:, :n],
            valid=self.valid[:, :n],
        )

    def detach_clone(self) -> Canvas:
        """A private copy: the serving path may reuse its buffers while an update still runs."""

        def cp(x):
            if x is None:
                return None
            if isinstance(x, torch.Tensor):
                return x.detach().clone()
            return [(k.detach().clone(), v.detach().clone()) for k, v in x]

        return replace(
            self,
            input_ids=cp(self.input_ids),
            positions=cp(self.positions),
            target_logits=cp(self.target_logits),
            valid=cp(self.valid),
            features=cp(self.features),
            past_kv=cp(self.past_kv),
            past_mask=cp(self.past_mask),
            context_positions=cp(self.context_positions),
            context_mask=cp(self.context_mask),
            num_accepted=cp(self.num_accepted),
            request_ids=list(self.request_ids),
            slots=cp(self.slots),
            context_rows=None if self.context_rows is None else list(self.context_rows),
        )

    def context_entries(self) -> list[int] | None:
        """The `past_kv` entry each row reads (host ints), or None: no context, or one entry every row reads."""
        if self.past_kv is None or (self.context_rows is None and self.past_kv[0][0].shape[0] == 1):
            return None
        return list(range(self.batch_size)) if self.context_rows is None else list(self.context_rows)

    def validate(self) -> None:
        b, c = self.input_ids.shape
        if self.positions.shape != (b, c):
            raise ValueError(f"positions {tuple(self.positions.shape)} != input_ids {(b, c)}")
        if self.target_logits.shape[:2] != (b, c):
            raise ValueError(f"target_logits {tuple(self.target_logits.shape)} does not match {(b, c)}")
        if self.valid.shape != (b, c) or self.valid.dtype != torch.bool:
            raise ValueError("valid must be a [B, C] bool tensor")
        if self.features.shape[0] != b:
            raise ValueError("features must have the batch dimension first")
        if self.context_rows is not None:
            entries = 0 if self.past_kv is None else self.past_kv[0][0].shape[0]
            if len(self.context_rows) != b or not all(0 <= r < entries for r in self.context_rows):
                raise ValueError(f"context_rows must name one of the {entries} past_kv entries for each of {b} rows")
        if self.teacher_ids is not None and self.target_logits.shape[-1] != self.teacher_ids.shape[0]:
            raise ValueError(
                f"target_logits hold {self.target_logits.shape[-1]} ids, teacher_ids {self.teacher_ids.shape[0]}"
            )


@dataclass(frozen=True)
class TeacherVocab:
    """The target ids a drafter's loss reads, for capture to keep only those (see the module docstring).

    Both tensors are made once, on the device of the target's verify logits, and read by every
    capture: no host read, no per-round allocation besides the gathered logits."""

    ids: torch.Tensor  # [V'] int64 target ids, in the drafter's vocabulary order
    covered: torch.Tensor  # [V_target] bool, True at `ids`

    def gather(self, target_logits: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `index` of the verify's logits at `ids`, and whether each row's target top-1 is one of them.

        target_logits: [N, V_target] the verify's logits; index: [M] int64 rows of them.
        Returns (logits [M, V'] float32, top1_covered [M] bool)."""
        ids, covered = self.ids.to(target_logits.device), self.covered.to(target_logits.device)
        # Column gather over the verify's N rows first (a few per request): no full-vocabulary row is copied.
        logits = target_logits.index_select(1, ids).index_select(0, index).float()
        top1 = target_logits.argmax(dim=-1).index_select(0, index)
        return logits, covered[top1]


def stack_rounds(earlier: Sequence[Canvas], latest: Canvas) -> Canvas:
    """One batch of `latest` (an update round's canvas) and the canvases of earlier rounds of the
    same stride window (`--tts-update-window`; EAGLE-3 layout, built without `past_kv`).

    An earlier row reads the K/V of its request's row in `latest`, masked to what that row read in
    its own round: the first `positions[:, 0] - 1` entries (EAGLE-3's canvas reads every drafter
    K/V entry before its anchor's row, and a live request's draft KV entries are never rewritten,
    so its prefix then is the prefix now). Rows of requests absent from `latest` (finished, or not
    in this batch) are dropped. Shorter canvases are padded (invalid positions). New tensors
    throughout, except `latest`'s K/V: they stay as they are, one entry per request, and
    `context_rows` says which entry each row reads (a [1, H_kv, L, D] K/V at one request needs no
    index: every row reads it). The drafters' attention reads each entry once for its rows, never a
    gathered copy per row (rows x context: ~200 MB of K and V per drafter layer at 64 rows of 3K);
    only the [rows, L] mask is per row.
    """
    row_of = {rid: i for i, rid in enumerate(latest.request_ids)}
    parts: list[tuple[Canvas, list[int]]] = []
    for canvas in earlier:
        keep = [i for i, rid in enumerate(canvas.request_ids) if rid in row_of]
        if keep:
            parts.append((canvas, keep))
    if not parts:
        return latest
    parts.append((latest, list(range(latest.batch_size))))
    if any((c.teacher_ids is None) != (latest.teacher_ids is None) for c, _ in parts):
        raise ValueError("stack_rounds: canvases of the whole target vocabulary and of a teacher vocabulary mixed")
    length = max(c.length for c, _ in parts)
    device = latest.input_ids.device

    def rows(c: Canvas, keep: list[int], t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, torch.tensor(keep, device=t.device)) if len(keep) != c.batch_size else t

    def padded(c: Canvas, keep: list[int], t: torch.Tensor, fill) -> torch.Tensor:
        t = rows(c, keep, t)
        if t.shape[1] == length:
            return t
        pad = t.new_full((t.shape[0], length - t.shape[1], *t.shape[2:]), fill)
        return torch.cat((t, pad), dim=1)

    def positions(c: Canvas, keep: list[int]) -> torch.Tensor:
        p = rows(c, keep, c.positions)
        step = torch.arange(1, length - p.shape[1] + 1, device=p.device)
        return torch.cat((p, p[:, -1:] + step), dim=1)  # RoPE positions keep increasing in padding

    with torch.inference_mode(False), torch.no_grad():
        past_kv = past_mask = context_rows = None
        if latest.past_kv is not None:
            source = [row_of[c.request_ids[i]] for c, keep in parts[:-1] for i in keep] + list(range(latest.batch_size))
            index = torch.tensor(source, device=device)
            past_kv = list(latest.past_kv)  # one entry per request, read through context_rows (not copied)
            if latest.past_kv[0][0].shape[0] != 1:
                context_rows = source if latest.context_rows is None else [latest.context_rows[r] for r in source]
            span = latest.past_kv[0][0].shape[2]
            mask = (
                latest.past_mask
                if latest.past_mask is not None
                else torch.ones(latest.batch_size, span, dtype=torch.bool, device=device)
            )
            past_mask = mask.index_select(0, index)
            own = torch.cat([rows(c, keep, c.positions)[:, 0] - 1 for c, keep in parts[:-1]])
            n_earlier = own.shape[0]
            past_mask[:n_earlier] &= torch.arange(span, device=device)[None] < own.to(device)[:, None]
        stacked = Canvas(
            input_ids=torch.cat([padded(c, k, c.input_ids, 0) for c, k in parts]),
            positions=torch.cat([positions(c, k) for c, k in parts]),
            target_logits=torch.cat([padded(c, k, c.target_logits, 0.0) for c, k in parts]),
            valid=torch.cat([padded(c, k, c.valid, False) for c, k in parts]),
            features=torch.cat([rows(c, k, c.features) for c, k in parts]),
            past_kv=past_kv,
            past_mask=past_mask,
            num_accepted=None
            if any(c.num_accepted is None for c, _ in parts)
            else torch.cat([rows(c, k, c.num_accepted) for c, k in parts]),
            request_ids=[c.request_ids[i] for c, keep in parts for i in keep],
            slots=None if latest.slots is None else torch.cat([rows(c, k, c.slots) for c, k in parts]),
            round_index=latest.round_index,
            teacher_ids=latest.teacher_ids,
            context_rows=context_rows,
        )
    stacked.validate()
    return stacked


def _storage(cells: int, vocab: int, feature_shape: tuple[int, ...], device: torch.device) -> dict[str, torch.Tensor]:
    """Flat storage for `cells` canvas positions (and as many feature rows), outside inference mode."""
    with torch.inference_mode(False):
        return {
            "input_ids": torch.zeros(cells, dtype=torch.long, device=device),
            "positions": torch.zeros(cells, dtype=torch.long, device=device),
            "valid": torch.zeros(cells, dtype=torch.bool, device=device),
            "target_logits": torch.zeros(cells, vocab, dtype=torch.float32, device=device),
            "features": torch.zeros(cells, *feature_shape, dtype=torch.float32, device=device),
        }


def _views(store: dict[str, torch.Tensor], b: int, c: int) -> dict[str, torch.Tensor]:
    cells = b * c
    return {
        "input_ids": store["input_ids"][:cells].view(b, c),
        "positions": store["positions"][:cells].view(b, c),
        "valid": store["valid"][:cells].view(b, c),
        "target_logits": store["target_logits"][:cells].view(b, c, -1),
        "features": store["features"][:b],
    }


class CanvasBuffers:
    """Preallocated storage, on the update's device, for the fixed-shape fields of update canvases.

    Capture gathers SGLang's verify outputs straight into these (one device-side copy) and the
    update trains on them as they are: no host round trip, no second private copy. One set serves
    every update, because the Distiller runs at most one update at a time and hands the buffers out
    only through `Distiller.capture_buffers()`, which first collects a running update. The storage
    is allocated for the largest batch seen so far (rows rounded up to a power of two) and the
    largest canvas length, so it stops growing once serving has seen its largest batch.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._rows = 0  # capacity in canvas cells (batch x length)
        self._key: tuple | None = None  # (vocab, feature shape) the storage was made for
        self._store: dict[str, torch.Tensor] = {}
        self.num_allocations = 0

    def views(self, b: int, c: int, vocab: int, feature_shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """Contiguous views for a [b, c] canvas: input_ids, positions, valid [b, c], target_logits
        [b, c, vocab] (float32) and features [b, *feature_shape] (float32)."""
        cells, key = b * c, (vocab, tuple(feature_shape))
        if cells > self._rows or key != self._key:
            rows = 1 << max(cells - 1, 0).bit_length()
            self._store = _storage(rows, vocab, tuple(feature_shape), self.device)
            self._rows, self._key = rows, key
            self.num_allocations += 1
        return _views(self._store, b, c)

    @staticmethod
    def fresh(
        b: int, c: int, vocab: int, feature_shape: tuple[int, ...], device: torch.device | str
    ) -> dict[str, torch.Tensor]:
        """The same views on storage of their own (a canvas that is not an update's, e.g. a check)."""
        return _views(_storage(b * c, vocab, tuple(feature_shape), torch.device(device)), b, c)

    def storage_pointers(self) -> dict[str, int]:
        """data_ptr of each stored tensor (tests: the storage does not move once warm)."""
        return {name: t.data_ptr() for name, t in self._store.items()}
