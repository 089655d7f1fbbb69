"""Canvas capture from SGLang's verify outputs (synthetic tensors, no server)."""

from __future__ import annotations

import pytest
import torch
from sglang_testing import forbid_host_reads

from sglang_tts.core.canvas import TeacherVocab
from sglang_tts.sglang.capture import build_canvas, build_kept_canvas, path_rows


def test_path_rows_accepted_and_full_chains_and_trees():
    chain_index = torch.tensor([[0, 1, 2, -1], [4, -1, -1, -1]])
    # chain (topk 1): accepted path + next position by default, every drafted position with "full"
    assert path_rows(1, 4, [3, 1], chain_index) == [[0, 1, 2], [4]]
    assert path_rows(1, 4, [3, 1], chain_index, "full") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # tree (topk > 1): the nodes of accept_index, in path order
    tree_index = torch.tensor([[0, 2, 3, -1], [4, 5, -1, -1]])
    assert path_rows(2, 4, [3, 2], tree_index) == [[0, 2, 3], [4, 5]]


def test_build_canvas_gathers_pads_and_skips_requests_without_anchor():
    n, vocab, f = 4, 10, 6
    draft_tokens = torch.arange(100, 100 + 3 * n)
    logits = torch.randn(3 * n, vocab)
    anchors = [torch.ones(f), None, torch.full((f,), 2.0)]

    def past_kv(r):  # one drafter layer, 2 KV heads, r+1 cached positions, head dim 3
        return [(torch.full((2, r + 1, 3), float(r)), torch.full((2, r + 1, 3), -float(r)))]

    canvas = build_canvas(
        request_ids=["a", "b", "c"],
        rows=[[0, 1], [4, 5, 6], [8, 9, 10]],
        draft_tokens=draft_tokens,
        target_logits=logits,
        seq_lens=[7, 8, 20],
        anchor_features=anchors,
        past_kv=past_kv,
        num_accepted=[1, 2, 2],
    )
    assert canvas.request_ids == ["a", "c"]
    assert canvas.input_ids.tolist() == [[100, 101, 0], [108, 109, 110]]
    assert canvas.positions.tolist() == [[7, 8, 9], [20, 21, 22]]
    assert canvas.valid.tolist() == [[True, True, False], [True, True, True]]
    torch.testing.assert_close(canvas.target_logits[1], logits[8:11])
    torch.testing.assert_close(canvas.target_logits[0, :2], logits[0:2])
    assert canvas.features[:, 0].tolist() == [1.0, 2.0]
    k, v = canvas.past_kv[0]
    assert k.shape == (2, 2, 3, 3) and canvas.past_mask.tolist() == [[True, False, False], [True, True, True]]
    assert k[1, 0, 2, 0].item() == 2.0 and v[1, 0, 2, 0].item() == -2.0
    assert canvas.num_accepted.tolist() == [1, 2]


def test_no_anchor_anywhere_gives_no_canvas():
    out = build_canvas(
        request_ids=["a"],
        rows=[[0, 1]],
        draft_tokens=torch.arange(4),
        target_logits=torch.randn(4, 5),
        seq_lens=[3],
        anchor_features=[None],
    )
    assert out is None


