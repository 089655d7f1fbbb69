"""Pure-PyTorch stand-ins for the ``sgl_kernel`` CPU ops that SGLang 0.5.23 needs on a CPU-only host.

With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports a dozen ``*_cpu`` ops from ``sgl_kernel`` at module
level (cache-location bookkeeping, KV-slot moves, EAGLE/NGRAM tree building and verification).
They come from the CPU build of sgl-kernel, which is not on PyPI. This module re-implements them
with plain torch ops; the lead's shim exposes :data:`OPS` as ``sgl_kernel.*`` and
:data:`SPECULATIVE_OPS` as ``sgl_kernel.speculative.*``.

Every function keeps the exact name and call signature SGLang uses and writes its outputs in
place into the tensors the caller passes, casting to the destination dtype (callers mix int32
and int64 index tensors). Semantics follow SGLang's Triton/CUDA kernels for the same ops
(``sglang/kernels/ops/...`` and ``sglang/kernels/jit/include/sgl_kernel/speculative/``).
Batches are tiny on CPU, so per-request Python loops are used where a tree walk is needed.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

# Tree mask layouts of ``build_tree_kernel_efficient`` (sglang's ``TreeMaskMode``).
FULL_MASK = 0
QLEN_ONLY = 1
QLEN_ONLY_BITPACKING = 2


def _ragged(lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten ragged segments of length ``lens[i]`` (negative counts as empty).

    Returns ``(segment_id, offset_in_segment)`` for every element, in segment order.
    """
    counts = lens.to(torch.int64).clamp(min=0)
    seg = torch.repeat_interleave(torch.arange(counts.numel(), dtype=torch.int64), counts)
    first = torch.cumsum(counts, 0) - counts
    offset = torch.arange(seg.numel(), dtype=torch.int64) - first[seg]
    return seg, offset


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _flat(t: torch.Tensor) -> torch.Tensor:
    """1-D view sharing storage, so index assignment writes through to the caller's tensor."""
    return t.view(-1)


# --------------------------------------------------------------------------------------------
# KV cache slot moves
# --------------------------------------------------------------------------------------------


