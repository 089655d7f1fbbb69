"""Tests for the pure-PyTorch ``sgl_kernel`` CPU ops in ``sglang_tts.platform.cpu.sgl_kernel_ops``.

Reference implementations come from SGLang itself wherever it has one: its Triton kernels for the
same ops, run by Triton's interpreter on CPU tensors, and NGRAM's numpy ``_derive_tree_links``.
The kernels are lifted out of SGLang's source files with ``ast`` and executed on their own, so the
test neither imports the heavy ``sglang.srt`` package nor needs ``sgl_kernel`` (several of those
modules import it at module level when they are not on CUDA).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from sglang_tts.platform.cpu import sgl_kernel_ops as ops

_SGLANG_DIR = Path(importlib.util.find_spec("sglang").origin).parent


def _load_sglang_functions(relpath: str, *names: str) -> SimpleNamespace:
    """Execute the named top-level functions of an SGLang source file in a private namespace.

    They are compiled under the real file name, so the Triton interpreter finds their source;
    ``@triton.jit`` kernels are returned as interpreter kernels.
    """
    path = _SGLANG_DIR / relpath
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert sorted(node.name for node in nodes) == sorted(names), f"{names} not all found in {relpath}"
    namespace: dict[str, object] = {"triton": triton, "tl": tl, "torch": torch, "np": np}
    # Runs trusted code from the installed sglang package: only its function definitions.
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return SimpleNamespace(**{name: _interpreted(namespace[name]) for name in names})


def _interpreted(fn: object) -> object:
    # Whether @triton.jit built an interpreter kernel depends on TRITON_INTERPRET at decoration
    # time; convert explicitly so the test does not depend on the environment it starts in.
    return InterpretedFunction(fn.fn) if isinstance(fn, JITFunction) else fn


@pytest.fixture(autouse=True, scope="module")
def _triton_interpreter() -> Iterator[None]:
    """Make the interpreter usable even when another test imported Triton in compiled mode.

    Triton's own ``@jit`` library functions (``tl.sum``, ``tl.max``, reduction combiners) are
    built at ``import triton`` time; an interpreter kernel can only call interpreter versions of
    them. Everything is restored after this module's tests.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        for name, module in list(sys.modules.items()):
            if name == "triton.language" or name.startswith("triton.language."):
                for attr, value in list(vars(module).items()):
                    if isinstance(value, JITFunction):
                        mp.setattr(module, attr, InterpretedFunction(value.fn))
        yield


REF_CACHE_LOCS = _load_sglang_functions(
    "kernels/ops/speculative/cache_locs.py", "assign_extend_cache_locs", "assign_draft_cache_locs_contiguous"
)
REF_ALLOC = _load_sglang_functions("srt/mem_cache/allocation.py", "assign_req_to_token_pool")
REF_CACHE_MOVE = _load_sglang_functions("kernels/ops/kvcache/cache_move.py", "copy_all_layer_kv_cache_tiled")
REF_TREE = _load_sglang_functions(
    "kernels/ops/speculative/spec_tree.py",
    "sgl_build_tree_kernel_efficient_triton",
    "verify_tree_greedy_kernel_triton",
)
REF_EAGLE = _load_sglang_functions("kernels/ops/speculative/eagle.py", "fill_bonus_tokens", "fill_accept_out_cache_loc")
REF_ROTATE = _load_sglang_functions("kernels/ops/speculative/multi_layer_eagle.py", "rotate_input_ids_kernel")
REF_RECONSTRUCT = _load_sglang_functions("kernels/ops/speculative/reconstruct_tree.py", "_reconstruct_tree_mask_kernel")
REF_NGRAM = _load_sglang_functions("srt/speculative/ngram_worker.py", "_derive_tree_links")


def test_reference_kernels_run_in_the_interpreter() -> None:
    # Guards the premise of every comparison below.
    assert isinstance(REF_EAGLE.fill_bonus_tokens, InterpretedFunction)


