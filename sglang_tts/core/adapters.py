"""Per-request low-rank adapters: each running request adapts its own copy of the drafter.

A drafter adapted on one sequence drafts *worse* on another (premise note: 0.31-0.35 agreement vs
0.39-0.44 untouched), so at batch > 1 one shared adapted drafter loses the gain. Here every request
owns a slot of a `LowRankBank`: for each adapted linear layer y = W x, the request's rows compute

    y = W x + scale * B_slot (A_slot x)        A_slot [r, in], B_slot [out, r], scale = alpha / r

B starts at zero, so a fresh slot drafts exactly like the base drafter. With rank "full" (`FULL_RANK`)
a slot is instead a dense delta D_slot [out, in] (zero at start): y = W x + D_slot x, a per-request
copy of every adapted layer (W + D_slot), trained like the full-parameter update. It costs
out x in floats per layer and slot (rank r: r x (in + out)), three times that with Adam's state. Slots are separate leaf
parameters: a row's output depends only on its own slot, so one backward over a batch gives each
slot only its own request's gradient (isolation by construction), and the optimiser skips slots
without a gradient (torch.optim skips parameters whose .grad is None).

Two views of the same bank:
  - training (`AdaptedDrafter`): forward hooks on the differentiable drafter's nn.Linear modules add
    the delta of each canvas row's slot (rows = requests, `Canvas.slots`);
  - serving (an engine's own draft model): `ServingBank` keeps the published slots stacked,
    [num_slots + 1, r, in] with row 0 all zeros ("no adapter": requests beyond the cap), and
    `sglang_tts.kernels.lowrank_delta` applies them per token (gathered batched matmul; a Triton
    kernel on CUDA).

Memory is allocated once for `num_slots` (static buffers, as CUDA graphs need); a released slot is
reset to its initial values and its optimiser state dropped, so nothing of a request outlives it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from sglang_tts.config import FULL_RANK
from sglang_tts.core.canvas import Canvas, TeacherVocab
from sglang_tts.core.prompt import PromptBatch, PromptTerms
from sglang_tts.kernels import lowrank_delta

NO_SLOT = -1  # rows of requests without an adapter (over the cap): base drafter, no delta
# The drafter's LM head. Drafters read its weight (`lm_head_weight`, so the loss can fuse the head)
# instead of calling it, so no hook fires there: its delta is added in `AdaptedDrafter.canvas_logits`.
LM_HEAD = "lm_head"


@dataclass(frozen=True)
class AdaptedLinear:
    """One linear layer the bank adapts, named as in the differentiable drafter."""

    name: str
    in_features: int
    out_features: int


def adaptable_linears(drafter: nn.Module, suffixes: Sequence[str]) -> list[AdaptedLinear]:
    """The drafter's nn.Linear modules whose names end with one of `suffixes` (a last name component,
    or a whole module name), in module order."""
    found = [
        AdaptedLinear(name, m.in_features, m.out_features)
        for name, m in drafter.named_modules()
        if isinstance(m, nn.Linear) and (name in suffixes or name.rsplit(".", 1)[-1] in suffixes)
    ]
    if not found:
        raise ValueError(f"the drafter has no linear layer named {list(suffixes)} to adapt")
    return found


def dense_delta(x: torch.Tensor, d: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """D[slots[n]] @ x[n] for every row n: x [N, in], d [S, out, in], slots [N] -> [N, out]. One
    matmul per distinct slot: gathering a [N, out, in] copy per token would cost N full matrices."""
    out = x.new_zeros(x.shape[0], d.shape[1])
    for slot in torch.unique(slots).tolist():
        rows = slots == slot
        out[rows] = x[rows] @ d[slot].T
    return out


class SlotTable:
    """request id -> slot, at most `num_slots` slots at once; requests beyond the cap get none.

    Groups (scope "group"): requests acquired with the same `group` key share one slot, which is
    freed when the group's last request is released. A request that joins a group holding a slot
    gets that slot even when no slot is free; the group's first request is capped like any other."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the number of adapter slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.slot_of: dict[str, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.num_capped = 0  # requests that found no free slot (served by the base drafter)
        self._capped: set[str] = set()
        # Groups: every entry belongs to a request in slot_of (bounded by the running requests).
        self._group_of: dict[str, str] = {}  # request id -> group key
        self._group_slot: dict[str, int] = {}  # group key -> its slot
        self._members: dict[str, int] = {}  # group key -> requests holding its slot

    def known(self, rid: str) -> bool:
        """The request holds a slot or was capped (acquire would not look at its group again)."""
        return rid in self.slot_of or rid in self._capped

    def acquire(self, rid: str, group: str | None = None) -> int | None:
        if rid in self.slot_of:
            return self.slot_of[rid]
        if rid in self._capped:
            return None
        if group is not None and group in self._group_slot:
            slot = self._group_slot[group]
        elif not self._free:
            self._capped.add(rid)
            self.num_capped += 1
            return None
        else:
            slot = self._free.pop()
            if group is not None:
                self._group_slot[group] = slot
        self.slot_of[rid] = slot
        if group is not None:
            self._group_of[rid] = group
            self._members[group] = self._members.get(group, 0) + 1
        return slot

    def join(self, rid: str, group: str) -> int | None:
        """Give `rid` its group's slot if the group holds one; else nothing (no free slot is taken,
        nothing is capped: a later acquire decides)."""
        if rid in self.slot_of or group not in self._group_slot:
            return self.slot_of.get(rid)
        return self.acquire(rid, group)

    def release(self, rid: str) -> int | None:
        """Forget `rid`; returns its slot when that slot is now free (its group's last request left)."""
        self._capped.discard(rid)
        slot = self.slot_of.pop(rid, None)
        if slot is None:
            return None
        group = self._group_of.pop(rid, None)
        if group is not None:
            self._members[group] -= 1
            if self._members[group] > 0:
                return None  # siblings still adapt it
            del self._members[group], self._group_slot[group]
        self._free.append(slot)
        return slot

    def retain(self, live: Iterable[str]) -> list[int]:
        """Release every request that is not in `live` (finished, aborted or retracted), capped ones
        included; returns the slots freed, whose adapters the caller resets."""
        keep = set(live)
        self._capped &= keep
        return [slot for rid in [r for r in self.slot_of if r not in keep] if (slot := self.release(rid)) is not None]

    def slots(self, rids: Iterable[str]) -> torch.Tensor:
        """[len(rids)] int64 slot per request, NO_SLOT where it has none."""
        return torch.tensor([self.slot_of.get(r, NO_SLOT) for r in rids], dtype=torch.int64)

    def holders(self, slot: int) -> list[str]:
        """The requests drafting with `slot` (one, or a group's)."""
        return [rid for rid, s in self.slot_of.items() if s == slot]

    def num_groups(self) -> int:
        return len(self._group_slot)

    def live(self) -> list[str]:
        return list(self.slot_of)