def _raw_rows(ptr: int, row_bytes: int, num_rows: int) -> torch.Tensor:
    """uint8 ``[num_rows, row_bytes]`` view of host memory at ``ptr`` (no copy, no ownership)."""
    buf = (ctypes.c_uint8 * (num_rows * row_bytes)).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(num_rows, row_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every buffer ``i`` (base address ``data_ptrs[i]``, ``strides[i]`` bytes per slot), copy
    slot ``src_loc[k]`` onto slot ``tgt_loc[k]``.

    SGLang hands over raw addresses of its per-layer K/V buffers (``memory_pool.data_ptrs``), so
    the rows are reached through ctypes. All source rows are gathered before any target is
    written, which keeps overlapping moves correct, like the tiled Triton kernel.
    """
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.reshape(-1).to(torch.int64)
    src = src_loc.reshape(-1).to(torch.int64)
    num_rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, row_bytes in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = _raw_rows(int(ptr), int(row_bytes), num_rows)
        rows[tgt] = rows[src]


# --------------------------------------------------------------------------------------------
# req_to_token <-> out_cache_loc bookkeeping
# --------------------------------------------------------------------------------------------


def _pool_and_packed_indices(
    req_pool_indices: torch.Tensor, start_offset: torch.Tensor, end_offset: torch.Tensor, pool_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices into req_to_token of every slot in the requests' [start, end) ranges, and the
    matching positions when those ranges are packed back to back (the two ops above are inverses)."""
    start = start_offset.reshape(-1).to(torch.int64)
    lens = end_offset.reshape(-1).to(torch.int64) - start
    seg, off = _ragged(lens)
    rows = req_pool_indices.reshape(-1).to(torch.int64)
    return rows[seg] * pool_len + start[seg] + off, _exclusive_cumsum(lens)[seg] + off


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[o_i : o_i + len_i]``,
    with ``o_i`` the sum of the earlier requests' ``end - start``."""
    pool_idx, packed_idx = _pool_and_packed_indices(req_pool_indices, start_offset, end_offset, pool_len)
    _flat(req_to_token)[pool_idx] = out_cache_loc.reshape(-1)[packed_idx].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Inverse of :func:`assign_req_to_token_pool_cpu`: pack each request's
    ``req_to_token[req_pool_indices[i], start[i]:end[i]]`` back to back into ``out_cache_loc``."""
    pool_idx, packed_idx = _pool_and_packed_indices(req_pool_indices, start_offset, end_offset, pool_len)
    _flat(out_cache_loc)[packed_idx] = req_to_token.reshape(-1)[pool_idx].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """Copy each request's ``topk * num_steps`` draft slots, which start at column ``seq_lens[i]``
    of its ``req_to_token`` row, into ``out_cache_loc[i * topk * num_steps:]``."""
    width = topk * num_steps
    bs = req_pool_indices.numel()
    if bs == 0 or width == 0:
        return
    base = req_pool_indices.reshape(-1).to(torch.int64) * pool_len + seq_lens.reshape(-1).to(torch.int64)
    src = base[:, None] + torch.arange(width, dtype=torch.int64)
    _flat(out_cache_loc)[: bs * width] = req_to_token.reshape(-1)[src.reshape(-1)].to(out_cache_loc.dtype)


# --------------------------------------------------------------------------------------------
# EAGLE tree construction and greedy verification
# --------------------------------------------------------------------------------------------


def _tree_parents(parents: list[int], selected: list[int], topk: int) -> list[int]:
    """Tree-node index of every draft node's parent (node 0 is the verified root).

    Node ``i >= 1`` is draft token ``selected[i - 1]``; its parent is the root when it came from
    the first draft step (``selected // topk == 0``), else the node whose selected index equals
    ``parents[selected // topk]``. ``-1`` marks the root and nodes whose parent was not selected
    (an invalid tree, e.g. NaN scores), which the kernels skip.
    """
    node_of: dict[int, int] = {}
    for j, s in enumerate(selected):
        node_of.setdefault(s, j + 1)  # the kernels take the first match
    out = [-1]
    for s in selected:
        ptb = s // topk
        out.append(0 if ptb == 0 else node_of.get(parents[ptb], -1))
    return out


def _write_bitpacked_mask(tree_mask: torch.Tensor, rows: list[list[int]], draft_token_num: int) -> None:
    """Write one little-endian bit row per draft token, ``bytes_per_item`` bytes each.

    Like the CUDA kernel: the first byte of every item is overwritten, the other bytes are OR-ed
    (the caller zero-fills the buffer beforehand).
    """
    if draft_token_num > 32:
        raise ValueError(f"QLEN_ONLY_BITPACKING supports at most 32 draft tokens, got {draft_token_num}")
    # The width follows from draft_token_num alone, not from the buffer dtype (as in the CUDA op).
    nbytes = 4 if draft_token_num > 16 else (2 if draft_token_num > 8 else 1)
    words = [sum(1 << c for c in cols) for cols in rows]
    new = torch.tensor([b for w in words for b in w.to_bytes(nbytes, "little")], dtype=torch.uint8)
    mask_bytes = _flat(tree_mask).view(torch.uint8)[: new.numel()].view(-1, nbytes)
    new = new.view(-1, nbytes)
    mask_bytes[:, 1:] |= new[:, 1:]
    mask_bytes[:, 0] = new[:, 0]


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """Build the EAGLE verify tree from the draft's top-scored tokens.

    Inputs: ``parent_list [bs, topk*(depth-1)+1]``, ``selected_index [bs, n-1]`` (sorted indices
    into the flattened draft score list), ``verified_seq_len [bs]``; ``n = draft_token_num``.
    Outputs (in place): ``positions [bs*n]`` = seq_len + node depth; ``retrive_index [bs, n]`` =
    flat node ids; ``retrive_next_token`` (first child) and ``retrive_next_sibling`` linked
    lists, updated on top of the caller's ``-1`` fill; and the ancestor mask in ``tree_mask``:

    * FULL_MASK: per request ``n`` rows of ``seq_len + n`` columns; only the last ``n`` columns
      of every row are written (the caller pre-fills the prefix part with True);
    * QLEN_ONLY: ``[bs, n, n]``;
    * QLEN_ONLY_BITPACKING: one 1/2/4-byte little-endian bit row per node.

    Each node sees the root (column 0), itself and its ancestors.
    """
    mode = int(tree_mask_mode)
    n = int(draft_token_num)
    bs = verified_seq_len.numel()
    if bs == 0:
        return
    seq_lens = verified_seq_len.reshape(-1).tolist()
    parent_rows = parent_list.reshape(bs, -1).tolist()
    selected_rows = selected_index.reshape(bs, -1).tolist()
    next_token = retrive_next_token.tolist()
    next_sibling = retrive_next_sibling.tolist()

    mask_rows: list[list[int]] = []  # columns set for every (request, node) row
    node_depths: list[int] = []
    for b in range(bs):
        parent = _tree_parents(parent_rows[b], selected_rows[b][: n - 1], topk)
        nt, ns = next_token[b], next_sibling[b]
        # Descending scan: every node becomes its parent's first child, pushing the previous
        # first child to its sibling slot, so siblings end up in ascending order.
        for i in range(n - 1, 0, -1):
            p = parent[i]
            if p < 0:
                continue
            if nt[p] != -1:
                ns[i] = nt[p]
            nt[p] = i
        for tid in range(n):
            cols = [0]
            node, steps = tid, 0
            # Walk up to the root; ``depth`` bounds the walk like the Triton kernel does.
            while node > 0 and steps < depth:
                cols.append(node)
                steps += 1
                node = parent[node]
            mask_rows.append(cols)
            node_depths.append(steps)

    _flat(positions)[: bs * n] = (
        torch.tensor(node_depths, dtype=torch.int64)
        .view(bs, n)
        .add_(torch.tensor(seq_lens, dtype=torch.int64)[:, None])
        .view(-1)
        .to(positions.dtype)
    )
    retrive_index[:bs].copy_(torch.arange(bs * n, dtype=torch.int64).view(bs, n))
    retrive_next_token[:bs].copy_(torch.tensor(next_token, dtype=torch.int64))
    retrive_next_sibling[:bs].copy_(torch.tensor(next_sibling, dtype=torch.int64))

    if mode == QLEN_ONLY_BITPACKING:
        _write_bitpacked_mask(tree_mask, mask_rows, n)
        return
    dense = torch.zeros(bs * n, n, dtype=torch.bool)
    for r, cols in enumerate(mask_rows):
        dense[r, cols] = True
    if mode == QLEN_ONLY:
        _flat(tree_mask)[: bs * n * n] = dense.view(-1).to(tree_mask.dtype)
    elif mode == FULL_MASK:
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        # Request b's block starts after the earlier blocks of n * (seq_len + n) entries;
        # node row t starts at t * (seq_len + n) and its tree part after seq_len prefix columns.
        block_start = _exclusive_cumsum(lens * n + n * n)
        tid = torch.arange(n, dtype=torch.int64)
        row_start = block_start[:, None] + (lens[:, None] + n) * tid + lens[:, None]
        idx = row_start[:, :, None] + tid
        _flat(tree_mask)[idx.reshape(-1)] = dense.view(-1).to(tree_mask.dtype)
    else:
        raise ValueError(f"unknown tree_mask_mode {tree_mask_mode}")


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy tree verification: walk each request's tree from the root, at every level accept
    the first child (in sibling order) whose draft token equals the target's argmax at the last
    accepted node.

    Writes, in place: ``accept_index[b, :k+1]`` (flat node ids of the accepted path, root first;
    the rest is left as the caller filled it), ``accept_token_num[b] = k`` and
    ``predicts[node]`` = target token for every accepted node, including the last one (bonus).
    ``target_predict`` and ``predicts`` are indexed by flat node id (``b * n + i``).
    """
    bs, _ = candidates.shape
    if bs == 0:
        return
    num_spec_tokens = accept_index.shape[1]
    cand = candidates.tolist()
    node_ids = retrive_index.tolist()
    next_token = retrive_next_token.tolist()
    next_sibling = retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()

    predict_at: list[int] = []
    predict_val: list[int] = []
    num_accepted: list[int] = []
    for b in range(bs):
        last = node_ids[b][0]
        path = [last]
        cur = 0
        for _ in range(1, num_spec_tokens):
            cur = next_token[b][cur]
            want = target[last]
            while cur != -1 and cand[b][cur] != want:
                cur = next_sibling[b][cur]
            if cur == -1:
                break
            predict_at.append(last)
            predict_val.append(want)
            last = node_ids[b][cur]
            path.append(last)
        predict_at.append(last)
        predict_val.append(target[last])
        accept_index[b, : len(path)] = torch.tensor(path, dtype=accept_index.dtype)
        num_accepted.append(len(path) - 1)

    _flat(predicts)[torch.tensor(predict_at, dtype=torch.int64)] = torch.tensor(predict_val, dtype=predicts.dtype)
    _flat(accept_token_num)[:bs] = torch.tensor(num_accepted, dtype=accept_token_num.dtype)


def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor,
    verified_seq_len: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """NGRAM: derive positions and retrieve links from a ``[bs, n, n]`` ancestor mask.

    ``tree_mask[b, i, j]`` marks node ``j`` an ancestor of ``i`` (only ``j < i`` counts). A node's
    parent is its deepest (largest) ancestor; ``positions = seq_len + #ancestors``; the first
    child of ``t`` is the smallest ``k > t`` with ``t`` among its ancestors; the next sibling is
    the smallest ``k > t`` with the same parent (none for the root).
    """
    bs, n = int(batch_size), int(draft_token_num)
    if bs == 0:
        return
    mask = tree_mask.reshape(-1)[: bs * n * n].view(bs, n, n) != 0
    idx = torch.arange(n, dtype=torch.int64)
    row, col = idx[:, None], idx[None, :]
    ancestors = mask & (col < row)  # [bs, i, j]
    sentinel = torch.tensor(n, dtype=torch.int64)

    depth = ancestors.sum(-1)
    parent = torch.where(ancestors, col, torch.tensor(-1)).amax(-1)  # [bs, i]
    first_child = torch.where(ancestors, row, sentinel).amin(1)  # reduce over i, per column j
    next_token = torch.where(first_child < n, first_child, -1)
    same_parent = (parent[:, :, None] == parent[:, None, :]) & (row > col)  # [bs, k, t]
    first_sibling = torch.where(same_parent, row, sentinel).amin(1)
    next_sibling = torch.where((parent >= 0) & (first_sibling < n), first_sibling, -1)

    seq_lens = verified_seq_len.reshape(-1)[:bs].to(torch.int64)
    _flat(positions)[: bs * n] = (depth + seq_lens[:, None]).reshape(-1).to(positions.dtype)
    retrive_index[:bs].copy_(torch.arange(bs * n, dtype=torch.int64).view(bs, n))
    retrive_next_token[:bs].copy_(next_token)
    retrive_next_sibling[:bs].copy_(next_sibling)


# --------------------------------------------------------------------------------------------
# Small post-verify helpers
# --------------------------------------------------------------------------------------------


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
) -> None:
    """``bonus_tokens[i] = accept_tokens.flat[i * accept_stride + accept_lens[i] - 1]``: the last
    accepted token of every request (``accept_lens`` includes the bonus token)."""
    bs = accept_lens.numel()
    if bs == 0:
        return
    idx = torch.arange(bs, dtype=torch.int64) * accept_stride + accept_lens.reshape(-1).to(torch.int64) - 1
    _flat(bonus_tokens)[:bs] = accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype)


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
    size: int | None = None,
) -> None:
    """Compact ``out_cache_loc[accept_index]`` over the accepted (non ``-1``) entries of the
    flattened ``accept_index`` into the front of ``accept_out_cache_loc``.

    SGLang 0.5.23 calls this with three arguments; older sgl-kernel builds also took ``size``
    (the number of ``accept_index`` entries to scan), which is accepted for compatibility.
    """
    flat = accept_index.reshape(-1)
    if size is not None:
        flat = flat[:size]
    src = flat[flat >= 0].to(torch.int64)
    _flat(accept_out_cache_loc)[: src.numel()] = out_cache_loc.reshape(-1)[src].to(accept_out_cache_loc.dtype)


