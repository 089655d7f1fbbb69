"""Turn one SGLang EAGLE verify step into a TTS Canvas.

Which nodes the loss uses (see docs/how-it-works.md), by default (`--tts-canvas accepted`), for chains and trees:
the accepted path plus the next position, i.e. the nodes in `accept_index[r, :accept_len]`. The
last of them is where the first rejected node hangs: the target's distribution there is exactly
what the rejected draft should have matched. `--tts-canvas full` (chains only) uses every drafted
position: the target's distribution there is conditioned on the drafted prefix, a valid teacher
but on contexts that contain a rejected token.

Positions: canvas position 0 is the last verified token x_t at sequence index `seq_len`
(SGLang's verify input puts it first); position k is the k-th node on the path.

Conditioning: EAGLE-3 canvases carry one anchor feature per request (`anchor_features`); DFlash
canvases carry the target features of recent committed tokens (`context_features`: per request
`(features [L, F], first position)`, or None for "pool only"), the older context coming as the
drafter's K/V from SGLang's draft KV pool (`past_kv`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sglang_tts.core.canvas import Canvas


def path_rows(
    topk: int, num_draft_tokens: int, accept_lens: Sequence[int], accept_index: torch.Tensor, canvas: str = "accepted"
) -> list[list[int]]:
    """Per request, the rows (into the flattened [bs * num_draft_tokens] verify tensors) the loss uses."""
    rows: list[list[int]] = []
    for r, n_acc in enumerate(accept_lens):
        if topk == 1 and canvas == "full":
            rows.append(list(range(r * num_draft_tokens, (r + 1) * num_draft_tokens)))
        else:
            rows.append([int(i) for i in accept_index[r, : int(n_acc)].tolist()])
    return rows


def build_canvas(
    *,
    request_ids: Sequence[str],
    rows: Sequence[Sequence[int]],
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    seq_lens: Sequence[int],
    anchor_features: Sequence[torch.Tensor | None] | None = None,
    context_features: Sequence[tuple[torch.Tensor, int] | None] | None = None,
    feature_dim: int | None = None,
    past_kv: Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]] | None = None,
    num_accepted: Sequence[int] | None = None,
    round_index: int = 0,
    device: torch.device | str = "cpu",
) -> Canvas | None:
    """Pad the requests' chains into one Canvas. Exactly one of `anchor_features` (EAGLE-3:
    requests without one are left out) and `context_features` (DFlash, with `feature_dim`) is given.

    past_kv(r) returns, per drafter layer, (k, v) of shape [H_kv, L_r, D] for request r.
    """
    if (anchor_features is None) == (context_features is None):
        raise ValueError("build_canvas needs exactly one of anchor_features and context_features")
    if anchor_features is not None:
        keep = [r for r, f in enumerate(anchor_features) if f is not None and len(rows[r]) > 0]
    else:
        keep = [r for r in range(len(rows)) if len(rows[r]) > 0]
    if not keep:
        return None
    b = len(keep)
    c = max(len(rows[r]) for r in keep)
    vocab = target_logits.shape[-1]
    input_ids = torch.zeros((b, c), dtype=torch.long)
    positions = torch.zeros((b, c), dtype=torch.long)
    logits = torch.zeros((b, c, vocab), dtype=torch.float32)
    valid = torch.zeros((b, c), dtype=torch.bool)
    for i, r in enumerate(keep):
        idx = torch.tensor(rows[r], dtype=torch.long)
        n = idx.numel()
        input_ids[i, :n] = draft_tokens[idx.to(draft_tokens.device)].long().cpu()
        positions[i, :n] = seq_lens[r] + torch.arange(n)
        positions[i, n:] = seq_lens[r] + torch.arange(n, c)  # keep RoPE positions increasing in padding
        logits[i, :n] = target_logits[idx.to(target_logits.device)].float().cpu()
        valid[i, :n] = True
    context_positions = context_mask = None
    if anchor_features is not None:
        features = torch.stack([anchor_features[r].float().cpu() for r in keep])
    else:
        features, context_positions, context_mask = _pad_context([context_features[r] for r in keep], feature_dim)

    kv = None
    past_mask = None
    if past_kv is not None:
        per_req = [past_kv(r) for r in keep]
        num_layers = len(per_req[0])
        max_len = max(k.shape[1] for layers in per_req for k, _ in layers)
        past_mask = torch.zeros((b, max_len), dtype=torch.bool)
        kv = []
        for layer in range(num_layers):
            k0, v0 = per_req[0][layer]
            ks = torch.zeros((b, k0.shape[0], max_len, k0.shape[2]), dtype=torch.float32)
            vs = torch.zeros((b, v0.shape[0], max_len, v0.shape[2]), dtype=torch.float32)
            for i, layers in enumerate(per_req):
                k, v = layers[layer]
                ks[i, :, : k.shape[1]] = k.float().cpu()
                vs[i, :, : v.shape[1]] = v.float().cpu()
                past_mask[i, : k.shape[1]] = True
            kv.append((ks, vs))

    canvas = Canvas(
        input_ids=input_ids,
        positions=positions,
        target_logits=logits,
        valid=valid,
        features=features,
        past_kv=kv,
        past_mask=past_mask,
        context_positions=context_positions,
        context_mask=context_mask,
        num_accepted=None if num_accepted is None else torch.tensor([num_accepted[r] for r in keep]),
        request_ids=[request_ids[r] for r in keep],
        round_index=round_index,
    )
    canvas.validate()
    return canvas.to(device) if str(device) != "cpu" else canvas


def _pad_context(
    contexts: Sequence[tuple[torch.Tensor, int] | None], feature_dim: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, L, F] features, [B, L] positions and [B, L] mask from per-request (features, start)."""
    lengths = [0 if c is None else int(c[0].shape[0]) for c in contexts]
    dims = {int(c[0].shape[-1]) for c in contexts if c is not None}
    if feature_dim is None:
        if not dims:
            raise ValueError("context_features are all empty: pass feature_dim")
        feature_dim = dims.pop()
    b, length = len(contexts), max(lengths, default=0)
    features = torch.zeros((b, length, feature_dim), dtype=torch.float32)
    positions = torch.zeros((b, length), dtype=torch.long)
    mask = torch.zeros((b, length), dtype=torch.bool)
    for i, c in enumerate(contexts):
        if c is None or lengths[i] == 0:
            continue
        feats, start = c
        features[i, : lengths[i]] = feats.float().cpu()
        positions[i, : lengths[i]] = start + torch.arange(lengths[i])
        mask[i, : lengths[i]] = True
    return features, positions, mask
