"""TTSDFlashWorker: SGLang's DFlash worker (DFlashWorkerV2) plus test-time drafter adaptation.

Block drafting, verification and the draft-KV materialisation are SGLang's own, untouched, so
outputs are exactly what stock DFLASH produces for the same drafter weights. TTS adds:
- before each decode round's draft block: the scope check (reset) and the CPU-side barrier that
  publishes a finished update into SGLang's draft model in place;
- after verify: the canvas. DFlashWorkerV2 runs draft, verify and accept in one call, so the
  round is read back from what it leaves behind: the block it drafted (`_draft_block_tokens_buf`),
  the target's logits (`GenerationBatchResult.logits_output`), the committed lengths, and the
  target features it hands to `_append_target_hidden_to_draft_kv_by_loc` (intercepted here).

The canvas of a round anchored at position p (SGLang's `prefix_lens`): ids `[bonus, d_1..]` at
positions p.., the target's logits of those rows, and as context the drafter's K/V of positions
before the previous round's anchor (read from SGLang's draft KV pool, detached) plus the target
features of the tokens the previous round committed (recomputed with gradient, so `fc`,
`hidden_norm` and the K/V projections train too).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

from sglang_tts.drafters.loading import load_drafter
from sglang_tts.sglang import metrics
from sglang_tts.sglang.binding import draft_kv_reader, make_runtime, target_embedding
from sglang_tts.sglang.capture import build_canvas, prompt_row_ranges
from sglang_tts.sglang.flags import tts_config_from_env

logger = logging.getLogger(__name__)


def block_rows(block_size: int, commit_lens: list[int], canvas: str) -> list[list[int]]:
    """Rows of the flattened [bs * block_size] verify tensors the loss uses, per request:
    `accepted`: the anchor, the accepted drafts and the first rejected position (commit_len rows);
    `full`: the whole block."""
    rows = []
    for r, n in enumerate(commit_lens):
        count = block_size if canvas == "full" else int(n)
        rows.append(list(range(r * block_size, r * block_size + count)))
    return rows


def refresh_fused_kv_weights(helper, layers) -> None:
    """SGLang's fused context-KV helper (CUDA) keeps stacked copies of every layer's K/V
    projection and k_norm; rewrite them in place after a publish so the next append uses the
    published weights."""
    kv, k_norm = [], []
    for layer in layers:
        attn = layer.self_attn
        kv.append(attn.qkv_proj.weight[attn.q_size : attn.q_size + 2 * attn.kv_size])
        k_norm.append(attn.k_norm.weight)
    flat = torch.stack(kv).reshape(-1, kv[0].shape[-1])
    helper.flat_kv_weight_t.copy_(flat.transpose(0, 1))
    helper.k_norm_weights.copy_(torch.stack(k_norm))


class TTSDFlashWorker(DFlashWorkerV2):
    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        unsupported = {
            "a sliding-window draft cache": self.use_compact_draft_cache,
            "a candidate selector (DFlash 2)": self.selector is not None,
            "a LiLiCorr head": self.lilicorr is not None,
            "a Domino projector": self._is_domino,
        }
        for what, present in unsupported.items():
            if present:
                raise RuntimeError(f"TTS with DFlash does not support {what}")
        # A DFlash canvas carries its own round's context features: one round per update.
        config = tts_config_from_env().with_default_window(stackable=False)
        target_model = self.target_worker.model_runner.model
        target_config_path = Path(server_args.model_path) / "config.json"
        target_config = json.loads(target_config_path.read_text()) if target_config_path.exists() else None
        with torch.inference_mode(False):
            embedding = target_embedding(self.target_worker).detach().clone().float()
            lm_head = target_model.lm_head.weight.detach()[: embedding.shape[0]].clone().float()
            drafter = load_drafter(
                server_args.speculative_draft_model_path,
                target_embedding=embedding,
                target_lm_head=lm_head,
                target_config=target_config,
            )
            drafter.block_size = int(self.block_size)  # the server's block size wins, as for SGLang's drafting
            drafter.mask_token_id = int(self._mask_token_id)
            drafter.to(self.device)
            self.tts = make_runtime(
                drafter,
                config,
                self.draft_model,
                self.device,
                lambda: self.model_runner.req_to_token_pool.req_to_token.shape[0],
            )
        self.tts.metrics = metrics.scheduler_metrics()
        self._draft_layers = [layer.self_attn.attn for layer in self.draft_model.layers]
        self._feature_dim = drafter.fc.in_features
        self._capturing = False
        self._captured_hidden: torch.Tensor | None = None
        self._need_verify_logits = False
        self._published_version = self.tts.distiller.weight_version
        logger.info("sglang-tts: TTS on DFlash (block %d, %s)", self.block_size, self.tts.describe())

    # --- SGLang entry points --------------------------------------------------------------------

    def _forward_capturing(self, capture: bool, batch, **kwargs):
        """SGLang's forward, keeping the target features it hands to the draft-KV writer when `capture`."""
        self._capturing, self._captured_hidden = capture, None
        try:
            return super().forward_batch_generation(batch, **kwargs)
        finally:
            self._capturing = False

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        is_decode = not (batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle())
        kwargs = dict(on_publish=on_publish, grammar_barrier=grammar_barrier, pp_proxy_tensors=pp_proxy_tensors)
        if not is_decode:
            if batch.forward_mode.is_idle():
                return super().forward_batch_generation(batch, **kwargs)
            self.tts.bind_extend_batch(batch.reqs)  # absorbs its own failures
            prompt = self.tts.config.prompt_updates
            result = self._forward_capturing(prompt, batch, **kwargs)
            if prompt:
                with self.tts.failures.absorb("prompt_capture", [req.rid for req in batch.reqs]):
                    self._remember_prompt_windows(batch, result)  # a missing window: no prompt update
            self._captured_hidden = None
            return result
        rids = [req.rid for req in batch.reqs]
        with self.tts.failures.absorb("barrier", rids):  # on failure: draft with the weights in place
            self.tts.before_draft(rids)
            self.tts.bind_batch(batch.reqs)
            self._after_publish()
        self.tts.start_prompt_updates(batch.reqs)  # absorbs its own failures
        # Update (and check) rounds read lengths on the host; other rounds keep everything on the
        # device and leave the report to SGLang's host copy (on_verify_complete_cpu).
        capture = self.tts.distiller.next_round_submits() or self.tts.check_fallback
        # Those rounds need the target's full verify logits, which SGLang may skip for all-greedy
        # batches under tensor parallelism (it then gathers only the argmax).
        self._need_verify_logits = capture
        prefix_lens = batch.seq_lens.clone()  # [bs] positions of the blocks (verify moves seq_lens)
        result = self._forward_capturing(True, batch, **kwargs)
        with self.tts.failures.absorb("capture", rids):  # on failure: the round is not trained on
            self._after_verify(batch, rids, prefix_lens, result, capture)
        self._captured_hidden = None
        self.tts.verified(batch.reqs)
        return result

    def on_verify_complete_cpu(self, num_correct_drafts_per_req: list[int], batch_size: int = 0) -> None:
        """SGLang's result processing has the round's committed lengths on the host: report them
        (per-request counters, meta_info, Prometheus) without a sync in the worker."""
        super().on_verify_complete_cpu(num_correct_drafts_per_req, batch_size=batch_size)
        self.tts.reported(num_correct_drafts_per_req)  # absorbs its own failures

    def _can_skip_verify_logits(self, batch, sampling_info) -> bool:
        return not self._need_verify_logits and super()._can_skip_verify_logits(batch, sampling_info)

    def _append_target_hidden_to_draft_kv_by_loc(self, *, target_hidden, **kwargs) -> None:
        if self._capturing:
            self._captured_hidden = target_hidden
        return super()._append_target_hidden_to_draft_kv_by_loc(target_hidden=target_hidden, **kwargs)

    # --- capture ----------------------------------------------------------------------------

    def _after_publish(self) -> None:
        version = self.tts.distiller.weight_version
        if version != self._published_version:
            helper = getattr(self, "_fused_kv_helper", None)
            if helper is not None and getattr(self, "_use_fused_kv_materialize", False):
                refresh_fused_kv_weights(helper, self.draft_model.layers)
            self._published_version = version

    def _remember_prompt_windows(self, batch, result) -> None:
        """Prompt-time adaptation: keep the target features of each request's last prompt positions
        (the ones SGLang handed to the draft-KV writer) with their tokens, then the token after them
        (core/prompt.py). The extend's ids are the prompt tokens (DFlash does not rotate them). Device
        copies only."""
        hidden = self._captured_hidden
        extend_lens, prefix_lens = list(batch.extend_lens), list(batch.prefix_lens)
        if hidden is None or hidden.shape[0] != sum(extend_lens) or batch.input_ids.shape[0] != hidden.shape[0]:
            return
        tails = result.next_token_ids
        input_ids = batch.input_ids.to(tails.device, non_blocking=True)
        ranges = prompt_row_ranges(extend_lens, prefix_lens, self.tts.config.prompt_positions)
        for i, (req, (lo, hi, start)) in enumerate(zip(batch.reqs, ranges)):
            ids = torch.cat((input_ids[lo:hi], tails[i : i + 1].to(input_ids.dtype))).long()
            self.tts.remember_prompt(req, ids, hidden[lo:hi].clone(), start)

    def _past_kv(self, batch, ends: list[int]):
        return draft_kv_reader(
            self.model_runner.req_to_token_pool.req_to_token,
            self.draft_model_runner.token_to_kv_pool,
            self._draft_layers,
            batch.req_pool_indices.tolist(),
            ends,
        )

    def _after_verify(self, batch, rids, prefix_lens: torch.Tensor, result, capture: bool) -> None:
        """prefix_lens: [bs] device positions of this round's blocks."""
        block = int(self.block_size)
        hidden = self._captured_hidden
        if capture:
            self._submit(batch, rids, prefix_lens.tolist(), result, hidden)  # host reads: canvas rounds only
        else:
            self.tts.observe(None)
        # The next round's context: the features of the tokens this round committed. One copy of
        # the block (SGLang reuses its buffers); how many rows count stays on the device.
        if hidden is not None:
            blocks = hidden.view(len(rids), block, -1).clone()
            commit_lens = result.accept_lens.to(prefix_lens.dtype, copy=True)
            for r, rid in enumerate(rids):
                self.tts.remember_context(rid, blocks[r], prefix_lens[r], commit_lens[r])

    def _submit(self, batch, rids, prefix_lens: list[int], result, hidden) -> None:
        """An update (or check) round: the canvas of this round's blocks."""
        block = int(self.block_size)
        logits = result.logits_output.next_token_logits if result.logits_output is not None else None
        if logits is None or hidden is None:
            self.tts.observe(None)
            return
        commit_lens = result.accept_lens.tolist()
        contexts = self.tts.recent_contexts(rids, prefix_lens)
        draft_tokens = self._draft_block_tokens_buf[: len(rids)].reshape(-1)
        common = dict(
            request_ids=rids,
            draft_tokens=draft_tokens,
            target_logits=logits,
            seq_lens=prefix_lens,
            context_features=contexts,
            feature_dim=self._feature_dim,
            past_kv=self._past_kv(batch, [prefix_lens[r] if c is None else c[1] for r, c in enumerate(contexts)]),
            num_accepted=[n - 1 for n in commit_lens],
            round_index=self.tts.distiller.stats.rounds,
            device=self.tts.distiller.device,
        )
        canvas = None
        if self.tts.distiller.next_round_submits():
            canvas = build_canvas(rows=block_rows(block, commit_lens, self.tts.config.canvas), **common)
        check_canvas = None
        if self.tts.check_fallback:
            check_canvas = build_canvas(rows=block_rows(block, commit_lens, "full"), **common)
        self.tts.observe(canvas, check_canvas, owned=True)