def rotate_input_ids_cpu(
    input_ids: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    topk_index: torch.Tensor,
    select_index: torch.Tensor | None = None,
) -> None:
    """Multi-layer EAGLE: shift every request's extend segment of ``input_ids`` left by one and
    write the new token ``topk_index[i]`` at the segment end (or at ``select_index[i]``)."""
    lens = extend_seq_lens.reshape(-1).to(torch.int64)
    bs = lens.numel()
    if bs == 0:
        return
    ids = _flat(input_ids)
    starts = extend_start_loc.reshape(-1).to(torch.int64)
    seg, off = _ragged(lens - 1)
    dst = starts[seg] + off
    # The right-hand side is gathered before the scatter, so the in-place shift is safe.
    ids[dst] = ids[dst + 1]
    has_token = lens > 0
    if select_index is not None:
        last = select_index.reshape(-1)[:bs].to(torch.int64)
    else:
        last = starts + lens - 1
    new_tokens = topk_index.reshape(-1)[:bs].to(ids.dtype)
    ids[last[has_token]] = new_tokens[has_token]


def build_draft_decode_metadata_cpu(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    pool_len: int,
) -> torch.Tensor:
    """Per-candidate ``req_to_token`` rows for the intel_amx multi-step draft decode.

    Returns ``[num_seqs * topk, pool_len]``: row ``b * topk + k`` holds request ``b``'s prefix
    (columns ``< seq_len``) followed by candidate ``k``'s draft slots, which sit at
    ``seq_len + k * num_steps + s`` in the request's row. Columns past ``seq_len + num_steps``
    keep the request row's values (the C++ op leaves them uninitialised; nothing reads them).
    """
    rows = req_to_token[req_pool_indices.reshape(-1).to(torch.int64), :pool_len]
    out = rows.repeat_interleave(topk, dim=0)
    lens = seq_lens.reshape(-1).to(torch.int64).tolist()
    for b, seq_len in enumerate(lens):
        for k in range(1, topk):  # candidate 0's slots are already in place
            src = seq_len + k * num_steps
            out[b * topk + k, seq_len : seq_len + num_steps] = rows[b, src : src + num_steps]
    return out


