"""Test helpers for tests/core: a tiny drafter implementing DifferentiableDrafter, a fixed tiny
teacher, and canvas builders. (A uniquely named module, so `import` cannot pick up another
test directory's conftest.)

The drafter is EAGLE-like in shape: the canvas tokens' embeddings are joined with a projection of
the target features, then one causal attention block + MLP, a norm and an LM head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_tts.core.canvas import Canvas
from sglang_tts.core.loss import eagle3_weights
from sglang_tts.core.prompt import PromptBatch, PromptTerms

VOCAB = 32
HIDDEN = 16
FEATURES = 24
LENGTH = 5


class TinyDrafter(nn.Module):
    kind = "test"

    def __init__(self, seed: int = 0, train_lm_head: bool = False, vocab: int = VOCAB, hidden: int = HIDDEN) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.embed = nn.Embedding(vocab, hidden)
            self.fc = nn.Linear(FEATURES, hidden)
            self.inp = nn.Linear(2 * hidden, hidden)
            self.qkv = nn.Linear(hidden, 3 * hidden)
            self.attn_out = nn.Linear(hidden, hidden)
            self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))
            self.norm = nn.LayerNorm(hidden)
            self.lm_head = nn.Linear(hidden, vocab, bias=False)
        # Like a borrowed target embedding / LM head: present, used, but not TTS-trainable.
        self.frozen = {"embed."} if train_lm_head else {"embed.", "lm_head."}
        self.lm_head.weight.requires_grad_(train_lm_head)
        self.embed.weight.requires_grad_(False)

    def canvas_hidden(self, canvas: Canvas) -> torch.Tensor:
        length = canvas.length
        context = self.fc(canvas.features).unsqueeze(1).expand(-1, length, -1)
        x = self.inp(torch.cat([self.embed(canvas.input_ids), context], dim=-1))
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)  # one head
        x = x + self.attn_out(F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1))
        x = x + self.mlp(x)
        return self.norm(x)

    def prompt_terms(self, batch: PromptBatch, depth: int, on_rows=None) -> PromptTerms:
        """Row t (feature of window token t, embedding of token t + 1) predicts token t + 2."""
        if on_rows is not None:
            on_rows(torch.arange(batch.batch_size))
        ids = batch.token_ids
        x = self.inp(torch.cat([self.embed(ids[:, 1:-1]), self.fc(batch.features[:, :-1])], dim=-1))
        hidden = self.norm(x + self.mlp(x))
        keep = batch.real[:, 2:]
        rows = torch.arange(batch.batch_size)[:, None].expand_as(keep)
        labels = ids[:, 2:]
        return PromptTerms(hidden[keep], labels[keep], torch.ones(int(keep.sum())), rows[keep])

    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def canvas_logits(self, canvas: Canvas) -> torch.Tensor:
        return self.canvas_hidden(canvas) @ self.lm_head_weight().t()

    def teacher_probs(self, canvas: Canvas) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(canvas.target_logits.float(), dim=-1)
        return probs, torch.ones_like(canvas.valid)

    def default_position_weights(self, length: int) -> torch.Tensor:
        return eagle3_weights(length)

    def trainable_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if not any(n.startswith(f) for f in self.frozen)]


def random_canvas(
    generator: torch.Generator, batch: int = 2, length: int = LENGTH, round_index: int = 0, vocab: int = VOCAB
) -> Canvas:
    """A canvas with random tokens and features; target_logits are random until a teacher fills them."""
    return Canvas(
        input_ids=torch.randint(0, vocab, (batch, length), generator=generator),
        positions=torch.arange(length).repeat(batch, 1) + 100,
        target_logits=torch.randn(batch, length, vocab, generator=generator),
        valid=torch.ones(batch, length, dtype=torch.bool),
        features=torch.randn(batch, FEATURES, generator=generator),
        round_index=round_index,
    )


class TinyTeacher:
    """A fixed random model of the drafter's shape with sharpened logits: realisable, but far from
    any freshly initialised drafter."""

    def __init__(self, seed: int = 1234, sharpness: float = 4.0) -> None:
        self.model = TinyDrafter(seed=seed, train_lm_head=True)
        self.sharpness = sharpness

    @torch.no_grad()
    def canvas(self, generator: torch.Generator, batch: int = 2, round_index: int = 0) -> Canvas:
        canvas = random_canvas(generator, batch=batch, round_index=round_index)
        canvas.target_logits = self.sharpness * self.model.canvas_logits(canvas)
        return canvas


@torch.no_grad()
def agreement(drafter: TinyDrafter, canvases: list[Canvas]) -> float:
    """Top-1 match rate of drafter and teacher over all canvas positions."""
    matches = [(drafter.canvas_logits(c).argmax(-1) == c.target_logits.argmax(-1)).float() for c in canvases]
    return torch.cat([m.flatten() for m in matches]).mean().item()