class LowRankBank(nn.Module):
    """The trainable per-slot A/B matrices of every adapted layer (one leaf parameter each); with
    rank `FULL_RANK`, one dense delta per layer and slot, kept in `b` ([out, in]; `a` is empty)."""

    def __init__(
        self,
        layers: Sequence[AdaptedLinear],
        num_slots: int,
        rank: int | str,
        alpha: float | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.dense = rank == FULL_RANK
        if not self.dense and not (isinstance(rank, int) and rank >= 1):
            raise ValueError(f"adapter rank must be an integer >= 1 or {FULL_RANK!r}, got {rank!r}")
        self.layers = list(layers)
        self.index = {layer.name: i for i, layer in enumerate(self.layers)}
        self.num_slots, self.rank = num_slots, rank
        if self.dense:
            self.scale = 1.0
            self.a_init: list[torch.Tensor] = []
            self.a = nn.ParameterList()
            self.b = nn.ParameterList(
                nn.Parameter(torch.zeros(layer.out_features, layer.in_features))
                for layer in self.layers
                for _ in range(num_slots)
            )
            return
        self.scale = float(alpha if alpha is not None else rank) / rank
        gen = torch.Generator().manual_seed(seed)
        # LoRA's initialisation: A ~ U(+-1/sqrt(in)), B = 0 (every slot starts at the base drafter).
        self.a_init = [
            (torch.rand(rank, layer.in_features, generator=gen) * 2 - 1) / math.sqrt(layer.in_features)
            for layer in self.layers
        ]
        self.a = nn.ParameterList(
            nn.Parameter(self.a_init[i].clone()) for i in range(len(self.layers)) for _ in range(num_slots)
        )
        self.b = nn.ParameterList(
            nn.Parameter(torch.zeros(layer.out_features, rank)) for layer in self.layers for _ in range(num_slots)
        )

    def a_param(self, layer: int, slot: int) -> nn.Parameter:
        return self.a[layer * self.num_slots + slot]

    def b_param(self, layer: int, slot: int) -> nn.Parameter:
        return self.b[layer * self.num_slots + slot]

    def slot_parameter_names(self, slot: int) -> list[str]:
        """Names (as in named_parameters of the owner, prefix 'bank.') of one slot's tensors."""
        out = []
        for i in range(len(self.layers)):
            k = i * self.num_slots + slot
            out += [f"bank.b.{k}"] if self.dense else [f"bank.a.{k}", f"bank.b.{k}"]
        return out

    def slot_of_parameter(self, name: str) -> int:
        """The slot of a parameter named 'bank.a.K' / 'bank.b.K'."""
        return int(name.rsplit(".", 1)[-1]) % self.num_slots

    def layer_of_parameter(self, name: str) -> int:
        return int(name.rsplit(".", 1)[-1]) // self.num_slots

    @torch.no_grad()
    def reset_slot(self, slot: int) -> None:
        for i in range(len(self.layers)):
            if not self.dense:
                self.a_param(i, slot).copy_(self.a_init[i])
            self.b_param(i, slot).zero_()

    def slot_nbytes(self) -> int:
        """Bytes of one slot's trainable tensors (an Adam optimiser adds twice this while it trains)."""
        tensors = self.slot_parameter_names(0)
        params = dict(self.named_parameters(prefix="bank"))
        return sum(params[n].numel() * params[n].element_size() for n in tensors)

    def row_delta(self, layer: int, x: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
        """Differentiable delta for x [B, ..., in] whose batch row b uses slot row_slots[b]
        (NO_SLOT: zero). Only the slots present take part in the graph."""
        b_rows = x.shape[0]
        flat = x.reshape(b_rows, -1, x.shape[-1])
        out = flat.new_zeros(b_rows, flat.shape[1], self.layers[layer].out_features)
        rows = [r for r in range(b_rows) if int(row_slots[r]) != NO_SLOT]
        if not rows:
            return out.reshape(*x.shape[:-1], -1)
        index = torch.tensor(rows, device=x.device)
        b = torch.stack([self.b_param(layer, int(row_slots[r])) for r in rows])  # [R, out, r or in]
        if self.dense:
            delta = torch.bmm(flat[index], b.transpose(1, 2))
        else:
            a = torch.stack([self.a_param(layer, int(row_slots[r])) for r in rows])  # [R, r, in]
            delta = torch.bmm(torch.bmm(flat[index], a.transpose(1, 2)), b.transpose(1, 2)) * self.scale
        return out.index_put((index,), delta).reshape(*x.shape[:-1], -1)


class _RowDeltaHook:
    """Forward hook adding the bank's per-row delta to one nn.Linear's output. A callable object
    (not a closure) so that deep-copying the drafter rebinds it to the copy's bank."""

    def __init__(self, owner: AdaptedDrafter, layer: int) -> None:
        self.owner, self.layer = owner, layer

    def __call__(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        slots = self.owner.active_slots
        if slots is None:
            return None
        x = inputs[0]
        if x.shape[0] != slots.shape[0]:
            raise RuntimeError(f"adapter rows {slots.shape[0]} != batch {x.shape[0]} at {module}")
        return output + self.owner.bank.row_delta(self.layer, x, slots)


class AdaptedDrafter(nn.Module):
    """A differentiable drafter plus per-request low-rank adapters; the base stays frozen.

    Implements the same DifferentiableDrafter interface; canvas rows use the slots in
    `canvas.slots` (NO_SLOT or None: the base drafter)."""

    def __init__(
        self,
        base: nn.Module,
        num_slots: int,
        rank: int,
        alpha: float | None = None,
        layers: Sequence[str] = ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.base = base
        self.kind = base.kind
        for p in base.parameters():
            p.requires_grad_(False)
        adapted = adaptable_linears(base, layers)
        self.bank = LowRankBank(adapted, num_slots, rank, alpha, seed)
        self.active_slots: torch.Tensor | None = None
        self.head_layer: int | None = None  # bank index of the LM head, if adapted
        for i, layer in enumerate(adapted):
            module = base.get_submodule(layer.name)
            if layer.name == LM_HEAD:
                if module.weight is not base.lm_head_weight():
                    raise ValueError("the drafter's lm_head module is not the LM head its logits use")
                self.head_layer = i
                continue
            module.register_forward_hook(_RowDeltaHook(self, i))
        if hasattr(base, "draft_to_target_ids"):  # EAGLE-3's draft -> target vocabulary map
            self.draft_to_target_ids = base.draft_to_target_ids

    # --- DifferentiableDrafter --------------------------------------------------------------

    def _with_slots(self, canvas: Canvas, fn):
        self.active_slots = canvas.slots
        try:
            return fn(canvas)
        finally:
            self.active_slots = None

    def canvas_hidden(self, canvas: Canvas) -> torch.Tensor:
        return self._with_slots(canvas, self.base.canvas_hidden)

    def canvas_logits(self, canvas: Canvas) -> torch.Tensor:
        if self.head_layer is None or canvas.slots is None:
            return self._with_slots(canvas, self.base.canvas_logits)
        hidden = self.canvas_hidden(canvas)  # logits = hidden @ head.T (the DifferentiableDrafter contract)
        return hidden @ self.lm_head_weight().T + self.bank.row_delta(self.head_layer, hidden, canvas.slots)

    def prompt_terms(self, batch: PromptBatch, depth: int, on_rows=None) -> PromptTerms:
        """The base drafter's prompt forward with each row's slot active (batch.slots; None: base)."""
        slots = batch.slots

        def rows(index: torch.Tensor) -> None:
            self.active_slots = None if slots is None else slots[index]

        try:
            return self.base.prompt_terms(batch, depth, rows)
        finally:
            self.active_slots = None

    def prompt_head_delta(self, batch: PromptBatch):
        """The adapted LM head's per-row logits delta for `prompt_loss` (None: no head adapter)."""
        if self.head_layer is None or batch.slots is None:
            return None
        slots, layer = batch.slots, self.head_layer

        def delta(hidden: torch.Tensor, batch_rows: torch.Tensor) -> torch.Tensor:
            out = hidden.new_zeros(hidden.shape[0], self.bank.layers[layer].out_features)
            for row in torch.unique(batch_rows).tolist():  # one request (one slot) at a time
                picked = batch_rows == row
                out = out.index_put(
                    (picked.nonzero(as_tuple=True)[0],),
                    self.bank.row_delta(layer, hidden[picked][None], slots[row : row + 1])[0],
                )
            return out

        return delta

    @property
    def lm_head_per_row(self) -> bool:
        """True when each row has its own LM-head delta: the loss must use `canvas_logits` (no one
        shared head to fuse)."""
        return self.head_layer is not None

    def lm_head_weight(self) -> torch.Tensor:
        return self.base.lm_head_weight()

    def teacher_probs(self, canvas: Canvas) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base.teacher_probs(canvas)

    def teacher_vocab(self, device: torch.device | str) -> TeacherVocab | None:
        reduce = getattr(self.base, "teacher_vocab", None)
        return None if reduce is None else reduce(device)

    def default_position_weights(self, length: int) -> torch.Tensor:
        return self.base.default_position_weights(length)

    def trainable_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if n.startswith("bank.")]

    def adapted_layer_of(self, name: str) -> str:
        """The drafter layer (e.g. 'fc') a bank parameter adapts."""
        return self.bank.layers[self.bank.layer_of_parameter(name)].name

    def slot_parameter_names(self, slot: int) -> list[str]:
        """The trained parameters of one request's adapter (what a reset of that request restores)."""
        return self.bank.slot_parameter_names(slot)

    def isolation_groups(self, names: Sequence[str]) -> list[list[int]]:
        """Indices into `names` grouped by slot: gradient clipping is per request."""
        groups: dict[int, list[int]] = {}
        for i, name in enumerate(names):
            groups.setdefault(self.bank.slot_of_parameter(name), []).append(i)
        return list(groups.values())


class ServingBank:
    """The published adapters, stacked per layer for the engine's batched draft forward:
    a [num_slots + 1, r, in], b [num_slots + 1, out, r] (rank full: b [num_slots + 1, out, in], no a);
    stack row 0 is the all-zero "no adapter" row, slot s lives in row s + 1. Written only at the
    Distiller's barrier (publish)."""

    def __init__(self, bank: LowRankBank, device: torch.device | str = "cpu", dtype: torch.dtype | None = None):
        self.scale = bank.scale
        self.dense = bank.dense
        self.names = [layer.name for layer in bank.layers]
        self.index = dict(bank.index)
        self.num_slots = bank.num_slots
        dtype = dtype or torch.float32
        rows = bank.num_slots + 1
        if self.dense:
            self.a: list[torch.Tensor] = []
            self.b = [torch.zeros(rows, x.out_features, x.in_features, device=device, dtype=dtype) for x in bank.layers]
            return
        self.a = [torch.zeros(rows, bank.rank, x.in_features, device=device, dtype=dtype) for x in bank.layers]
        self.b = [torch.zeros(rows, x.out_features, bank.rank, device=device, dtype=dtype) for x in bank.layers]
        with torch.no_grad():
            for i in range(len(bank.layers)):
                for s in range(bank.num_slots):
                    self.a[i][s + 1].copy_(bank.a_param(i, s))

    def destinations(self, bank: LowRankBank) -> dict[str, torch.Tensor]:
        """Trained parameter name -> the view of the stack it publishes into."""
        out = {}
        for i in range(len(bank.layers)):
            for s in range(bank.num_slots):
                k = i * bank.num_slots + s
                if not self.dense:
                    out[f"bank.a.{k}"] = self.a[i][s + 1]
                out[f"bank.b.{k}"] = self.b[i][s + 1]
        return out

    @staticmethod
    def stack_rows(slots: torch.Tensor) -> torch.Tensor:
        """Slots (NO_SLOT = -1 allowed) -> stack rows (0 = no adapter)."""
        return slots + 1

    def delta(self, name: str, x: torch.Tensor, stack_rows: torch.Tensor) -> torch.Tensor:
        """Per-token delta of layer `name` for x [N, in] with stack rows [N]."""
        i = self.index[name]
        if self.dense:
            return dense_delta(x, self.b[i].to(x.dtype), stack_rows)
        # The Triton kernel on CUDA reads each token's adapter in place instead of gathering copies.
        return lowrank_delta(x, self.a[i], self.b[i], stack_rows, self.scale)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a, *self.b))
