"""core/canvas.py: stacking the rounds of an update window (stack_rounds)."""

from __future__ import annotations

import pytest
import torch
from core_testing import random_canvas

from sglang_tts.core.canvas import stack_rounds


def _with_kv(canvas, length: int, fill: list[float]):
    """K/V of one drafter layer, [B, 2 heads, length, 3], row r filled with fill[r] (its request's)."""
    k = torch.stack([torch.full((2, length, 3), f) for f in fill])
    canvas.past_kv = [(k, -k)]
    canvas.past_mask = torch.ones(canvas.batch_size, length, dtype=torch.bool)
    if canvas.batch_size > 1:
        canvas.past_mask[1, length - 2 :] = False  # request b's context is shorter
    return canvas


def test_earlier_rows_read_their_requests_kv_up_to_their_own_round(generator):
    early = random_canvas(generator, batch=3, length=3)
    early.request_ids = ["b", "gone", "a"]
    early.positions = torch.tensor([[5, 6, 7], [9, 10, 11], [8, 9, 10]])  # anchors: b at 5, a at 8
    early.slots = torch.tensor([1, 2, 0])
    latest = _with_kv(random_canvas(generator, batch=2, length=4), 12, [1.0, 2.0])
    latest.request_ids = ["a", "b"]
    latest.positions = torch.tensor([[11, 12, 13, 14], [8, 9, 10, 11]])
    latest.slots = torch.tensor([0, 1])

    out = stack_rounds([early], latest)
    assert out.request_ids == ["b", "a", "a", "b"]  # "gone" finished before the update: dropped
    assert out.input_ids.shape == (4, 4) and out.target_logits.shape[:2] == (4, 4)
    assert out.valid[:2].tolist() == [[True, True, True, False]] * 2  # padded, not trained on
    assert out.positions[:2].tolist() == [[5, 6, 7, 8], [8, 9, 10, 11]]
    torch.testing.assert_close(out.input_ids[:2, :3], early.input_ids[[0, 2]])
    torch.testing.assert_close(out.target_logits[:2, :3], early.target_logits[[0, 2]])
    torch.testing.assert_close(out.features, torch.cat((early.features[[0, 2]], latest.features)))
    assert out.slots.tolist() == [1, 0, 0, 1]
    k, v = out.past_kv[0]
    # The latest's K/V as they are (one entry per request, not a gathered copy per row); each row names its request's.
    assert k.data_ptr() == latest.past_kv[0][0].data_ptr() and v.data_ptr() == latest.past_kv[0][1].data_ptr()
    assert out.context_rows == [1, 0, 0, 1] and out.context_entries() == [1, 0, 0, 1]
    assert k[out.context_rows, 0, 0, 0].tolist() == [2.0, 1.0, 1.0, 2.0]
    # Earlier rows see what their round saw: the first anchor - 1 entries (b: 4, a: 7); latest rows as given.
    assert out.past_mask.sum(1).tolist() == [4, 7, 12, 10]
    assert out.past_mask[0, :4].all() and out.past_mask[1, :7].all()


def test_nothing_earlier_of_a_live_request_leaves_the_latest_as_it_is(generator):
    early = random_canvas(generator, batch=1)
    early.request_ids = ["gone"]
    latest = random_canvas(generator, batch=2)
    latest.request_ids = ["a", "b"]
    assert stack_rounds([early], latest) is latest


def test_rounds_of_one_request_read_its_one_kv_copy_through_their_masks(generator):
    """At one request every stacked row reads that request's K/V: the one copy stays ([1, H, L, D],
    not gathered per row), and each row's mask says what it read in its own round."""
    earlier = [random_canvas(generator, batch=1, length=3) for _ in range(2)]
    for canvas, anchor in zip(earlier, (5, 8)):
        canvas.request_ids = ["a"]
        canvas.positions = torch.arange(anchor, anchor + 3)[None]
    latest = _with_kv(random_canvas(generator, batch=1, length=4), 12, [1.0])
    latest.past_mask[0, 11] = False  # an entry the latest round does not read: no earlier row does
    latest.request_ids = ["a"]
    latest.positions = torch.arange(11, 15)[None]
    out = stack_rounds(earlier, latest)
    assert out.batch_size == 3 and out.request_ids == ["a"] * 3
    k, v = out.past_kv[0]
    assert out.context_rows is None and out.context_entries() is None  # every row reads the one entry
    assert k.shape == (1, 2, 12, 3) and k.data_ptr() == latest.past_kv[0][0].data_ptr()
    assert v.data_ptr() == latest.past_kv[0][1].data_ptr()
    assert out.past_mask.sum(1).tolist() == [4, 7, 11]
    assert out.past_mask[0, :4].all() and out.past_mask[1, :7].all()


def test_context_rows_must_name_an_entry_for_every_row(generator):
    latest = _with_kv(random_canvas(generator, batch=2, length=4), 6, [1.0, 2.0])
    latest.context_rows = [0, 1]
    latest.validate()
    for bad in ([0], [0, 2], [-1, 0]):
        latest.context_rows = bad
        with pytest.raises(ValueError, match="context_rows"):
            latest.validate()