def _next_pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def _random_segments(gen: torch.Generator, bs: int, pool_len: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random [start, end) column ranges inside a req_to_token row, some of them empty."""
    lens = torch.randint(0, max_len + 1, (bs,), generator=gen)
    starts = torch.stack([torch.randint(0, pool_len - int(n) + 1, (1,), generator=gen)[0] for n in lens])
    return starts, starts + lens


# --------------------------------------------------------------------------------------------
# KV cache slot moves
# --------------------------------------------------------------------------------------------


def _kv_buffers(gen: torch.Generator, num_slots: int) -> list[torch.Tensor]:
    # Mixed dtypes and row widths, like K/V buffers of different layers or a scale buffer.
    return [
        torch.randn(num_slots, 2, 8, generator=gen),
        torch.randn(num_slots, 4, 4, generator=gen).to(torch.bfloat16),
        torch.randint(-100, 100, (num_slots, 5), generator=gen, dtype=torch.int8),
    ]


def _ptrs_and_strides(buffers: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.dtype.itemsize for b in buffers])
    return ptrs, strides


@pytest.mark.parametrize("num_locs", [1, 5, 17])
def test_copy_all_layer_kv_cache_matches_triton(num_locs: int) -> None:
    gen = torch.Generator().manual_seed(num_locs)
    num_slots = 40
    original = _kv_buffers(gen, num_slots)
    # Targets distinct; sources may overlap targets (the kernel must read before it writes).
    perm = torch.randperm(num_slots, generator=gen)
    tgt = perm[:num_locs]
    src = torch.cat([perm[num_locs // 2 : num_locs], perm[num_locs : num_locs + num_locs // 2 + 1]])[:num_locs]

    mine = [b.clone() for b in original]
    ops.copy_all_layer_kv_cache_cpu(*_ptrs_and_strides(mine), tgt, src)

    ref = [b.clone() for b in original]
    ref_ptrs, ref_strides = _ptrs_and_strides(ref)
    bytes_per_tile = 16
    byte_tiles = -(-int(ref_strides.max()) // bytes_per_tile)
    REF_CACHE_MOVE.copy_all_layer_kv_cache_tiled[(len(ref), byte_tiles)](
        ref_ptrs, ref_strides, tgt, src, num_locs, _next_pow2(num_locs), BYTES_PER_TILE=bytes_per_tile
    )

    for m, r, o in zip(mine, ref, original, strict=True):
        assert torch.equal(m, r)
        expected = o.clone()
        expected[tgt] = o[src]
        assert torch.equal(m, expected)


def test_copy_all_layer_kv_cache_empty_is_noop() -> None:
    buffers = _kv_buffers(torch.Generator().manual_seed(0), 4)
    before = [b.clone() for b in buffers]
    empty = torch.empty(0, dtype=torch.int64)
    ops.copy_all_layer_kv_cache_cpu(*_ptrs_and_strides(buffers), empty, empty)
    assert all(torch.equal(a, b) for a, b in zip(buffers, before, strict=True))


# --------------------------------------------------------------------------------------------
# req_to_token bookkeeping
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bs", [1, 3, 6])
def test_assign_req_to_token_pool_matches_triton(bs: int) -> None:
    gen = torch.Generator().manual_seed(bs)
    pool_rows, pool_len = 8, 24
    req_to_token = torch.randint(0, 1000, (pool_rows, pool_len), generator=gen, dtype=torch.int32)
    rows = torch.randperm(pool_rows, generator=gen)[:bs]
    start, end = _random_segments(gen, bs, pool_len, max_len=9)
    out_cache_loc = torch.randint(0, 5000, (int((end - start).sum()),), generator=gen)

    mine = req_to_token.clone()
    ops.assign_req_to_token_pool_cpu(rows, mine, start, end, out_cache_loc, pool_len)
    ref = req_to_token.clone()
    REF_ALLOC.assign_req_to_token_pool[(bs,)](rows, ref, start, end, out_cache_loc, pool_len, _next_pow2(bs))
    assert torch.equal(mine, ref)
    assert mine.dtype == torch.int32


@pytest.mark.parametrize(("bs", "index_dtype"), [(1, torch.int64), (4, torch.int64), (5, torch.int32)])
def test_assign_extend_cache_locs_matches_triton(bs: int, index_dtype: torch.dtype) -> None:
    # int32 offsets are what fill_front_out_cache_loc_func passes; int64 is the NGRAM/DFLASH path.
    gen = torch.Generator().manual_seed(10 + bs)
    pool_rows, pool_len = 8, 20
    req_to_token = torch.randint(0, 1000, (pool_rows, pool_len), generator=gen, dtype=torch.int32)
    rows = torch.randperm(pool_rows, generator=gen)[:bs]
    start, end = _random_segments(gen, bs, pool_len, max_len=7)
    start, end = start.to(index_dtype), end.to(index_dtype)
    # The untouched tail keeps its fill value, as with SGLang's over-sized output buffer.
    out_size = int((end - start).sum()) + 3

    mine = torch.full((out_size,), -7, dtype=torch.int64)
    ops.assign_extend_cache_locs_cpu(rows, req_to_token, start, end, mine, pool_len)
    ref = torch.full((out_size,), -7, dtype=torch.int64)
    REF_CACHE_LOCS.assign_extend_cache_locs[(bs,)](rows, req_to_token, start, end, ref, pool_len, _next_pow2(bs))
    assert torch.equal(mine, ref)


@pytest.mark.parametrize(("bs", "topk", "num_steps"), [(1, 1, 3), (3, 2, 2), (4, 4, 3)])
def test_assign_draft_cache_locs_contiguous_matches_triton(bs: int, topk: int, num_steps: int) -> None:
    gen = torch.Generator().manual_seed(bs * 100 + topk)
    pool_rows, pool_len = 6, 32
    req_to_token = torch.randint(0, 1000, (pool_rows, pool_len), generator=gen, dtype=torch.int32)
    rows = torch.randperm(pool_rows, generator=gen)[:bs]
    seq_lens = torch.randint(1, pool_len - topk * num_steps + 1, (bs,), generator=gen)

    mine = torch.empty(bs * topk * num_steps, dtype=torch.int64)
    ops.assign_draft_cache_locs_contiguous_cpu(rows, req_to_token, seq_lens, mine, pool_len, topk, num_steps)
    ref = torch.empty(bs * topk * num_steps, dtype=torch.int64)
    REF_CACHE_LOCS.assign_draft_cache_locs_contiguous[(bs,)](
        rows, req_to_token, seq_lens, ref, pool_len, topk, num_steps, BS=bs
    )
    assert torch.equal(mine, ref)


# --------------------------------------------------------------------------------------------
# EAGLE trees
# --------------------------------------------------------------------------------------------


def _random_eagle_draft(
    gen: torch.Generator, bs: int, topk: int, num_steps: int, num_draft_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent_list, top_scores_index) as EAGLE's multi-step draft produces them.

    Mirrors ``select_top_k_tokens`` + ``organize_draft_results``: step 0 keeps ``topk`` children
    of the root; every later step scores ``topk * topk`` expansions of the kept branches and keeps
    the best ``topk``; the tree is the ``n - 1`` best-scored tokens overall. Branch
    probabilities are < 1, so a child always scores below its parent and the tree is connected.
    """
    probs = torch.rand(bs, topk, generator=gen) * 0.98 + 0.01
    scores = probs
    score_list = [probs.unsqueeze(1)]
    parents_list = [torch.arange(-1, topk).expand(bs, -1)]
    for i in range(1, num_steps):
        expand = scores.unsqueeze(2) * (torch.rand(bs, topk, topk, generator=gen) * 0.98 + 0.01)
        scores, chosen = torch.topk(expand.flatten(1), topk, dim=-1)
        score_list.append(expand)
        parents_list.append(chosen + topk * topk * (i - 1) + topk)
    flat_scores = torch.cat(score_list, dim=1).flatten(1)
    top_scores_index = torch.sort(torch.topk(flat_scores, num_draft_tokens - 1, dim=-1).indices).values
    if num_steps > 1:
        parent_list = torch.cat(parents_list[:-1], dim=1)
    else:
        parent_list = torch.empty(bs, 0, dtype=torch.long)
    return parent_list, top_scores_index


def _mask_size(mode: int, bs: int, n: int, seq_lens: torch.Tensor) -> int:
    if mode == ops.FULL_MASK:
        return int(seq_lens.sum()) * n + bs * n * n
    return bs * n * n


def _build_tree(
    builder: str,
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    n: int,
    mode: int,
) -> tuple[torch.Tensor, ...]:
    """Run either implementation with buffers allocated and pre-filled as SGLang's
    ``build_tree_kernel_efficient`` does."""
    bs = seq_lens.numel()
    if mode == ops.QLEN_ONLY_BITPACKING:
        dtype = [torch.uint8, torch.uint16, torch.uint32][int(np.ceil(np.log2((n + 7) // 8)))]
        tree_mask = torch.zeros(bs * n, dtype=dtype)
    else:
        tree_mask = torch.full((_mask_size(mode, bs, n, seq_lens),), True)
    retrieve = torch.full((3, bs, n), -1, dtype=torch.long)
    positions = torch.empty(bs * n, dtype=torch.long)
    args = (parent_list, top_scores_index, seq_lens, tree_mask, positions, retrieve[0], retrieve[1], retrieve[2])
    if builder == "mine":
        ops.build_tree_kernel_efficient_cpu(*args, topk, num_steps, n, mode)
    else:
        REF_TREE.sgl_build_tree_kernel_efficient_triton[(bs,)](
            *args[:3],
            torch.cumsum(seq_lens, 0) - seq_lens,
            *args[3:],
            topk=topk,
            depth=num_steps,
            draft_token_num=n,
            tree_mask_mode=mode,
            batch_size=bs,
            parent_list_stride=parent_list.stride(0) if parent_list.dim() > 1 else parent_list.shape[0],
            selected_index_stride=top_scores_index.stride(0),
        )
    return tree_mask, positions, retrieve[0], retrieve[1], retrieve[2]


# (bs, topk, num_steps, num_draft_tokens): chains (topk 1), single-step trees, bushy trees.
TREE_CASES = [
    (1, 1, 3, 4),
    (3, 1, 5, 6),
    (2, 4, 1, 5),
    (1, 2, 3, 6),
    (4, 2, 4, 8),
    (3, 4, 3, 12),
    (1, 3, 5, 17),
]


@pytest.mark.parametrize(("bs", "topk", "num_steps", "n"), TREE_CASES)
@pytest.mark.parametrize("mode", [ops.FULL_MASK, ops.QLEN_ONLY])
def test_build_tree_matches_triton(bs: int, topk: int, num_steps: int, n: int, mode: int) -> None:
    gen = torch.Generator().manual_seed(bs * 1000 + topk * 100 + num_steps * 10 + n)
    parent_list, top_scores_index = _random_eagle_draft(gen, bs, topk, num_steps, n)
    seq_lens = torch.randint(1, 9, (bs,), generator=gen)
    mine = _build_tree("mine", parent_list, top_scores_index, seq_lens, topk, num_steps, n, mode)
    ref = _build_tree("triton", parent_list, top_scores_index, seq_lens, topk, num_steps, n, mode)
    for name, m, r in zip(("tree_mask", "positions", "index", "next_token", "next_sibling"), mine, ref, strict=True):
        assert m.dtype == r.dtype
        assert torch.equal(m, r), name
    # Every node sees the root plus its `depth` path nodes (itself and its non-root ancestors).
    if mode == ops.QLEN_ONLY:
        tree = mine[0].view(bs, n, n)
        depth = mine[1].view(bs, n) - seq_lens[:, None]
        assert torch.equal(tree.sum(-1), depth + 1)
        assert tree[:, :, 0].all()


@pytest.mark.parametrize(("bs", "topk", "num_steps", "n"), TREE_CASES)
def test_build_tree_bitpacked_packs_the_qlen_mask(bs: int, topk: int, num_steps: int, n: int) -> None:
    # SGLang's Triton port has no bit-packed mode, so pack its QLEN_ONLY mask here.
    gen = torch.Generator().manual_seed(7 + n)
    parent_list, top_scores_index = _random_eagle_draft(gen, bs, topk, num_steps, n)
    seq_lens = torch.randint(1, 9, (bs,), generator=gen)
    packed, *links = _build_tree("mine", parent_list, top_scores_index, seq_lens, topk, num_steps, n, 2)
    dense, *ref_links = _build_tree("triton", parent_list, top_scores_index, seq_lens, topk, num_steps, n, 1)

    weights = torch.tensor([1 << c for c in range(n)], dtype=torch.int64)
    expected = (dense.view(bs * n, n).to(torch.int64) * weights).sum(-1)
    assert torch.equal(packed.to(torch.int64) & 0xFFFFFFFF, expected)
    for m, r in zip(links, ref_links, strict=True):
        assert torch.equal(m, r)


def test_build_tree_full_mask_keeps_prefix_columns() -> None:
    # The prefix part of FULL_MASK rows belongs to the caller's fill; only tree columns are written.
    gen = torch.Generator().manual_seed(3)
    bs, topk, num_steps, n = 2, 2, 3, 5
    parent_list, top_scores_index = _random_eagle_draft(gen, bs, topk, num_steps, n)
    seq_lens = torch.tensor([3, 6])
    tree_mask = torch.zeros(_mask_size(0, bs, n, seq_lens), dtype=torch.bool)
    retrieve = torch.full((3, bs, n), -1, dtype=torch.long)
    positions = torch.empty(bs * n, dtype=torch.long)
    ops.build_tree_kernel_efficient_cpu(
        parent_list, top_scores_index, seq_lens, tree_mask, positions, *retrieve, topk, num_steps, n, 0
    )
    offset = 0
    for b, seq_len in enumerate(seq_lens.tolist()):
        block = tree_mask[offset : offset + n * (seq_len + n)].view(n, seq_len + n)
        assert not block[:, :seq_len].any()
        assert block[:, seq_len].all()  # root column
        assert torch.equal(block[:, seq_len:].diagonal(), torch.ones(n, dtype=torch.bool))
        offset += n * (seq_len + n)
        assert positions[b * n] == seq_len


def _verify(
    impl: str,
    candidates: torch.Tensor,
    links: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    target_predict: torch.Tensor,
    num_spec_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bs, n = candidates.shape
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, num_spec_tokens), -1, dtype=torch.int32)
    accept_token_num = torch.empty(bs, dtype=torch.int32)
    if impl == "mine":
        # Keyword names exactly as sglang's verify_tree_greedy_func passes them.
        ops.verify_tree_greedy_cpu(
            predicts=predicts,
            accept_index=accept_index,
            accept_token_num=accept_token_num,
            candidates=candidates,
            retrive_index=links[0],
            retrive_next_token=links[1],
            retrive_next_sibling=links[2],
            target_predict=target_predict,
        )
    else:
        REF_TREE.verify_tree_greedy_kernel_triton[(bs,)](
            predicts,
            accept_index,
            accept_token_num,
            candidates,
            *links,
            target_predict,
            batch_size=bs,
            num_speculative_tokens=num_spec_tokens,
            num_draft_tokens=n,
        )
    return predicts, accept_index, accept_token_num


def _plant_matches(
    gen: torch.Generator, candidates: torch.Tensor, next_token: torch.Tensor, next_sibling: torch.Tensor
) -> torch.Tensor:
    """Random target predictions where a node's prediction often equals one of its children's
    draft token, so verification accepts paths of varied length."""
    bs, n = candidates.shape
    target = torch.randint(0, 5, (bs, n), generator=gen)
    for b in range(bs):
        for node in range(n):
            children = []
            child = int(next_token[b, node])
            while child != -1 and len(children) < n:
                children.append(child)
                child = int(next_sibling[b, child])
            if children and torch.rand(1, generator=gen).item() < 0.75:
                pick = children[int(torch.randint(0, len(children), (1,), generator=gen))]
                target[b, node] = candidates[b, pick]
    return target


@pytest.mark.parametrize(("bs", "topk", "num_steps", "n"), TREE_CASES)
def test_verify_tree_greedy_matches_triton_on_eagle_trees(bs: int, topk: int, num_steps: int, n: int) -> None:
    gen = torch.Generator().manual_seed(bs + topk + num_steps + n)
    parent_list, top_scores_index = _random_eagle_draft(gen, bs, topk, num_steps, n)
    seq_lens = torch.randint(1, 9, (bs,), generator=gen)
    _, _, index, next_token, next_sibling = _build_tree(
        "mine", parent_list, top_scores_index, seq_lens, topk, num_steps, n, 1
    )
    candidates = torch.randint(0, 5, (bs, n), generator=gen)
    target = _plant_matches(gen, candidates, next_token, next_sibling)

    mine = _verify("mine", candidates, (index, next_token, next_sibling), target, num_steps + 1)
    ref = _verify("triton", candidates, (index, next_token, next_sibling), target, num_steps + 1)
    for name, m, r in zip(("predicts", "accept_index", "accept_token_num"), mine, ref, strict=True):
        assert torch.equal(m, r), name


def test_verify_tree_greedy_accepts_the_matching_chain() -> None:
    # Hand-made tree: 0 -> {1, 2}, 1 -> {3}, 2 -> {4}; the target follows 0 -> 2 -> 4.
    candidates = torch.tensor([[9, 5, 6, 7, 8]])
    index = torch.arange(5).view(1, 5)
    next_token = torch.tensor([[1, 3, 4, -1, -1]])
    next_sibling = torch.tensor([[-1, 2, -1, -1, -1]])
    target = torch.tensor([[6, 0, 8, 0, 3]])
    predicts, accept_index, num = _verify("mine", candidates, (index, next_token, next_sibling), target, 4)
    assert accept_index.tolist() == [[0, 2, 4, -1]]
    assert num.tolist() == [2]
    assert predicts.tolist() == [6, 0, 8, 0, 3]


# --------------------------------------------------------------------------------------------
# NGRAM trees
# --------------------------------------------------------------------------------------------


def _random_ngram_mask(gen: torch.Generator, bs: int, n: int) -> torch.Tensor:
    """[bs * n * n] bool: node i (parent drawn among 0..i-1) sees itself and its ancestors."""
    mask = torch.zeros(bs, n, n, dtype=torch.bool)
    for b in range(bs):
        for i in range(n):
            mask[b, i, i] = True
            if i > 0:
                parent = int(torch.randint(0, i, (1,), generator=gen))
                mask[b, i] |= mask[b, parent]
    return mask.view(-1)


def _reconstruct(impl: str, tree_mask: torch.Tensor, seq_lens: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    bs = seq_lens.numel()
    positions = torch.full((bs * n,), -5, dtype=torch.int64)
    retrieve = torch.full((3, bs, n), -5, dtype=torch.int64)
    args = (tree_mask, seq_lens, positions, retrieve[0], retrieve[1], retrieve[2])
    if impl == "mine":
        ops.reconstruct_indices_from_tree_mask(*args, bs, n)
    else:
        REF_RECONSTRUCT._reconstruct_tree_mask_kernel[(bs,)](*args, n, _next_pow2(n))
    return positions, retrieve[0], retrieve[1], retrieve[2]


@pytest.mark.parametrize(("bs", "n"), [(1, 1), (2, 2), (1, 5), (3, 8), (4, 13)])
def test_reconstruct_indices_matches_triton_and_derive_tree_links(bs: int, n: int) -> None:
    gen = torch.Generator().manual_seed(bs * 50 + n)
    seq_lens = torch.randint(1, 30, (bs,), generator=gen)
    for _ in range(3):
        tree_mask = _random_ngram_mask(gen, bs, n)
        mine = _reconstruct("mine", tree_mask, seq_lens, n)
        ref = _reconstruct("triton", tree_mask, seq_lens, n)
        for name, m, r in zip(("positions", "index", "next_token", "next_sibling"), mine, ref, strict=True):
            assert torch.equal(m, r), name
        next_token, next_sibling = REF_NGRAM._derive_tree_links(tree_mask.numpy(), bs, n)
        assert torch.equal(mine[2], next_token)
        assert torch.equal(mine[3], next_sibling)
        # A uint8 mask (the other spelling callers use) gives the same result.
        as_bytes = _reconstruct("mine", tree_mask.to(torch.uint8), seq_lens, n)
        assert all(torch.equal(a, b) for a, b in zip(as_bytes, mine, strict=True))


def test_verify_tree_greedy_matches_triton_on_ngram_trees() -> None:
    gen = torch.Generator().manual_seed(11)
    bs, n = 3, 8
    seq_lens = torch.randint(1, 30, (bs,), generator=gen)
    links = _reconstruct("mine", _random_ngram_mask(gen, bs, n), seq_lens, n)[1:]
    candidates = torch.randint(0, 4, (bs, n), generator=gen)
    target = _plant_matches(gen, candidates, links[1], links[2])
    mine = _verify("mine", candidates, links, target, n)
    ref = _verify("triton", candidates, links, target, n)
    assert all(torch.equal(m, r) for m, r in zip(mine, ref, strict=True))


# --------------------------------------------------------------------------------------------
# Post-verify helpers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bs", [1, 4, 7])
def test_fill_bonus_tokens_matches_triton(bs: int) -> None:
    gen = torch.Generator().manual_seed(bs)
    stride = 4
    accept_tokens = torch.randint(0, 1000, (bs, stride), generator=gen, dtype=torch.int32)
    accept_lens = torch.randint(1, stride + 1, (bs,), generator=gen, dtype=torch.int32)
    mine = torch.empty(bs, dtype=torch.int32)
    ops.fill_bonus_tokens_cpu(accept_tokens, accept_lens, mine, stride)
    ref = torch.empty(bs, dtype=torch.int32)
    REF_EAGLE.fill_bonus_tokens[(bs,)](accept_tokens, accept_lens, ref, stride)
    assert torch.equal(mine, ref)


@pytest.mark.parametrize("bs", [1, 3, 6])
def test_fill_accept_out_cache_loc_matches_triton(bs: int) -> None:
    gen = torch.Generator().manual_seed(bs)
    num_spec, n = 4, 6
    accepted = torch.randint(1, num_spec + 1, (bs,), generator=gen)
    accept_index = torch.full((bs, num_spec), -1, dtype=torch.int32)
    for b, k in enumerate(accepted.tolist()):
        accept_index[b, :k] = torch.sort(torch.randperm(n, generator=gen)[:k]).values.to(torch.int32) + b * n
    out_cache_loc = torch.randint(0, 10_000, (bs * n,), generator=gen)
    size = accept_index.numel()

    mine = torch.zeros(size, dtype=torch.int64)
    ops.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, mine)
    ref = torch.zeros(size, dtype=torch.int64)
    REF_EAGLE.fill_accept_out_cache_loc[(size,)](accept_index, out_cache_loc, ref, _next_pow2(size))
    assert torch.equal(mine, ref)
    # The optional legacy `size` argument gives the same result.
    legacy = torch.zeros(size, dtype=torch.int64)
    ops.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, legacy, size)
    assert torch.equal(legacy, ref)


@pytest.mark.parametrize("use_select_index", [False, True])
@pytest.mark.parametrize("bs", [1, 5])
def test_rotate_input_ids_matches_triton(bs: int, use_select_index: bool) -> None:
    gen = torch.Generator().manual_seed(bs + 10 * use_select_index)
    lens = torch.randint(0, 12, (bs,), generator=gen)
    lens[0] = max(int(lens[0]), 1)
    starts = torch.cumsum(lens, 0) - lens
    input_ids = torch.randint(0, 1000, (int(lens.sum()) + 2,), generator=gen)
    topk_index = torch.randint(1000, 2000, (bs, 1), generator=gen)
    select_index = None
    if use_select_index:
        # Somewhere inside each non-empty segment (e.g. a padded request's real last token).
        select_index = starts + (torch.rand(bs, generator=gen) * lens.clamp(min=1)).long()

    mine = input_ids.clone()
    ops.rotate_input_ids_cpu(mine, starts, lens, topk_index, select_index)
    ref = input_ids.clone()
    REF_ROTATE.rotate_input_ids_kernel[(bs,)](ref, starts, lens, topk_index, select_index, BLOCK_SIZE=8)
    assert torch.equal(mine, ref)


def test_build_draft_decode_metadata_layout() -> None:
    gen = torch.Generator().manual_seed(0)
    pool_rows, pool_len, topk, num_steps = 5, 30, 3, 4
    req_to_token = torch.randint(0, 1000, (pool_rows, pool_len), generator=gen, dtype=torch.int32)
    rows = torch.tensor([3, 0])
    seq_lens = torch.tensor([7, 12])
    out = ops.build_draft_decode_metadata_cpu(req_to_token, rows, seq_lens, topk, num_steps, pool_len)
    assert out.shape == (2 * topk, pool_len)
    assert out.dtype == torch.int32
    for b, (row, seq_len) in enumerate(zip(rows.tolist(), seq_lens.tolist(), strict=True)):
        for k in range(topk):
            draft_row = out[b * topk + k]
            assert torch.equal(draft_row[:seq_len], req_to_token[row, :seq_len])
            for s in range(num_steps):
                assert draft_row[seq_len + s] == req_to_token[row, seq_len + k * num_steps + s]


# --------------------------------------------------------------------------------------------
# Exported tables
# --------------------------------------------------------------------------------------------


def test_exported_names_cover_sglang_cpu_imports() -> None:
    assert set(ops.OPS) == {
        "copy_all_layer_kv_cache_cpu",
        "assign_req_to_token_pool_cpu",
        "assign_extend_cache_locs_cpu",
        "assign_draft_cache_locs_contiguous_cpu",
        "build_tree_kernel_efficient_cpu",
        "verify_tree_greedy_cpu",
        "fill_bonus_tokens_cpu",
        "fill_accept_out_cache_loc_cpu",
        "rotate_input_ids_cpu",
        "build_draft_decode_metadata_cpu",
    }
    assert set(ops.SPECULATIVE_OPS) == {"reconstruct_indices_from_tree_mask"}
    for name, fn in {**ops.OPS, **ops.SPECULATIVE_OPS}.items():
        assert fn.__name__ == name
    # verify_tree_greedy_func passes these by keyword, with the CUDA schema's spelling.
    params = inspect.signature(ops.verify_tree_greedy_cpu).parameters
    assert {"retrive_index", "retrive_next_token", "retrive_next_sibling"} <= set(params)


# --------------------------------------------------------------------------------------------
# Seeded sampling's noise: MurmurHash3 of (seed, position, column)
# --------------------------------------------------------------------------------------------

REF_MURMUR = _load_sglang_functions(
    "kernels/ops/sampling/murmur_hash.py", "rotl32", "fmix32", "murmur3_mix", "murmur_hash32_kernel"
)


def test_murmur_hash32_equals_sglangs_triton_kernel() -> None:
    # Seeds across the int64 range (negative ones are uint64s with the top bit set), positions past
    # 2**31, and more columns than one kernel block.
    seed = torch.tensor([0, 1, 42, 2**63 - 1, -5, 123456789012345, -(2**63)], dtype=torch.int64)
    positions = torch.tensor([0, 7, 100_000, 3, 2**31 + 5, 9, 2**32 - 1], dtype=torch.int64)
    cols = torch.arange(2_500, dtype=torch.int64)
    n, m = len(seed), len(cols)
    ref = torch.empty((n, m), dtype=torch.uint32)
    # the kernel's helpers must be interpreter functions in its namespace too
    kernel = REF_MURMUR.murmur_hash32_kernel
    kernel.fn.__globals__.update(rotl32=REF_MURMUR.rotl32, fmix32=REF_MURMUR.fmix32, murmur3_mix=REF_MURMUR.murmur3_mix)
    kernel[(n, triton.cdiv(m, 1024))](seed.to(torch.uint64), positions, cols, ref, n, m, BLOCK_SIZE=1024)
    out = ops.murmur_hash32_cpu(seed.to(torch.uint64), positions, cols)
    assert out.dtype == torch.uint32 and out.shape == (n, m)
    assert torch.equal(out.to(torch.int64), ref.to(torch.int64))
    assert out.to(torch.int64).unique().numel() > 0.99 * n * m  # noise, not a pattern


def test_murmur_hash32_is_a_torch_op_with_a_shape_function() -> None:
    ops.register_torch_ops()
    ops.register_torch_ops()  # idempotent
    seed = torch.tensor([3, 4], dtype=torch.int64)
    positions = torch.tensor([10, 11])
    cols = torch.arange(5)
    out = torch.ops.sgl_kernel.murmur_hash32_cpu.default(seed, positions, cols)
    assert torch.equal(out.to(torch.int64), ops.murmur_hash32_cpu(seed, positions, cols).to(torch.int64))
    fake = torch.ops.sgl_kernel.murmur_hash32_cpu.default(seed.to("meta"), positions.to("meta"), cols.to("meta"))
    assert fake.shape == (2, 5) and fake.dtype == torch.uint32