_U32 = 0xFFFFFFFF


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _U32


def _murmur3_mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = (k * 0xCC9E2D51) & _U32
    k = _rotl32(k, 15)
    k = (k * 0x1B873593) & _U32
    h = _rotl32(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & _U32


def _i32(value: int) -> int:
    """A 32-bit constant as the int32 with the same bits (int32 products keep the low 32 bits exact)."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _shr32(x: torch.Tensor, r: int) -> torch.Tensor:
    """Logical right shift of int32 bits (torch's >> on int32 is arithmetic: mask the sign's copies)."""
    return (x >> r) & ((1 << (32 - r)) - 1)


def _rotl32_i32(x: torch.Tensor, r: int) -> torch.Tensor:
    return (x << r) | _shr32(x, 32 - r)


def _keys(cols: torch.Tensor) -> torch.Tensor:
    k = (cols.reshape(-1).to(torch.int64) & _U32).to(torch.int32)
    return _rotl32_i32(k * _i32(0xCC9E2D51), 15) * _i32(0x1B873593)


@functools.lru_cache(maxsize=4)  # a vocabulary size or two per process
def vocab_keys(m: int, device: str = "cpu") -> torch.Tensor:
    """[m] int32: `column_keys` of columns 0 .. m - 1, computed once per vocabulary size."""
    return _keys(torch.arange(m, device=device))


def column_keys(col_indices: torch.Tensor) -> torch.Tensor:
    """[m] int32: murmur3's k transform of each column (k * c1, rotated by 15, * c2), the bits as int32:
    the half of the last mix that depends on the column alone. SGLang hashes `arange(vocab)`: cached."""
    m = col_indices.shape[0]
    if torch.equal(col_indices.reshape(-1).to(torch.int64), torch.arange(m, device=col_indices.device)):
        return vocab_keys(m, str(col_indices.device))
    return _keys(col_indices)


def murmur_hash32_reference(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """`murmur_hash32_cpu` written plainly, in int64 masked to 32 bits (the tests' reference; 4-5x slower)."""
    s = seed.reshape(-1).to(torch.int64)  # [n] the uint64's bits
    seed_lo = (s & _U32)[:, None]  # [n, 1]
    seed_hi = ((s >> 32) & _U32)[:, None]  # [n, 1] (arithmetic shift, then masked: the high word)
    pos = (positions.reshape(-1).to(torch.int64) & _U32)[:, None]  # [n, 1]
    col = (col_indices.reshape(-1).to(torch.int64) & _U32)[None, :]  # [1, m]
    h = torch.zeros_like(seed_lo)
    h = _murmur3_mix(h, seed_lo)
    h = _murmur3_mix(h, seed_hi)
    h = _murmur3_mix(h, pos)  # [n, 1]
    h = _murmur3_mix(h.expand(-1, col.shape[1]), col.expand(h.shape[0], -1))  # [n, m]
    h = h ^ 16
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _U32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _U32
    h = h ^ (h >> 16)
    return h.to(torch.uint32)


def murmur_row_states(seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[n] int32: the hash state after mixing each row's seed (two words) and position, the part of
    `murmur_hash32_cpu` that does not depend on the column (int64 arithmetic, as the reference)."""
    s = seed.reshape(-1).to(torch.int64)  # [n] the uint64's bits
    h = _murmur3_mix(torch.zeros_like(s), s & _U32)
    h = _murmur3_mix(h, (s >> 32) & _U32)  # arithmetic shift, then masked: the high word
    h = _murmur3_mix(h, positions.reshape(-1).to(torch.int64) & _U32)  # [n] in 0 .. 2**32 - 1
    return torch.where(h >= 1 << 31, h - (1 << 32), h).to(torch.int32)  # the same bits as int32


def murmur_finish_(h: torch.Tensor) -> torch.Tensor:
    """The column mix's end and the finalizer, in place on `h` (int32, any shape) = row state ^ column key
    (`column_keys`); returns `h` viewed as uint32, the hash."""
    h.copy_(_rotl32_i32(h, 13))
    h.mul_(5).add_(_i32(0xE6546B64))
    h ^= 16
    h ^= _shr32(h, 16)
    h.mul_(_i32(0x85EBCA6B))
    h ^= _shr32(h, 13)
    h.mul_(_i32(0xC2B2AE35))
    h ^= _shr32(h, 16)
    return h.view(torch.uint32)


def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """SGLang's MurmurHash3 of (64-bit seed, 32-bit position, 32-bit column), the noise of its seeded
    sampling (``sglang/kernels/ops/sampling/murmur_hash.py``: ``murmur_hash32_kernel``).

    seed: [n] any integer dtype (read as uint64); positions: [n]; col_indices: [m].
    Returns [n, m] uint32. Every seeded sample on CPU hashes the whole vocabulary of each row it draws
    (a verify: every draft row), so the [n, m] part is written for speed: int32 arithmetic, whose
    products and shifts keep the low 32 bits exact (half the memory traffic of int64), in place, with
    the column-only half of the last mix computed once per vocabulary (`column_keys`). Equal bit for bit
    to `murmur_hash32_reference` and to SGLang's Triton kernel (tested).
    """
    h = murmur_row_states(seed, positions)[:, None] ^ column_keys(col_indices)[None, :]  # [n, m] int32
    return murmur_finish_(h)


def register_torch_ops() -> None:
    """Define the ops SGLang calls as ``torch.ops.sgl_kernel.<name>`` (idempotent). Called by the
    stand-in package at import, so only where no real sgl_kernel exists."""
    if hasattr(torch.ops.sgl_kernel, "murmur_hash32_cpu"):
        return
    op = torch.library.custom_op("sgl_kernel::murmur_hash32_cpu", murmur_hash32_cpu, mutates_args=())

    @op.register_fake
    def _(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
        # SGLang compiles the sampler that calls it (torch.compile needs the output's shape)
        return seed.new_empty((seed.shape[0], col_indices.shape[0]), dtype=torch.uint32)


# Exposed by the lead's shim as ``sgl_kernel.<name>``.
OPS: dict[str, Callable[..., object]] = {
    "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    "assign_extend_cache_locs_cpu": assign_extend_cache_locs_cpu,
    "assign_draft_cache_locs_contiguous_cpu": assign_draft_cache_locs_contiguous_cpu,
    "build_tree_kernel_efficient_cpu": build_tree_kernel_efficient_cpu,
    "verify_tree_greedy_cpu": verify_tree_greedy_cpu,
    "fill_bonus_tokens_cpu": fill_bonus_tokens_cpu,
    "fill_accept_out_cache_loc_cpu": fill_accept_out_cache_loc_cpu,
    "rotate_input_ids_cpu": rotate_input_ids_cpu,
    "build_draft_decode_metadata_cpu": build_draft_decode_metadata_cpu,
}

# Exposed as ``sgl_kernel.speculative.<name>`` (NGRAM's reconstruct_tree.py imports it from there).
SPECULATIVE_OPS: dict[str, Callable[..., object]] = {
    "reconstruct_indices_from_tree_mask": reconstruct_indices_from_tree_mask,
}
