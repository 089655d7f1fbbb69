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

from sglang_tts.core.canvas import Canvas, CanvasBuffers, TeacherVocab


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
    buffers: CanvasBuffers | None = None,
    teacher: TeacherVocab | None = None,
) -> Canvas | None:
    """Pad the requests' chains into one Canvas on `device`. Exactly one of `anchor_features`
    (EAGLE-3: requests without one are left out) and `context_features` (DFlash, with
    `feature_dim`) is given.

    The canvas is gathered on the device that holds SGLang's tensors and written once into
    tensors the update owns (`buffers`' views when given, else fresh ones), outside inference mode
    so that autograd may use them: callers hand it to the update without another copy.

    draft_tokens:    [bs * n] the verify input's tokens (any integer dtype)
    target_logits:   [bs * n, V] the target's verify logits
    rows[r]:         flat indices into those of request r's canvas positions (host ints)
    seq_lens[r]:     position of request r's canvas position 0 (host ints)
    anchor_features: [F] per request, on the device (EAGLE-3)
    past_kv(r):      per drafter layer, (k, v) of shape [H_kv, L_r, D] for request r.
    teacher:         keep the logits at the drafter's ids only (core/canvas.py, TeacherVocab);
                     positions whose target top-1 lies outside them leave `valid`.
    """
    if (anchor_features is None) == (context_features is None):
        raise ValueError("build_canvas needs exactly one of anchor_features and context_features")
    if anchor_features is not None:
        keep = [r for r, f in enumerate(anchor_features) if f is not None and len(rows[r]) > 0]
    else:
        keep = [r for r in range(len(rows)) if len(rows[r]) > 0]
    if not keep:
        return None
    device = torch.device(device)
    b = len(keep)
    c = max(len(rows[r]) for r in keep)
    vocab = target_logits.shape[-1] if teacher is None else teacher.ids.shape[0]
    # Host side: small index and layout tensors (b x c ints); padding cells repeat a real row.
    flat, positions, valid = [], [], []
    for r in keep:
        n = len(rows[r])
        flat += [int(i) for i in rows[r]] + [int(rows[r][0])] * (c - n)
        positions += range(seq_lens[r], seq_lens[r] + c)  # RoPE positions keep increasing in padding
        valid += [True] * n + [False] * (c - n)
    with torch.inference_mode(False), torch.no_grad():
        feature_shape = tuple(anchor_features[keep[0]].shape) if anchor_features is not None else ()
        if buffers is not None and anchor_features is not None:
            out = buffers.views(b, c, vocab, feature_shape)
        else:
            out = CanvasBuffers.fresh(b, c, vocab, feature_shape, device)
        index = torch.tensor(flat, dtype=torch.long).to(target_logits.device, non_blocking=True)
        out["input_ids"].view(-1).copy_(draft_tokens.index_select(0, index.to(draft_tokens.device)))
        logits_out = out["target_logits"].view(b * c, vocab)
        top1_covered = None
        if teacher is not None:
            gathered, top1_covered = teacher.gather(target_logits, index)
            logits_out.copy_(gathered)
        elif target_logits.dtype == torch.float32 and target_logits.device == device:
            torch.index_select(target_logits, 0, index, out=logits_out)
        else:
            logits_out.copy_(target_logits.index_select(0, index))
        out["positions"].view(-1).copy_(torch.tensor(positions, dtype=torch.long), non_blocking=True)
        out["valid"].view(-1).copy_(torch.tensor(valid, dtype=torch.bool), non_blocking=True)
        out["input_ids"].masked_fill_(~out["valid"], 0)
        if top1_covered is not None:  # after the padding is cleared: such a position's token still feeds the chain
            out["valid"].view(-1).logical_and_(top1_covered.to(device))
        context_positions = context_mask = None
        if anchor_features is not None:
            features = out["features"]
            features.copy_(torch.stack([anchor_features[r] for r in keep]))
        else:
            features, context_positions, context_mask = _pad_context(
                [context_features[r] for r in keep], feature_dim, device
            )

        kv = None
        past_mask = None
        if past_kv is not None:
            per_req = [past_kv(r) for r in keep]
            num_layers = len(per_req[0])
            lengths = [layers[0][0].shape[1] for layers in per_req]
            max_len = max(lengths)
            past_mask = torch.tensor([[j < n for j in range(max_len)] for n in lengths], dtype=torch.bool)
            past_mask = past_mask.to(device, non_blocking=True)
            kv = []
            for layer in range(num_layers):
                k0, v0 = per_req[0][layer]
                ks = torch.zeros((b, k0.shape[0], max_len, k0.shape[2]), dtype=torch.float32, device=device)
                vs = torch.zeros((b, v0.shape[0], max_len, v0.shape[2]), dtype=torch.float32, device=device)
                for i, layers in enumerate(per_req):
                    k, v = layers[layer]
                    ks[i, :, : k.shape[1]] = k
                    vs[i, :, : v.shape[1]] = v
                kv.append((ks, vs))
        accepted = None
        if num_accepted is not None:
            accepted = torch.tensor([num_accepted[r] for r in keep]).to(device, non_blocking=True)

    canvas = Canvas(
        input_ids=out["input_ids"],
        positions=out["positions"],
        target_logits=out["target_logits"],
        valid=out["valid"],
        features=features,
        past_kv=kv,
        past_mask=past_mask,
        context_positions=context_positions,
        context_mask=context_mask,
        num_accepted=accepted,
        request_ids=[request_ids[r] for r in keep],
        round_index=round_index,
        teacher_ids=None if teacher is None else teacher.ids.to(device),
    )
    canvas.validate()
    return canvas


