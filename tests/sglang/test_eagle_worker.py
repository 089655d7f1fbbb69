"""TTSEagleWorker's per-round work without a server (SGLang's verify outputs are synthetic): a
round that submits no update reads nothing on the host and allocates nothing that grows with the
context; update rounds gather the canvas once, into the Distiller's preallocated buffers, which
stop moving once the largest batch has been seen; reports wait for SGLang's host copy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry
from sglang_testing import FakeReq, allocated_bytes, core, forbid_host_reads

from sglang_tts.config import TTSConfig
from sglang_tts.sglang.eagle_worker import TTSEagleWorker
from sglang_tts.sglang.metrics import SchedulerMetrics
from sglang_tts.sglang.runtime import TTSRuntime

N = 4  # draft tokens per request (chain of 3 + the verified token)


def _worker(stride: int, context_reads: list[int]) -> TTSEagleWorker:
    """The worker's TTS half on a tiny drafter; SGLang's half is not constructed."""
    config = TTSConfig(update_stride=stride, stride_pinned=True, lr=1e-3, reg_lambda=0.0, log_interval=0, sync=True)
    worker = object.__new__(TTSEagleWorker)
    worker.tts = TTSRuntime(core.TinyDrafter(), config, None, "cpu")
    worker.tts.metrics = SchedulerMetrics(CollectorRegistry())
    worker.topk = 1
    worker.speculative_num_draft_tokens = N
    worker.adaptive_controller = None

    def past_kv(batch, seq_lens):  # the drafter's cached K/V: what grows with the context
        context_reads.append(max(seq_lens))

        def read(r):
            length = seq_lens[r] - 1
            return [(torch.zeros(2, length, 8), torch.zeros(2, length, 8))]

        return read

    worker._past_kv = past_kv
    return worker


def _verify_outputs(generator: torch.Generator, bs: int, context: int):
    batch = SimpleNamespace(
        reqs=[FakeReq(f"r{i}") for i in range(bs)],
        seq_lens=torch.full((bs,), context),
        seq_lens_cpu=torch.full((bs,), context),
    )
    verify_input = SimpleNamespace(draft_token=torch.randint(0, core.VOCAB, (bs * N,), generator=generator))
    accept_lens = torch.randint(1, N + 1, (bs,), generator=generator, dtype=torch.int32)
    accept_index = torch.full((bs, N), -1)
    for r, n in enumerate(accept_lens.tolist()):
        accept_index[r, :n] = torch.arange(r * N, r * N + n)
    result = SimpleNamespace(
        accept_lens=accept_lens,
        accept_index=accept_index,
        logits_output=SimpleNamespace(
            hidden_states=torch.randn(bs * N, core.FEATURES, generator=generator),
            next_token_logits=torch.randn(bs * N, core.VOCAB, generator=generator),
        ),
    )
    return batch, verify_input, result


def _round(worker: TTSEagleWorker, batch, verify_input, result) -> None:
    """What TTSEagleWorker.verify does around SGLang's verify."""
    capture, seq_lens = worker._capture_plan(batch)
    worker.tts.before_draft([req.rid for req in batch.reqs])
    worker._after_verify(batch, verify_input, result, seq_lens, capture)
    worker.tts.verified(batch.reqs)


@pytest.mark.parametrize("context", [64, 4096])
def test_a_round_without_update_reads_nothing_on_the_host_and_allocates_nothing_per_context(monkeypatch, context):
    generator = torch.Generator().manual_seed(0)
    reads: list[int] = []
    worker = _worker(stride=1_000, context_reads=reads)
    bs = 3
    batch, verify_input, result = _verify_outputs(generator, bs, context)

    forbid_host_reads(monkeypatch)
    allocated = allocated_bytes(lambda: _round(worker, batch, verify_input, result))
    monkeypatch.undo()

    assert reads == []  # the drafter's context K/V was not touched
    # The anchors ([bs, F]) and a few index vectors; nothing of the context's or the vocabulary's size.
    assert bs * core.FEATURES * 4 <= allocated <= bs * core.FEATURES * 4 + 4096
    assert set(worker.tts.anchor_features) == {"r0", "r1", "r2"}
    hidden = result.logits_output.hidden_states
    for r, n in enumerate(result.accept_lens.tolist()):
        torch.testing.assert_close(worker.tts.anchor_features[f"r{r}"], hidden[r * N + n - 1])


def test_update_rounds_gather_the_canvas_once_into_buffers_that_stop_moving():
    generator = torch.Generator().manual_seed(0)
    reads: list[int] = []
    worker = _worker(stride=1, context_reads=reads)
    distiller = worker.tts.distiller
    submitted = []
    observe = distiller.observe

    def spy(canvas, owned=False):
        submitted.append((canvas, owned))
        return observe(canvas, owned)

    distiller.observe = spy
    pointers = []
    for round_index, bs in enumerate([2, 4, 3, 4, 1, 4]):
        batch, verify_input, result = _verify_outputs(generator, bs, context=50 + round_index)
        if round_index:  # every request has an anchor from the last round (the prefill's, in SGLang)
            for req in batch.reqs:
                worker.tts.remember_anchor(req.rid, torch.randn(core.FEATURES, generator=generator))
        _round(worker, batch, verify_input, result)
        pointers.append(distiller._canvas_buffers.storage_pointers())
        canvas, owned = submitted[-1]
        if round_index == 0:
            assert canvas is None  # no anchors yet: nothing to train on
            continue
        assert owned and canvas.target_logits.data_ptr() == pointers[-1]["target_logits"]
        accept = result.accept_lens.tolist()
        logits = result.logits_output.next_token_logits
        for r in range(bs):
            torch.testing.assert_close(canvas.target_logits[r, : accept[r]], logits[r * N : r * N + accept[r]])
            assert canvas.valid[r].tolist() == [k < accept[r] for k in range(canvas.length)]
            assert canvas.positions[r, 0].item() == 50 + round_index
    assert distiller.stats.num_updates >= 4
    assert reads == [50 + i for i in range(6)]  # stride 1: every round is an update round
    assert pointers[2] == pointers[3] == pointers[4] == pointers[5]  # allocated for 4 x 4 cells, then reused


