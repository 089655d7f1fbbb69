"""Pieces of TTSDFlashWorker that need no server (the served behaviour is in test_tts_dflash_serving.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry
from sglang_testing import FakeReq, allocated_bytes, core, forbid_host_reads

from sglang_tts.config import TTSConfig
from sglang_tts.sglang import dflash_worker
from sglang_tts.sglang.dflash_worker import TTSDFlashWorker, block_rows, refresh_fused_kv_weights
from sglang_tts.sglang.metrics import SchedulerMetrics
from sglang_tts.sglang.runtime import TTSRuntime

BLOCK = 4


def _worker(stride: int) -> TTSDFlashWorker:
    """The worker's TTS half (SGLang's half is not constructed)."""
    config = TTSConfig(update_stride=stride, stride_pinned=True, lr=1e-3, reg_lambda=0.0, log_interval=0, sync=True)
    worker = object.__new__(TTSDFlashWorker)
    worker.tts = TTSRuntime(core.TinyDrafter(), config, None, "cpu")
    worker.tts.metrics = SchedulerMetrics(CollectorRegistry())
    worker.block_size = BLOCK
    worker._feature_dim = core.FEATURES
    worker._past_kv = lambda batch, ends: lambda r: [(torch.zeros(2, ends[r], 8), torch.zeros(2, ends[r], 8))]
    return worker


def _round(worker: TTSDFlashWorker, generator: torch.Generator, positions: list[int]):
    inputs = _verify_outputs(worker, generator, positions)
    _run(worker, *inputs)
    return inputs[1], inputs[2]


def _verify_outputs(worker: TTSDFlashWorker, generator: torch.Generator, positions: list[int]):
    bs = len(positions)
    batch = SimpleNamespace(reqs=[FakeReq(f"r{i}") for i in range(bs)], seq_lens=torch.tensor(positions))
    hidden = torch.randn(bs * BLOCK, core.FEATURES, generator=generator)
    result = SimpleNamespace(
        accept_lens=torch.randint(1, BLOCK + 1, (bs,), generator=generator, dtype=torch.int32),
        logits_output=SimpleNamespace(next_token_logits=torch.randn(bs * BLOCK, core.VOCAB, generator=generator)),
    )
    worker._draft_block_tokens_buf = torch.randint(0, core.VOCAB, (bs, BLOCK), generator=generator)
    return batch, hidden, result


def _run(worker: TTSDFlashWorker, batch, hidden, result) -> None:
    """What forward_batch_generation does around SGLang's draft-verify-accept (the block's target
    features arrive through _append_target_hidden_to_draft_kv_by_loc)."""
    rids = [req.rid for req in batch.reqs]
    worker.tts.before_draft(rids)
    capture = worker.tts.distiller.next_round_submits()
    prefix_lens = batch.seq_lens.clone()
    worker._captured_hidden = hidden
    worker._after_verify(batch, rids, prefix_lens, result, capture)
    worker.tts.verified(batch.reqs)


@pytest.mark.parametrize("context", [64, 4096])
def test_a_round_without_update_reads_nothing_on_the_host_and_keeps_the_block_on_the_device(monkeypatch, context):
    generator = torch.Generator().manual_seed(0)
    worker = _worker(stride=1_000)
    bs = 3

    forbid_host_reads(monkeypatch)
    batch, hidden, result = _verify_outputs(worker, generator, [context] * bs)
    allocated = allocated_bytes(lambda: _run(worker, batch, hidden, result))
    monkeypatch.undo()

    # One copy of the blocks' features and of the committed lengths: nothing of the context's size.
    assert bs * BLOCK * core.FEATURES * 4 <= allocated <= bs * BLOCK * core.FEATURES * 4 + 4096
    # The next round (at position context + committed) finds exactly the committed rows as context.
    commit = result.accept_lens.tolist()
    rids = [f"r{r}" for r in range(bs)]
    contexts = worker.tts.recent_contexts(rids, [context + n for n in commit])
    for r, (features, start) in enumerate(contexts):
        assert start == context
        torch.testing.assert_close(features, hidden[r * BLOCK : r * BLOCK + commit[r]])
    # A request whose next position does not follow its context (retracted, resumed) gets none.
    assert worker.tts.recent_contexts(["r0", "gone"], [context + commit[0] + 1, 0]) == [None, None]


def test_update_rounds_condition_on_the_last_rounds_committed_features(monkeypatch):
    generator = torch.Generator().manual_seed(1)
    worker = _worker(stride=2)  # rounds 0 and 1 are one stride: round 1 submits
    built = []
    real = dflash_worker.build_canvas

    def spy(**kwargs):
        built.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(dflash_worker, "build_canvas", spy)
    hidden, result = _round(worker, generator, [10, 20])
    assert built == []  # no canvas in a round that submits nothing
    commit = result.accept_lens.tolist()
    _, second = _round(worker, generator, [10 + commit[0], 20 + commit[1]])
    (kwargs,) = built
    assert kwargs["seq_lens"] == [10 + commit[0], 20 + commit[1]]
    assert kwargs["num_accepted"] == [n - 1 for n in second.accept_lens.tolist()]
    for r, (features, start) in enumerate(kwargs["context_features"]):
        assert start == (10, 20)[r]
        torch.testing.assert_close(features, hidden[r * BLOCK : r * BLOCK + commit[r]])


def test_reports_wait_for_sglangs_host_copy():
    generator = torch.Generator().manual_seed(2)
    worker = _worker(stride=1_000)
    _round(worker, generator, [5, 6])
    assert [worker.tts.counters(rid).rounds for rid in ("r0", "r1")] == [0, 0]
    worker.on_verify_complete_cpu([3, 0], batch_size=2)
    assert [worker.tts.counters(rid).rounds for rid in ("r0", "r1")] == [1, 1]
    assert {site: n for site, n in worker.tts.failures.counts.items() if n} == {}


def test_block_rows_take_the_accepted_drafts_and_the_first_rejected_position():
    assert block_rows(4, [1, 3], "accepted") == [[0], [4, 5, 6]]
    assert block_rows(4, [1, 3], "full") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def _layers(num_layers=2, heads=2, kv_heads=1, head_dim=4, hidden=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    rotary = SimpleNamespace(rotary_dim=head_dim, is_neox_style=True)
    return [
        SimpleNamespace(
            self_attn=SimpleNamespace(
                qkv_proj=SimpleNamespace(weight=torch.randn(q_size + 2 * kv_size, hidden, generator=gen)),
                q_size=q_size,
                kv_size=kv_size,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                rotary_emb=rotary,
                k_norm=SimpleNamespace(weight=torch.randn(head_dim, generator=gen), variance_epsilon=1e-6),
            )
        )
        for _ in range(num_layers)
    ]


def test_the_fused_context_kv_helper_sees_published_weights():
    """SGLang's fused helper (used on CUDA) stacks copies of the K/V projections at start-up; after
    a publish into the layers they are rewritten in place to what a fresh helper would hold."""
    from sglang.kernels.ops.speculative.fused_kv_materialize import FusedKVMaterializeHelper

    layers = _layers()

    def helper_for(ls):
        return FusedKVMaterializeHelper(ls, ls[0].self_attn.rotary_emb, 1, 4, torch.device("cpu"))

    helper = helper_for(layers)
    stacked, norms = helper.flat_kv_weight_t, helper.k_norm_weights
    for layer, new in zip(layers, _layers(seed=1)):  # the publish: param.copy_ into every layer
        layer.self_attn.qkv_proj.weight.copy_(new.self_attn.qkv_proj.weight)
        layer.self_attn.k_norm.weight.copy_(new.self_attn.k_norm.weight)
    assert not torch.equal(stacked, helper_for(layers).flat_kv_weight_t)

    refresh_fused_kv_weights(helper, layers)
    fresh = helper_for(layers)
    assert helper.flat_kv_weight_t is stacked and helper.k_norm_weights is norms  # in place
    assert torch.equal(helper.flat_kv_weight_t, fresh.flat_kv_weight_t)
    assert torch.equal(helper.k_norm_weights, fresh.k_norm_weights)