def build_kept_canvas(
    *,
    request_ids: Sequence[str],
    accept_index: torch.Tensor,
    accept_lens: torch.Tensor,
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    seq_lens: torch.Tensor,
    anchor_features: Sequence[torch.Tensor | None],
    skip: Sequence[bool] | None = None,
    full_chain: bool = False,
    round_index: int = 0,
    device: torch.device | str = "cpu",
    teacher: TeacherVocab | None = None,
) -> Canvas | None:
    """A round's canvas kept for the stride's update (--tts-update-window), gathered on the device
    with nothing read on the host: each request's path nodes (`accept_index[r, :accept_lens[r]]`,
    the accepted path plus the next position; every drafted node with `full_chain`), padded to the
    verify's draft length (padding invalid), positions from `seq_lens`, no K/V (the update reads
    them once: core/canvas.py, stack_rounds). Rows without an anchor feature, or with `skip` set
    (host bools: suffix chains under --tts-hybrid-train drafter), are left out. With `teacher`, only
    the drafter's ids of the logits are kept (as in build_canvas).

    accept_index: [bs, n] flat indices into the verify's [bs * n] rows (padding -1)
    accept_lens:  [bs] nodes on the path (bonus included)
    draft_tokens: [bs * n]; target_logits: [bs * n, V]
    seq_lens:     [bs] position of each request's canvas position 0 (read before verify moved them)
    """
    keep = [r for r, f in enumerate(anchor_features) if f is not None and not (skip is not None and skip[r])]
    if not keep:
        return None
    device = torch.device(device)
    n = accept_index.shape[1]
    with torch.inference_mode(False), torch.no_grad():
        rows = torch.tensor(keep, dtype=torch.long).to(accept_index.device, non_blocking=True)
        step = torch.arange(n, device=accept_index.device)
        lens = accept_lens.index_select(0, rows.to(accept_lens.device)).to(accept_index.device).long()
        if full_chain:
            index = rows[:, None] * n + step[None]
            valid = torch.ones_like(index, dtype=torch.bool)
        else:
            index = accept_index.index_select(0, rows).long()
            valid = step[None] < lens[:, None]
            index = torch.where(valid, index, index[:, :1])  # padding repeats a real node
        flat = index.reshape(-1)
        input_ids = draft_tokens.index_select(0, flat.to(draft_tokens.device)).view(len(keep), n).long()
        input_ids = input_ids.masked_fill(~valid.to(input_ids.device), 0)
        if teacher is None:
            logits = target_logits.index_select(0, flat.to(target_logits.device)).float()
        else:
            logits, top1_covered = teacher.gather(target_logits, flat.to(target_logits.device))
            valid = valid & top1_covered.view(len(keep), n).to(valid.device)
        positions = seq_lens.index_select(0, rows.to(seq_lens.device)).long()[:, None] + step.to(seq_lens.device)
        canvas = Canvas(
            input_ids=input_ids.to(device),
            positions=positions.to(device),
            target_logits=logits.view(len(keep), n, -1).to(device),
            valid=valid.to(device),
            features=torch.stack([anchor_features[r] for r in keep]).float().to(device),
            num_accepted=(lens - 1).to(device),
            request_ids=[request_ids[r] for r in keep],
            round_index=round_index,
            teacher_ids=None if teacher is None else teacher.ids.to(device),
        )
    canvas.validate()
    return canvas


def _pad_context(
    contexts: Sequence[tuple[torch.Tensor, int] | None], feature_dim: int | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, L, F] features, [B, L] positions and [B, L] mask (on `device`) from per-request (features, start)."""
    lengths = [0 if c is None else int(c[0].shape[0]) for c in contexts]
    dims = {int(c[0].shape[-1]) for c in contexts if c is not None}
    if feature_dim is None:
        if not dims:
            raise ValueError("context_features are all empty: pass feature_dim")
        feature_dim = dims.pop()
    b, length = len(contexts), max(lengths, default=0)
    features = torch.zeros((b, length, feature_dim), dtype=torch.float32, device=device)
    positions = torch.zeros((b, length), dtype=torch.long)
    mask = torch.zeros((b, length), dtype=torch.bool)
    for i, c in enumerate(contexts):
        if c is None or lengths[i] == 0:
            continue
        feats, start = c
        features[i, : lengths[i]] = feats
        positions[i, : lengths[i]] = start + torch.arange(lengths[i])
        mask[i, : lengths[i]] = True
    return features, positions.to(device, non_blocking=True), mask.to(device, non_blocking=True)


def prompt_row_ranges(extend_lens: Sequence[int], prefix_lens: Sequence[int], keep: int) -> list[tuple[int, int, int]]:
    """Per request of a prefill (extend) batch, the rows of its flattened [sum(extend_lens)] tensors a
    prompt window keeps (core/prompt.py): (lo, hi, start), rows lo .. hi - 1, the last `keep` of its
    extend, whose first token sits at position `start`. Host ints only (SGLang's host lists)."""
    out, pt = [], 0
    for n, prefix in zip(extend_lens, prefix_lens):
        n, take = int(n), min(int(n), keep)
        out.append((pt + n - take, pt + n, int(prefix) + n - take))
        pt += n
    return out