def test_reports_wait_for_the_host_copy_and_never_misattribute():
    generator = torch.Generator().manual_seed(0)
    worker = _worker(stride=1_000, context_reads=[])
    runtime = worker.tts
    batch, verify_input, result = _verify_outputs(generator, 2, context=10)
    _round(worker, batch, verify_input, result)
    # Overlap scheduling: the next round is launched (without r1) before this one is reported.
    runtime.before_draft(["r0"])
    assert "r1" in runtime.requests or "r1" in runtime.anchor_features  # kept for its due report
    worker.on_verify_complete_cpu([2, 0], batch_size=2)
    assert [runtime.counters(rid).rounds for rid in ("r0", "r1")] == [1, 1]
    assert batch.reqs[1].customized_info  # meta_info written for the round
    worker.on_verify_complete_cpu([], batch_size=0)  # an idle batch: nothing queued for it
    _round(worker, *_verify_outputs(generator, 2, context=11)[:3])
    worker.on_verify_complete_cpu([1, 1, 1], batch_size=3)  # out of step: dropped, counted, nobody credited
    assert [runtime.counters(rid).rounds for rid in ("r0", "r1")] == [1, 1]
    assert runtime.counters("r0").failures == 1
    runtime.before_draft([])
    assert runtime.num_tracked() == 0


def test_a_failing_report_never_reaches_sglangs_result_processing():
    generator = torch.Generator().manual_seed(0)
    worker = _worker(stride=1_000, context_reads=[])
    batch, verify_input, result = _verify_outputs(generator, 2, context=10)
    _round(worker, batch, verify_input, result)

    def broken(accept_lengths):
        raise RuntimeError("injected: Prometheus is broken")

    worker.tts.metrics.observe_round = broken
    worker.on_verify_complete_cpu([1, 2], batch_size=2)  # must not raise into SGLang's scheduler
    assert {site: n for site, n in worker.tts.failures.counts.items() if n} == {"report": 1}
    assert [worker.tts.counters(rid).failures for rid in ("r0", "r1")] == [1, 1]


def _prefill(worker, reqs, prompts: list[list[int]], prefix_lens: list[int], tails: list[int], hidden):
    """SGLang's state after a prefill's draft extend: rotated ids, full-capture hidden states."""
    rotated = []
    for ids, tail in zip(prompts, tails):
        rotated += ids[1:] + [tail]
    batch = SimpleNamespace(
        reqs=reqs,
        extend_lens=[len(p) for p in prompts],
        prefix_lens=prefix_lens,
        input_ids=torch.tensor(rotated),
        forward_mode=SimpleNamespace(is_idle=lambda: False),
    )
    worker._remember_prompt_windows(batch, SimpleNamespace(logits_output=SimpleNamespace(hidden_states=hidden)))


def test_prompt_windows_come_from_the_draft_extend_inputs_and_chunks_join():
    worker = _worker(2, [])
    worker.tts.config = TTSConfig(prompt_adapt="on", prompt_positions=6, log_interval=0)
    a, b = FakeReq("a"), FakeReq("b")
    hidden = torch.arange(10 * 3, dtype=torch.float32).view(10, 3)  # row r: [3r, 3r+1, 3r+2]
    # a: its first chunk, positions 0..3 (next prompt token 14 comes in the next chunk); b: a whole
    # prompt of 6 tokens after a 2-token prefix-cache hit, then its sampled token 99
    _prefill(worker, [a, b], [[10, 11, 12, 13], [20, 21, 22, 23, 24, 25]], [0, 2], [14, 99], hidden)
    window_a, _ = worker.tts.prompt_windows["a"]
    # a's first row has no token before it on the device: the window starts one row later
    assert window_a.start == 1 and window_a.token_ids.tolist() == [11, 12, 13, 14]
    assert torch.equal(window_a.features, hidden[1:4])
    window_b, _ = worker.tts.prompt_windows["b"]
    assert window_b.start == 3 and window_b.token_ids.tolist() == [21, 22, 23, 24, 25, 99]
    assert torch.equal(window_b.features, hidden[5:10])
    # a's next chunk joins (its first token is the held window's last), cut to the last 6 positions
    more = torch.arange(100, 112, dtype=torch.float32).view(4, 3)
    _prefill(worker, [a], [[14, 15, 16, 17]], [4], [42], more)
    window_a, _ = worker.tts.prompt_windows["a"]
    assert window_a.start == 2 and window_a.token_ids.tolist() == [12, 13, 14, 15, 16, 17, 42]
    assert torch.equal(window_a.features, torch.cat((hidden[2:4], more)))
    assert not window_a.token_ids.is_inference() and window_a.token_ids.dtype == torch.long
