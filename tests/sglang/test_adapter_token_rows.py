"""Per-request adapters' token -> bank-row map (sglang/adapters.py TokenRows): a static table, no
host syncs, the layouts SGLang's draft-model forwards use."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_tts.sglang.adapters import TokenRows


def _batch(pool_indices, extend_lens=None, device="cpu"):
    mode = SimpleNamespace(is_extend=lambda: extend_lens is not None)
    lens = None if extend_lens is None else torch.tensor(extend_lens, device=device)
    return SimpleNamespace(
        forward_mode=mode,
        req_pool_indices=torch.tensor(pool_indices, device=device),
        extend_seq_lens=lens,
        extend_seq_lens_cpu=extend_lens,
    )


def test_tokens_map_to_their_requests_rows_in_both_layouts():
    table = TokenRows(pool_size=lambda: 8, device="cpu")
    table.set_batch([5, 2], [3, 1])  # request in pool row 5 holds bank row 3, pool row 2 bank row 1
    # prefill / draft-extend: per-request lengths
    assert table.rows_for(_batch([5, 2], extend_lens=[2, 3]), 5).tolist() == [3, 3, 1, 1, 1]
    # draft steps / verify / DFlash blocks: a fixed number of tokens per request
    assert table.rows_for(_batch([2, 5]), 4).tolist() == [1, 1, 3, 3]
    assert table.rows_for(_batch([2, 5]), 3) is None  # no layout fits: the base drafter
    table.set_batch([2], [0])  # the next batch: pool row 5 left, so it maps to no adapter
    assert table.rows_for(_batch([5, 2]), 2).tolist() == [0, 0]


def test_the_table_keeps_its_storage_and_refuses_indices_outside_the_pool():
    table = TokenRows(pool_size=lambda: 16, device="cpu")
    storage = table.row_of_pool.data_ptr()
    for n in range(1, 16):
        table.set_batch(list(range(n)), [1] * n)
    with pytest.raises(IndexError, match="outside SGLang's pool of 16"):
        table.set_batch([16], [1])  # never reallocated (a captured graph would read a stale tensor)
    assert table.row_of_pool.data_ptr() == storage and table.row_of_pool.shape == (16,)


def test_mapping_reads_no_device_value_on_the_host():
    """On the meta device every host read of a value (`.item()`, `bool()`, `int()`, a
    repeat_interleave that must count its output) raises: the same code as on CUDA, where each would
    be a host sync (an error under CUDA graph capture)."""
    table = TokenRows(pool_size=lambda: 8, device="meta")
    table.set_batch([5, 2], [3, 1])
    extend = table.rows_for(_batch([5, 2], extend_lens=[2, 3], device="meta"), 5)
    fixed = table.rows_for(_batch([5, 2], device="meta"), 8)
    assert extend.device.type == "meta" and extend.shape == (5,)
    assert fixed.device.type == "meta" and fixed.shape == (8,)
    with pytest.raises((RuntimeError, NotImplementedError)):
        bool((fixed > 0).any())  # what the old pre-hook did every forward