@pytest.mark.parametrize("full_chain", [False, True])
def test_a_kept_canvas_is_the_update_canvas_without_kv_and_reads_nothing_on_the_host(monkeypatch, full_chain):
    """build_kept_canvas (--tts-update-window) gathers on the device what build_canvas gathers from
    host rows: the same tokens, logits, positions and features at every valid position, padded to the
    draft length; rows without an anchor or skipped (suffix chains) are left out."""
    n, vocab, f = 4, 10, 6
    draft_tokens = torch.arange(100, 100 + 4 * n)
    logits = torch.randn(4 * n, vocab)
    anchors = [torch.ones(f), None, torch.full((f,), 2.0), torch.full((f,), 3.0)]
    accept_index = torch.tensor([[0, 1, -1, -1], [4, 5, 6, -1], [8, 9, 10, 11], [12, -1, -1, -1]])
    accept_lens = torch.tensor([2, 3, 4, 1])
    seq_lens = [7, 8, 20, 30]
    rows = path_rows(1, n, accept_lens.tolist(), accept_index, "full" if full_chain else "accepted")
    rows[3] = []  # a suffix chain: not the drafter's
    reference = build_canvas(
        request_ids=["a", "b", "c", "d"],
        rows=rows,
        draft_tokens=draft_tokens,
        target_logits=logits,
        seq_lens=seq_lens,
        anchor_features=anchors,
        num_accepted=[a - 1 for a in accept_lens.tolist()],
    )
    seq_lens_device = torch.tensor(seq_lens)
    with monkeypatch.context() as m:
        forbid_host_reads(m)
        kept = build_kept_canvas(
            request_ids=["a", "b", "c", "d"],
            accept_index=accept_index,
            accept_lens=accept_lens,
            draft_tokens=draft_tokens,
            target_logits=logits,
            seq_lens=seq_lens_device,
            anchor_features=anchors,
            skip=[False, False, False, True],
            full_chain=full_chain,
        )
    assert kept.request_ids == reference.request_ids == ["a", "c"]
    assert kept.input_ids.shape == (2, n) and kept.past_kv is None
    c = reference.length
    assert torch.equal(kept.valid[:, :c], reference.valid) and not kept.valid[:, c:].any()
    valid = reference.valid
    assert torch.equal(kept.input_ids[:, :c][valid], reference.input_ids[valid])
    assert torch.equal(kept.positions[:, :c], reference.positions)
    torch.testing.assert_close(kept.target_logits[:, :c][valid], reference.target_logits[valid])
    torch.testing.assert_close(kept.features, reference.features)
    assert kept.num_accepted.tolist() == reference.num_accepted.tolist()


def test_capture_at_a_teacher_vocab_keeps_the_drafters_ids_and_drops_positions_whose_top1_is_outside(monkeypatch):
    """With a TeacherVocab (an EAGLE-3 draft vocabulary), the update canvas and a kept canvas hold the
    target's logits at those ids only, `valid` loses the positions whose target top-1 lies outside
    them, and their tokens still feed the chain (not cleared like padding). The kept canvas still
    reads nothing on the host."""
    n, vocab, f = 4, 12, 6
    ids = torch.tensor([1, 2, 5, 7, 11])
    covered = torch.zeros(vocab, dtype=torch.bool)
    covered[ids] = True
    teacher = TeacherVocab(ids=ids, covered=covered)
    draft_tokens = torch.arange(100, 100 + 2 * n)
    logits = torch.randn(2 * n, vocab)
    logits[:, 2] = 20.0  # every top-1 inside the draft vocabulary (id 2) ...
    logits[1, 3] = 40.0  # ... but request "a"'s canvas position 1 (id 3, outside)
    logits[4, 5] = 40.0  # request "b", canvas position 0: top-1 inside
    anchors = [torch.ones(f), torch.full((f,), 2.0)]
    accept_index = torch.tensor([[0, 1, 2, -1], [4, 5, -1, -1]])
    accept_lens = torch.tensor([3, 2])
    common = dict(request_ids=["a", "b"], draft_tokens=draft_tokens, target_logits=logits, anchor_features=anchors)
    rows = path_rows(1, n, accept_lens.tolist(), accept_index)
    full = build_canvas(rows=rows, seq_lens=[7, 9], **common)
    reduced = build_canvas(rows=rows, seq_lens=[7, 9], teacher=teacher, **common)
    assert reduced.target_logits.shape == (2, 3, len(ids)) and torch.equal(reduced.teacher_ids, ids)
    torch.testing.assert_close(reduced.target_logits, full.target_logits[..., ids])
    assert reduced.valid.tolist() == [[True, False, True], [True, True, False]]
    assert torch.equal(reduced.input_ids, full.input_ids) and reduced.input_ids[0, 1].item() == 101
    with monkeypatch.context() as m:
        forbid_host_reads(m)
        kept = build_kept_canvas(
            accept_index=accept_index, accept_lens=accept_lens, seq_lens=torch.tensor([7, 9]), teacher=teacher, **common
        )
    assert kept.target_logits.shape == (2, n, len(ids)) and torch.equal(kept.teacher_ids, ids)
    torch.testing.assert_close(kept.target_logits[:, :3], reduced.target_logits)
    assert torch.equal(kept.valid[:, :3], reduced.valid) and not kept.valid[:, 3].any()
    assert kept.input_ids[0, 1].item() == 101
