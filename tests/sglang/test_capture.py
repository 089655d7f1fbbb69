"""Canvas capture from SGLang's verify outputs (synthetic tensors, no server)."""

from __future__ import annotations

import torch

from sglang_tts.sglang.capture import build_canvas, path_rows


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
