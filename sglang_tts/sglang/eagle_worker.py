"""TTSEagleWorker: SGLang's EAGLE-3 worker (EAGLEWorkerV2) plus test-time drafter adaptation.

Drafting, verification and draft-extend are SGLang's own, untouched: outputs are exactly what
stock EAGLE3 produces for the same drafter weights (lossless by construction). TTS adds:
- before each decode round's draft: the scope check (reset) and the CPU-side barrier that
  publishes a finished update into SGLang's draft model in place (`param.copy_`, so captured
  CUDA graphs stay valid);
- after each verify: capture of the canvas (drafted path, the target's logits there, the anchor
  feature, the drafter's cached K/V of the context) and the hand-off to the update schedule;
- per-request counters written into `req.customized_info`, which SGLang forwards to meta_info;
- with `--tts-controller`: the controller behind SGLang's adaptive step switching (adaptive_steps.py).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch
from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

from sglang_tts.drafters.loading import load_drafter
from sglang_tts.sglang import metrics
from sglang_tts.sglang.binding import draft_kv_reader, make_runtime, target_embedding
from sglang_tts.sglang.capture import build_canvas, build_kept_canvas, path_rows, prompt_row_ranges
from sglang_tts.sglang.flags import tts_config_from_env

logger = logging.getLogger(__name__)


class TTSEagleWorker(EAGLEWorkerV2):
    tts_hybrid = None  # --tts-hybrid: the HybridDrafting (sglang/hybrid.py), set in __init__

    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        config = tts_config_from_env().with_default_window(stackable=True)  # EAGLE-3 canvases stack
        draft_model = self.draft_worker.draft_runner.model
        target_config_path = Path(server_args.model_path) / "config.json"
        target_config = json.loads(target_config_path.read_text()) if target_config_path.exists() else None
        with torch.inference_mode(False):
            embedding = target_embedding(self.target_worker).detach().clone().float()
            drafter = load_drafter(
                server_args.speculative_draft_model_path, target_embedding=embedding, target_config=target_config
            )
            drafter.to(self.device)
            self.tts = make_runtime(
                drafter,
                config,
                draft_model,
                self.device,
                lambda: self.draft_worker.draft_runner.req_to_token_pool.req_to_token.shape[0],
            )
        self.tts.metrics = metrics.scheduler_metrics()
        self._draft_layers = [
            m.attn for m in draft_model.modules() if hasattr(m, "attn") and hasattr(m.attn, "layer_id")
        ]
        self.tts_controller = self._install_controller(config) if config.controller is not None else None
        self.tts_hybrid = self._install_hybrid(config) if config.hybrid else None
        if self.tts_controller is not None and self.tts_hybrid is not None:
            self.tts_controller.set_proposer = self.tts_hybrid.set_mode  # a policy with the proposer axis
            self.tts_controller.apply_proposer()
        logger.info("sglang-tts: TTS on EAGLE-3 (%s)", self.tts.describe())

    # --- SGLang entry points --------------------------------------------------------------------

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        is_decode = not (batch.forward_mode.is_extend() or batch.is_extend_in_batch)
        live = is_decode and not batch.forward_mode.is_idle()
        control = self.tts_controller
        rids = [req.rid for req in batch.reqs]
        failures = self.tts.failures
        if control is not None:
            with failures.absorb("controller", rids):
                control.forward_started()
            start = time.perf_counter()
            self._tts_round_seconds = 0.0
        if live:
            # SGLang picks the chain length of a batch size (its adaptive tiers) inside the forward below;
            # pick it now, so that the round TTS plans (the hybrid's suffix chains) has the length drafted
            self.activate_step_by_batch(batch.seq_lens.shape[0])
            tic = time.perf_counter()
            with failures.absorb("barrier", rids):  # on failure: draft with the weights in place
                self.tts.before_draft(rids)
                self.tts.bind_batch(batch.reqs)
            if self.tts.check_fallback:
                with failures.absorb("capture", rids):
                    self._check_prefill_locs(batch)
            self.tts.start_prompt_updates(batch.reqs)  # absorbs its own failures
            if self.tts_hybrid is not None:
                with failures.absorb("hybrid", rids):  # on failure: the drafter drafts this round
                    # the draft graph runner exists by now
                    self.tts_hybrid.install(self.draft_worker, self._stub_skipped_draft_extend)
                    self.tts_hybrid.plan_round(batch.reqs, self.speculative_num_steps)
            if control is not None:
                self._tts_round_seconds += time.perf_counter() - tic
        elif not batch.forward_mode.is_idle():
            self.tts.bind_extend_batch(batch.reqs)  # absorbs its own failures
        try:
            result = super().forward_batch_generation(
                batch, on_publish=on_publish, grammar_barrier=grammar_barrier, pp_proxy_tensors=pp_proxy_tensors
            )
        finally:
            if self.tts_hybrid is not None:
                self.tts_hybrid.round_done()
        if control is not None and live:
            with failures.absorb("controller", rids):
                self._controller_round_done(control, batch, start)
        return result

    def _controller_round_done(self, control, batch, start: float) -> None:
        loss = self.tts.distiller.stats.last_loss
        offer = self.tts_hybrid.last_offer if self.tts_hybrid is not None else None
        control.round_done(
            num_steps=self.speculative_num_steps,
            forward_seconds=time.perf_counter() - start,
            tts_seconds=self._tts_round_seconds,
            output_position=sum(len(req.output_ids) for req in batch.reqs) / max(len(batch.reqs), 1),
            tts_loss=loss if math.isfinite(loss) else None,
            suffix_offered=offer.offered if offer is not None else None,
            suffix_expected=offer.expected if offer is not None else None,
        )

    def _install_controller(self, config):
        """Put the policy file's Controller behind SGLang's adaptive step switching (adaptive_steps.py)."""
        from sglang_tts.control.policy_file import load_policy
        from sglang_tts.sglang.adaptive_steps import ControlledSteps

        if self.adaptive_controller is None:
            raise RuntimeError(
                "--tts-controller needs SGLang's adaptive speculative decoding, which it turned off "
                "(its 'speculative_adaptive disabled' warning above says why)"
            )
        bundle = load_policy(config.controller)  # validated at launch
        controller = bundle.make_controller(learn=config.controller_learn)
        adapter = ControlledSteps(controller, self.tts.distiller.set_update_stride, config.controller_trace)
        adapter.failures = self.tts.failures
        self.adaptive_controller.params = adapter
        self._tts_round_seconds = 0.0
        logger.info(
            "sglang-tts: controller on (%s, persistence %d, %s), starting with %s",
            getattr(bundle.policy, "kind", "?"),
            controller.config.persistence,
            "learning" if controller.config.learn else "fixed policy",
            controller.current,
        )
        return adapter

    def _install_hybrid(self, config):
        """--tts-hybrid: the suffix proposer's chains in the drafter's slots (sglang/hybrid.py)."""
        from sglang.srt.runtime_context import get_schedule, get_spec

        from sglang_tts.core.hybrid import HybridRule
        from sglang_tts.sglang.hybrid import HybridDrafting

        problems = []
        if self.topk != 1:
            problems.append(f"--speculative-eagle-topk 1 (a chain), got {self.topk}")
        if not get_schedule().disable_overlap_schedule:
            problems.append("--disable-overlap-schedule (the suffix lookup reads the committed tokens on the host)")
        if get_spec().speculative_use_rejection_sampling:
            problems.append("no --speculative-use-rejection-sampling (a suffix chain has no draft distribution)")
        if problems:
            raise RuntimeError("--tts-hybrid on needs " + "; ".join(problems))
        # The longest chain a round may draft: the adaptive chain lengths' longest (a controller's, or
        # SGLang's --speculative-adaptive tiers), else the launch's.
        adaptive = self.adaptive_controller
        steps = max(adaptive.candidate_steps) if adaptive is not None else self.speculative_num_steps
        rule = HybridRule(
            steps,
            min_match=config.hybrid_min_match,
            margin=config.hybrid_margin,
            cost=config.hybrid_cost,
            score=config.hybrid_score,
            retire_below=config.hybrid_retire_below,
            retire_after=config.hybrid_retire_after,
        )
        hybrid = HybridDrafting(steps, rule, self.device)
        hybrid.install(self.draft_worker, self._stub_skipped_draft_extend)
        self.tts.hybrid = hybrid
        logger.info(
            "sglang-tts: hybrid drafting on (suffix chains of %d tokens from SGLang's NGRAM corpus; min match %d, "
            "margin %g, suffix side: %s, round costs %s, training on %s rounds, %s)",
            steps,
            rule.min_match,
            rule.margin,
            "the chain's score" if rule.score == "chain" else "the moving average",
            "weighed" if rule.cost else "ignored",
            config.hybrid_train,
            f"drafter retired below {rule.retire_below:g} accepted tokens per round after {rule.retire_after} rounds"
            if rule.retire_below > 0
            else "drafter never retired",
        )
        return hybrid

    def clear_cache_pool(self):
        """/flush_cache (SGLang calls it when idle): the hybrid's suffix trie and per-request choices go too."""
        super().clear_cache_pool()
        if self.tts_hybrid is not None:
            with self.tts.failures.absorb("hybrid"):
                self.tts_hybrid.reset()

    def verify(self, batch, pp_proxy_tensors=None, grammar_barrier=None):
        verify_input = batch.spec_info
        idle = batch.forward_mode.is_idle()
        if not idle and self.tts_hybrid is not None:
            with self.tts.failures.absorb("hybrid", [req.rid for req in batch.reqs]):  # on failure: counted
                self._note_drafted(batch)
        capture, seq_lens = self._capture_plan(batch) if not idle else (False, None)
        keeps = not idle and self.tts.distiller.next_round_keeps()
        kept_seq_lens = batch.seq_lens.clone() if keeps else None  # device copy: verify moves them
        result = super().verify(batch, pp_proxy_tensors=pp_proxy_tensors, grammar_barrier=grammar_barrier)
        if not idle:
            tic = time.perf_counter()
            rids = [req.rid for req in batch.reqs]
            with self.tts.failures.absorb("capture", rids):  # on failure: the round is not trained on
                self._after_verify(batch, verify_input, result, seq_lens, capture, kept_seq_lens)
            self.tts.verified(batch.reqs)
            if self.tts_controller is not None:
                self._tts_round_seconds += time.perf_counter() - tic
        return result

    def _note_drafted(self, batch) -> None:
        """--tts-hybrid: tell TTS how many of this round's requests the learned drafter drafted (the
        round's plan, host values; no plan, e.g. it failed: the drafter drafted them all)."""
        rids = [req.rid for req in batch.reqs]
        drafted = sum(self.tts_hybrid.proposer_of(r) != "suffix" for r in range(len(rids)))
        self.tts.note_drafted(rids, drafted)

    def _capture_plan(self, batch) -> tuple[bool, list[int] | None]:
        """Does this round build a canvas, and from which positions (read before verify moves
        them)? Only update rounds (and check rounds) read anything on the host: the rest of a
        round's TTS work stays on the device, and its report waits for SGLang's own host copy."""
        capture = self.tts.update_due() or self.tts.check_fallback
        if not capture:
            return False, None
        host = getattr(batch, "seq_lens_cpu", None)  # SGLang's CPU copy, when the batch has one
        return True, (host if host is not None else batch.seq_lens).tolist()

    def on_verify_complete_cpu(self, num_correct_drafts_per_req: list[int], batch_size: int = 0) -> None:
        """SGLang's result processing has the round's accepted lengths on the host: report them
        (per-request counters, meta_info, Prometheus) without a sync in the worker."""
        super().on_verify_complete_cpu(num_correct_drafts_per_req, batch_size=batch_size)
        self.tts.reported(num_correct_drafts_per_req)  # absorbs its own failures

    def _forward_prefill_batch(self, batch, *args, **kwargs):
        result = super()._forward_prefill_batch(batch, *args, **kwargs)
        if self.tts_hybrid is not None:
            with self.tts.failures.absorb("hybrid", [req.rid for req in batch.reqs]):
                self.tts_hybrid.on_prefill(batch.reqs)
        with self.tts.failures.absorb("prefill_anchor", [req.rid for req in batch.reqs]):
            self.tts.begin_prefill(batch.reqs)  # forgets earlier prefills that finished without decoding
            self._remember_prefill_anchors(batch, result)  # a missing anchor costs one round's canvas
            if self.tts.check_fallback:
                self._remember_prefill_locs(batch)
        if self.tts.config.prompt_updates:
            with self.tts.failures.absorb("prompt_capture", [req.rid for req in batch.reqs]):
                self._remember_prompt_windows(batch, result)  # a missing window: no prompt update
        return result

    # --- capture ----------------------------------------------------------------------------

    def _remember_prefill_anchors(self, batch, result) -> None:
        """The first decode round's anchor is the target feature of the last prompt token."""
        hidden = result.logits_output.hidden_states
        if hidden is None or batch.forward_mode.is_idle():
            return
        extend_lens = list(batch.extend_lens)
        if hidden.shape[0] == len(batch.reqs):
            last_rows = torch.arange(len(batch.reqs))
        elif hidden.shape[0] == sum(extend_lens):
            last_rows = torch.tensor(extend_lens).cumsum(0) - 1
        else:
            return
        # A copy of the last rows only: a view would keep the whole prompt's hidden states alive.
        anchors = hidden.index_select(0, last_rows.to(hidden.device))
        # A chunked prefill's intermediate chunk is overwritten by the chunk that ends the prompt.
        for r, req in enumerate(batch.reqs):
            self.tts.remember_anchor(req.rid, anchors[r])

    def _remember_prefill_locs(self, batch) -> None:
        """Check mode: where each prompt's context K/V lay when its prefill drafted (a host copy of
        its req_to_token row; a debug mode, so the host read is allowed)."""
        table = self.req_to_token_pool.req_to_token
        for req, pool_index in zip(batch.reqs, batch.req_pool_indices.tolist()):
            locs = table[pool_index, : len(req.origin_input_ids)].to("cpu", copy=True)
            self.tts.remember_prefill_locs(req.rid, locs)

    def _check_prefill_locs(self, batch) -> None:
        """Check mode, before a decode round: a request in its first round whose context locations
        changed since its prefill drafted (the radix cache rebound them) is not re-predicted this round."""
        table, pool = self.req_to_token_pool.req_to_token, None
        for r, req in enumerate(batch.reqs):
            held = self.tts.prefill_locs(req.rid)
            if held is None:
                continue
            pool = batch.req_pool_indices.tolist() if pool is None else pool
            if not torch.equal(table[pool[r], : held.shape[0]].cpu(), held):
                self.tts.context_rebound(req.rid)

    def _remember_prompt_windows(self, batch, result) -> None:
        """Prompt-time adaptation: keep the drafter's inputs at the last prompt positions of each
        request (core/prompt.py). After SGLang's draft extend, `batch.input_ids` holds the rotated
        ids (row j: the token after row j's; the last row of the final chunk: the sampled token), so
        a window is the token at its first row, then the rotated ids of its rows. That first token is
        the row before's rotated id, or, at the first row of a chunk, the last token of the request's
        window from its previous chunk; with neither (a prompt's first chunk) the window starts one
        row later. Device copies only: no host read, no host-to-device copy."""
        hidden = result.logits_output.hidden_states
        if hidden is None or batch.forward_mode.is_idle():
            return
        extend_lens, prefix_lens = list(batch.extend_lens), list(batch.prefix_lens)
        rotated = batch.input_ids
        if hidden.shape[0] != sum(extend_lens) or rotated.shape[0] != hidden.shape[0]:
            return  # not a full-capture prefill of these requests (e.g. a mixed batch)
        ranges = prompt_row_ranges(extend_lens, prefix_lens, self.tts.config.prompt_positions)
        pt = 0
        for req, n, (lo, hi, start) in zip(batch.reqs, extend_lens, ranges):
            first = rotated[lo - 1 : lo] if lo > pt else self.tts.prompt_tail(req, start)
            if first is None:
                lo, start, first = lo + 1, start + 1, rotated[lo : lo + 1]
            if hi > lo:
                ids = torch.cat((first.to(rotated.dtype), rotated[lo:hi])).to(torch.long, copy=True)
                self.tts.remember_prompt(req, ids, hidden[lo:hi].clone(), start)
            pt += int(n)

    def _past_kv(self, batch, seq_lens):
        # Drafter K/V of every position before the anchor (index seq_len - 1 is recomputed).
        return draft_kv_reader(
            self.req_to_token_pool.req_to_token,
            self.draft_worker.draft_runner.token_to_kv_pool,
            self._draft_layers,
            batch.req_pool_indices.tolist(),
            [max(n - 1, 0) for n in seq_lens],
        )

    def _kept_canvas(self, verify_input, result, seq_lens: torch.Tensor, rids: list[str], skip: list[bool]):
        """--tts-update-window: this round's canvas, kept until the stride's update (capture.py);
        `skip`: per request, left out (a suffix row with --tts-hybrid-train drafter, a retired drafter)."""
        return build_kept_canvas(
            request_ids=rids,
            accept_index=result.accept_index,
            accept_lens=result.accept_lens,
            draft_tokens=verify_input.draft_token,
            target_logits=result.logits_output.next_token_logits,
            seq_lens=seq_lens,
            anchor_features=[self.tts.anchor_features.get(rid) for rid in rids],
            skip=skip,
            full_chain=self.topk == 1 and self.tts.config.canvas == "full",
            round_index=self.tts.distiller.stats.rounds,
            device=self.tts.distiller.device,
            teacher=self.tts.teacher_vocab,
        )

    def _after_verify(
        self,
        batch,
        verify_input,
        result,
        seq_lens: list[int] | None,
        capture: bool,
        kept_seq_lens: torch.Tensor | None = None,
    ) -> None:
        """kept_seq_lens: [bs] device copy of the positions before verify, on rounds whose canvas
        the stride's update keeps (--tts-update-window); None otherwise."""
        n = self.speculative_num_draft_tokens
        rids = [req.rid for req in batch.reqs]
        hybrid = self.tts_hybrid
        # --tts-hybrid: requests whose drafter is retired are left out (their drafter K/V has gaps).
        retired = [hybrid is not None and hybrid.retired(r) for r in range(len(rids))]
        if all(retired):
            self.tts.observe(None)  # the round counts; nothing to learn, no anchor to keep
            return
        if capture or kept_seq_lens is not None:
            # --tts-hybrid: rows of the suffix proposer's chains (not the drafter's prediction)
            suffix = [hybrid is not None and hybrid.proposer_of(r) == "suffix" for r in range(len(rids))]
            # Left out of the canvases: retired requests, and suffix rows when only the drafter's train.
            drafter_only = self.tts.config.hybrid_train == "drafter"
            skip = [(s and drafter_only) or t for s, t in zip(suffix, retired)]
        if capture:
            accept_lens = result.accept_lens.tolist()  # update (and check) rounds only
            common = dict(
                request_ids=rids,
                draft_tokens=verify_input.draft_token,
                target_logits=result.logits_output.next_token_logits,
                seq_lens=seq_lens,
                anchor_features=[self.tts.anchor_features.get(rid) for rid in rids],
                past_kv=self._past_kv(batch, seq_lens),
                num_accepted=[a - 1 for a in accept_lens],
                round_index=self.tts.distiller.stats.rounds,
                device=self.tts.distiller.device,
            )
            canvas = check_canvas = None
            if self.tts.update_due():  # only update rounds need a canvas (and context K/V)
                rows = path_rows(self.topk, n, accept_lens, result.accept_index, self.tts.config.canvas)
                rows = [[] if s else r for r, s in zip(rows, skip)]
                canvas = build_canvas(
                    rows=rows, buffers=self.tts.capture_buffers(), teacher=self.tts.teacher_vocab, **common
                )
            elif kept_seq_lens is not None:
                canvas = self._kept_canvas(verify_input, result, kept_seq_lens, rids, skip)
            if self.tts.check_fallback and self.topk == 1:
                # The check re-predicts every drafted token, so it needs the whole chain (the drafter's only).
                rows = path_rows(1, n, accept_lens, result.accept_index, "full")
                rows = [[] if s else r for r, s in zip(rows, suffix)]
                check_canvas = build_canvas(rows=rows, **common)
            self.tts.observe(canvas, check_canvas, owned=True)
        elif kept_seq_lens is not None:  # a round the stride's update keeps: gathered without a host read
            self.tts.observe(self._kept_canvas(verify_input, result, kept_seq_lens, rids, skip), owned=True)
        else:
            self.tts.observe(None)

        # The next round's canvas starts from the feature of the last accepted node (the accepted
        # path is compacted to the front of each block after verify): gathered on the device.
        hidden = result.logits_output.hidden_states
        if hidden is not None:
            accept = result.accept_lens.to(hidden.device).long()
            last = torch.arange(len(rids), device=hidden.device) * n + accept - 1
            anchors = hidden.index_select(0, last)
            for r, rid in enumerate(rids):
                self.tts.remember_anchor(rid, anchors[r])
