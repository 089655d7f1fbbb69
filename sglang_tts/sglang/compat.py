"""The SGLang internals sglang-tts relies on, declared in one place and checked at launch.

The plugin subclasses SGLang's speculative workers, wraps SGLang functions through its HookRegistry,
calls its registries and reads attributes of its objects; none of that is public API, and the plugin
was built against one SGLang release (`SGLANG_VERSION`). `REQUIREMENTS` lists each of those internals:
the object (`module:qualname`), the parameters the plugin's calls and hooks depend on, and for classes
the attributes it reads. `check()` compares them with the installed SGLang and returns a `Report`
naming every difference (what was expected, what was found).

When the checks run (each is cheap: imports the plugin does anyway, `inspect.signature`, attribute
lookups; no model, no device):
- `plugin.register()`, in every SGLang process: the version and the `always` scope (the hook targets
  and registries every server uses), plus the `cpu` scope where the CPU layer is active. SGLang's
  `load_plugins()` logs and swallows an `Exception` from a plugin (and `HookRegistry.apply_hooks()`
  a hook target it cannot find), so a mismatch raises `SGLangMismatchError`, a `SystemExit`: the
  launch stops with the report as its one message instead of serving with a half-applied plugin.
- TTS's `validate_server_args` (the launching process, `--speculative-algorithm TTS` only, before any
  scheduler starts): the `tts` scope, the worker classes and the objects they read (importing them
  costs a few tenths of a second, so servers without TTS never pay it).
- `python -m sglang_tts.sglang.compat [--all] [--verbose]`: every scope that applies on this machine
  (`--all`: the CPU layer's too); exit 0 when everything matches, 1 with the report otherwise.

`SGLANG_TTS_SKIP_COMPAT_CHECK=1` turns a refusal into a logged warning (the report still names what
differs), for users who know the differences do not matter to them.

When the plugin starts relying on another SGLang internal, declare it here.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import os
import re
import sys
import types
from collections.abc import Iterable, Sequence
from dataclasses import KW_ONLY, dataclass

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
SKIP_ENV = "SGLANG_TTS_SKIP_COMPAT_CHECK"
# Scopes: `always` (every server with the plugin), `tts` (a TTS launch), `cpu` (the CPU layer is
# active), `cpu-timing` (the CPU layer with $SGLANG_TTS_CPU_ROUND_TIMING set).
SCOPES = ("always", "tts", "cpu", "cpu-timing")
REGISTER_SCOPES = ("always",)
LAUNCH_SCOPES = ("tts",)

_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)
_BY_KEYWORD = (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)
_VARIADIC = (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)


@dataclass(frozen=True)
class Requirement:
    """One SGLang internal the plugin relies on.

    target: `module:qualname` (a class, function, method or module-level value).
    use: what the plugin does with it (quoted in the report).
    params: the parameters the plugin's calls and hooks depend on, or None (existence only). Names
        before a "*" must be the leading positional parameters, in this order; names after it must
        be accepted by keyword, in any order. Other parameters are fine for a hook (it passes on what
        SGLang's caller gives it).
    calls: the plugin itself calls it with only the declared arguments (a `super()` call, a
        registry call), so any other parameter must have a default.
    attributes: for a class, names the plugin reads on it or its instances; each must be a class
        attribute, a dataclass field, or be named in the code of the class's methods (how instance
        attributes set in `__init__` and its helpers are found without building an instance).
    scope: when it is checked (see SCOPES).
    """

    target: str
    use: str
    params: tuple[str, ...] | None = None
    _: KW_ONLY
    calls: bool = False
    attributes: tuple[str, ...] = ()
    scope: str = "always"


@dataclass(frozen=True)
class Difference:
    target: str
    expected: str
    found: str
    use: str = ""

    def __str__(self) -> str:
        why = f"\n      (sglang-tts: {self.use})" if self.use else ""
        return f"{self.target}: expected {self.expected}, found {self.found}{why}"


@dataclass(frozen=True)
class Report:
    expected_version: str
    found_version: str
    location: str
    scopes: tuple[str, ...]
    checked: tuple[str, ...]
    differences: tuple[Difference, ...]

    @property
    def ok(self) -> bool:
        return not self.differences

    def format(self, verbose: bool = False) -> str:
        where = f"SGLang {self.found_version} ({self.location})"
        scopes = ", ".join(self.scopes)
        if self.ok:
            lines = [
                f"sglang-tts: {where} matches the {len(self.checked)} SGLang internals the plugin relies on "
                f"(built against SGLang {self.expected_version}; checked: {scopes})."
            ]
            if verbose:
                lines += [f"  ok  {target}" for target in self.checked]
            return "\n".join(lines)
        lines = [
            f"sglang-tts was built against SGLang {self.expected_version} and relies on its internals; "
            f"{where} differs in {len(self.differences)} of them (checked: {scopes}):"
        ]
        lines += [f"  - {d}" for d in self.differences]
        lines.append(
            f'Install SGLang {self.expected_version} (pip install "sglang=={self.expected_version}"), '
            f"or uninstall sglang-tts; {SKIP_ENV}=1 starts anyway, at your own risk. "
            "`python -m sglang_tts.sglang.compat` prints this report."
        )
        return "\n".join(lines)


class SGLangMismatchError(SystemExit):
    """The installed SGLang is not the one the plugin was built for.

    A `SystemExit` on purpose: SGLang's `load_plugins()` catches `Exception` from a plugin, logs it
    and serves on without it; this stops the launch, and an uncaught one prints only the report."""

    def __init__(self, report: Report) -> None:
        super().__init__(report.format())
        self.report = report


_TTS_EAGLE = "TTSEagleWorker (sglang_tts/sglang/eagle_worker.py) subclasses it"
_TTS_DFLASH = "TTSDFlashWorker (sglang_tts/sglang/dflash_worker.py) subclasses it"
_EAGLE_V2 = "sglang.srt.speculative.eagle_worker_v2"
_DFLASH_V2 = "sglang.srt.speculative.dflash_worker_v2"
_MODEL_RUNNER = "sglang.srt.model_executor.model_runner:ModelRunner"
_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater:WeightUpdater"

REQUIREMENTS: tuple[Requirement, ...] = (
    # --- every server with the plugin (plugin.py, algorithm.py and the hooks it registers) --------
    Requirement(
        "sglang.srt.plugins.hook_registry:HookRegistry.register",
        "every hook is registered through it",
        ("target", "hook", "hook_type"),
        calls=True,
    ),
    Requirement("sglang.srt.plugins.hook_registry:HookType", "hook kinds", attributes=("AROUND", "AFTER")),
    Requirement(
        "sglang.srt.speculative.spec_info:SpeculativeAlgorithm",
        "TTS delegates to the EAGLE3 / DFLASH members (algorithm.py)",
        attributes=("EAGLE3", "DFLASH", "register", "handle_server_args"),
    ),
    Requirement(
        "sglang.srt.speculative.spec_info:SpeculativeAlgorithm.register",
        "registers --speculative-algorithm TTS (algorithm.py)",
        ("name", "*", "supports_overlap", "spec_class", "validate_server_args"),
        calls=True,
    ),
    Requirement(
        "sglang.srt.speculative.spec_info:SpeculativeAlgorithm.handle_server_args",
        "TTS applies the builtin's defaults and checks (algorithm.py)",
        ("self", "server_args"),
        calls=True,
    ),
    Requirement("sglang.srt.speculative.spec_registry:CustomSpecAlgo", "TTSSpecAlgo subclasses it (algorithm.py)"),
    Requirement(
        "sglang.srt.speculative.spec_registry:get_spec", "idempotent registration (algorithm.py)", ("name",), calls=True
    ),
    Requirement(
        "sglang.srt.server_args:ServerArgs.add_cli_args", "AFTER hook adding the --tts-* flags (flags.py)", ("parser",)
    ),
    Requirement(
        "sglang.srt.managers.tokenizer_manager:TokenizerManager.update_request_meta_info",
        "AROUND hook writing TTS's meta_info keys (metrics.py)",
        ("self", "meta_info", "state", "customized_info", "index"),
    ),
    Requirement(
        "sglang.srt.managers.scheduler_components.output_streamer:SchedulerOutputStreamer"
        ".is_request_level_customized_info_key",
        "AROUND hook sending TTS's per-request rounds once (metrics.py)",
        ("self", "key"),
    ),
    Requirement(
        "sglang.srt.managers.tokenizer_manager:TokenizerManager._validate_one_request",
        "AROUND hook refusing empty prompts (requests.py)",
        ("self", "obj", "input_ids"),
    ),
    Requirement(
        "sglang.srt.speculative.adaptive_spec_params:adaptive_unsupported_reason",
        "AROUND hook letting --tts-controller use adaptive steps (adaptive_steps.py)",
        ("server_args",),
    ),
    Requirement(
        "sglang.srt.model_executor.model_runner_components.attention_backend_setup:configure_aux_hidden_state_capture",
        "AROUND hook wiring DFLASH capture for Qwen2 targets (dflash_capture.py)",
        ("*", "model", "dflash_use_aux_hidden_state", "dflash_target_layer_ids"),
    ),
    Requirement(
        "sglang.srt.managers.scheduler_components.weight_updater:SchedulerWeightUpdaterManager._select_runners",
        "AROUND hook routing weight updates of a TTS server (weight_sync.py)",
        ("self",),
    ),
    Requirement(
        "sglang.srt.managers.scheduler_components.weight_updater:SchedulerWeightUpdaterManager",
        "weight_sync.py reads the draft worker",
        attributes=("draft_worker",),
    ),
    Requirement(
        "sglang.srt.arg_groups.overrides:resolving_view",
        "reads resolved server args in hooks",
        ("server_args",),
        calls=True,
    ),
    # --- a TTS launch: the worker classes and what they read ---------------------------------------
    Requirement(
        f"{_EAGLE_V2}:EAGLEWorkerV2",
        f"{_TTS_EAGLE} and reads these attributes",
        attributes=(
            "draft_worker",
            "target_worker",
            "device",
            "adaptive_controller",
            "speculative_num_steps",
            "speculative_num_draft_tokens",
            "topk",
            "req_to_token_pool",
        ),
        scope="tts",
    ),
    Requirement(
        f"{_EAGLE_V2}:EAGLEWorkerV2.__init__",
        _TTS_EAGLE,
        ("self", "server_args", "gpu_id", "nccl_port", "target_worker"),
        scope="tts",
        calls=True,
    ),
    Requirement(
        f"{_EAGLE_V2}:EAGLEWorkerV2.forward_batch_generation",
        f"{_TTS_EAGLE}, overrides it and calls it by these keywords",
        ("self", "batch", "*", "on_publish", "grammar_barrier", "pp_proxy_tensors"),
        scope="tts",
        calls=True,
    ),
    Requirement(
        f"{_EAGLE_V2}:EAGLEWorkerV2.verify",
        f"{_TTS_EAGLE}, overrides it and calls it by these keywords",
        ("self", "batch", "*", "pp_proxy_tensors", "grammar_barrier"),
        scope="tts",
        calls=True,
    ),
    Requirement(
        f"{_EAGLE_V2}:EAGLEWorkerV2.on_verify_complete_cpu",
        f"{_TTS_EAGLE} and overrides it",
        ("self", "num_correct_drafts_per_req", "*", "batch_size"),
        scope="tts",
        calls=True,
    ),
    Requirement(
        f"{_EAGLE_V2}:EAGLEWorkerV2.clear_cache_pool",
        f"{_TTS_EAGLE} and overrides it (/flush_cache resets the hybrid's suffix trie)",
        ("self",),
        scope="tts",
        calls=True,
    ),
    Requirement(
        f"{_EAGLE_V2}:EAGLEWorkerV2._forward_prefill_batch",
        f"{_TTS_EAGLE} and overrides it",
        ("self", "batch"),
        scope="tts",
    ),
    Requirement(
        f"{_EAGLE_V2}:EagleDraftWorker",
        "TTS reads the draft runner; --tts-hybrid wraps the draft step and reads the topk-1 chain layout",
        attributes=("draft_runner", "cuda_graph_runner", "_topk1_parents_prealloc", "_topk1_score_indices_prealloc"),
        scope="tts",
    ),
    Requirement(
        f"{_EAGLE_V2}:EagleDraftWorker.draft_forward",
        "--tts-hybrid wraps it (returns parent_list, top_scores_index, draft_tokens, draft_probs)",
        ("self", "forward_batch"),
        scope="tts",
    ),
    Requirement(
        "sglang.srt.speculative.cpp_ngram.ngram_corpus:NgramCorpus.__init__",
        "--tts-hybrid's suffix proposer builds SGLang's NGRAM corpus (sglang/suffix.py)",
        (
            "self",
            "*",
            "max_trie_depth",
            "min_bfs_breadth",
            "max_bfs_breadth",
            "draft_token_num",
            "match_type",
            "capacity",
        ),
        scope="tts",
        calls=True,
    ),
    Requirement(
        "sglang.srt.speculative.cpp_ngram.ngram_corpus:NgramCorpus.batch_get",
        "--tts-hybrid's suffix proposer asks it for chains",
        ("self", "req_ids", "batch_tokens", "total_lens"),
        scope="tts",
        calls=True,
    ),
    Requirement(
        f"{_DFLASH_V2}:DFlashWorkerV2",
        f"{_TTS_DFLASH} and reads these attributes",
        attributes=(
            "use_compact_draft_cache",
            "selector",
            "lilicorr",
            "_is_domino",
            "target_worker",
            "block_size",
            "_mask_token_id",
            "draft_model",
            "model_runner",
            "draft_model_runner",
            "device",
            "_draft_block_tokens_buf",
            "_fused_kv_helper",
            "_use_fused_kv_materialize",
        ),
        scope="tts",
    ),
    Requirement(
        f"{_DFLASH_V2}:DFlashWorkerV2.__init__",
        _TTS_DFLASH,
        ("self", "server_args", "gpu_id", "nccl_port", "target_worker"),
        scope="tts",
        calls=True,
    ),
    Requirement(
        f"{_DFLASH_V2}:DFlashWorkerV2.forward_batch_generation",
        f"{_TTS_DFLASH}, overrides it and calls it by these keywords",
        ("self", "batch", "*", "on_publish", "grammar_barrier", "pp_proxy_tensors"),
        scope="tts",
    ),
    Requirement(
        f"{_DFLASH_V2}:DFlashWorkerV2.on_verify_complete_cpu",
        f"{_TTS_DFLASH} and overrides it",
        ("self", "num_correct_drafts_per_req", "*", "batch_size"),
        scope="tts",
        calls=True,
    ),
    Requirement(
        f"{_DFLASH_V2}:DFlashWorkerV2._can_skip_verify_logits",
        f"{_TTS_DFLASH} and overrides it",
        ("self", "batch", "sampling_info"),
        scope="tts",
        calls=True,
    ),
    Requirement(
        f"{_DFLASH_V2}:DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc",
        f"{_TTS_DFLASH}, overrides it to capture the target features",
        ("self", "*", "target_hidden"),
        scope="tts",
    ),
    Requirement(
        "sglang.srt.models.dflash:DFlashAttention",
        "TTS refreshes the fused context-KV weights from these (dflash_worker.py)",
        attributes=("qkv_proj", "q_size", "kv_size", "k_norm"),
        scope="tts",
    ),
    Requirement(
        _MODEL_RUNNER,
        "the workers read the model and its pools; weight_sync.py the draft runner's model and updater",
        attributes=("model", "req_to_token_pool", "token_to_kv_pool", "dtype", "weight_updater"),
        scope="tts",
    ),
    Requirement(
        f"{_UPDATER}.update_weights_from_tensor",
        "weight_sync.py loads a retrained drafter's tensors through the draft runner's updater",
        ("self", "*", "named_tensors", "load_format"),
        calls=True,
        scope="tts",
    ),
    Requirement(
        "sglang.srt.model_executor.model_runner_components.weight_updater:LocalSerializedTensor",
        "weight_sync.py unwraps a shipped drafter tensor (rank 0) before checking it",
        attributes=("values", "get"),
        scope="tts",
    ),
    Requirement(
        f"{_UPDATER}.load_weights_from_distributed",
        "weight_sync.py loads a retrained drafter's received tensors through the draft runner's updater",
        ("self", "named_tensors"),
        calls=True,
        scope="tts",
    ),
    Requirement(
        "sglang.srt.mem_cache.memory_pool:KVCache",
        "TTS reads the drafter's K/V of the context (binding.py)",
        attributes=("get_key_buffer", "get_value_buffer"),
        scope="tts",
    ),
    Requirement(
        "sglang.srt.managers.utils:GenerationBatchResult",
        "the workers read the verify result",
        attributes=("logits_output", "accept_lens", "accept_index", "next_token_ids"),
        scope="tts",
    ),
    Requirement(
        "sglang.srt.layers.logits_processor:LogitsProcessorOutput",
        "the workers read the target's logits and features",
        attributes=("hidden_states", "next_token_logits"),
        scope="tts",
    ),
    Requirement(
        "sglang.srt.managers.schedule_batch:ScheduleBatch",
        "the workers read the batch",
        attributes=(
            "forward_mode",
            "reqs",
            "seq_lens",
            "seq_lens_cpu",
            "extend_lens",
            "prefix_lens",
            "input_ids",
            "req_pool_indices",
            "is_extend_in_batch",
            "spec_info",
        ),
        scope="tts",
    ),
    Requirement(
        "sglang.srt.managers.schedule_batch:Req",
        "TTS keeps per-request state and reports through customized_info",
        attributes=("rid", "output_ids", "sampling_params", "customized_info"),
        scope="tts",
    ),
    Requirement(
        "sglang.srt.speculative.adaptive_spec_params:AdaptiveSpeculativeParams",
        "--tts-controller's ControlledSteps stands in for it (adaptive_steps.py)",
        attributes=(
            "candidate_steps",
            "set_cuda_graph_bs",
            "cuda_graph_bs_for_step",
            "get_steps_for_batch",
            "on_verify_complete",
        ),
        scope="tts",
    ),
    Requirement(
        "sglang.srt.speculative.adaptive_spec_params:AdaptiveSpeculativeParams.on_verify_complete",
        "--tts-controller's ControlledSteps takes the same call",
        ("self", "num_correct_drafts_per_req", "batch_size"),
        scope="tts",
    ),
    Requirement(
        "sglang.srt.models.qwen2:Qwen2ForCausalLM.set_eagle3_layers_to_capture",
        "DFLASH capture on Qwen2 targets calls it (dflash_capture.py)",
        ("self", "layer_ids"),
        scope="tts",
        calls=True,
    ),
    # --- the CPU layer (sglang_tts/platform/cpu), only where it is active -------------------------
    Requirement(
        "sglang.srt.layers.attention.torch_native_backend:TorchNativeAttnBackend.forward_extend",
        "AROUND hook adding TARGET_VERIFY (platform/cpu/attention.py)",
        ("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache"),
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.layers.attention.torch_native_backend:TorchNativeAttnBackend.__init__",
        "torch-native draft backends build it (platform/cpu/attention.py)",
        ("self", "model_runner"),
        scope="cpu",
        calls=True,
    ),
    Requirement(
        "sglang.srt.speculative.draft_utils:DraftBackendFactory.create_decode_backend",
        "AROUND hook (platform/cpu/attention.py)",
        ("self",),
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.speculative.draft_utils:DraftBackendFactory.create_draft_extend_backend",
        "AROUND hook (platform/cpu/attention.py)",
        ("self",),
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.speculative.eagle_utils:_verify_uses_greedy",
        "AROUND hook routing CPU sampling to the sampler (platform/cpu/spec_sampling.py)",
        ("*", "is_cpu"),
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.speculative.eagle_utils:eagle_sample",
        "AROUND hook: a seeded verify walks against the seeded samples (platform/cpu/seeded_sampling.py)",
        ("verify_input", "batch", "logits_output"),
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.speculative.eagle_utils:verify_tree_greedy_func",
        "AROUND hook replacing target_predict inside a seeded verify (platform/cpu/seeded_sampling.py)",
        ("*", "target_predict"),
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.sampling.sampling_batch_info:SamplingBatchInfo.from_schedule_batch",
        "AROUND hook: a seed per request in sampling_seed (platform/cpu/seeded_sampling.py)",
        ("batch", "vocab_size"),
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.sampling.sampling_batch_info:SamplingBatchInfo.merge_batch",
        "AROUND hook keeping sampling_seed one per request (platform/cpu/seeded_sampling.py)",
        ("self", "other"),
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.layers.sampler:top_k_top_p_min_p_sampling_from_probs_torch",
        "AROUND hook: min-p batches sample unseeded; seeded verify samples (platform/cpu/seeded_sampling.py)",
        ("probs", "top_ks", "top_ps", "min_ps", "need_min_p_sampling", "sampling_seed", "positions"),
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.layers.sampler:multinomial_with_seed",
        "AROUND hook: the same seeded samples, noise only for the columns that can win (platform/cpu/seeded_gumbel.py)",
        ("logprobs", "seed", "positions"),
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.layers.sampler:sampling_from_probs_torch",
        "called for seeded verify samples (platform/cpu/seeded_sampling.py)",
        ("probs", "*", "sampling_seed", "positions"),
        scope="cpu",
        calls=True,
    ),
    Requirement(
        "sglang.srt.speculative.eagle_utils:tree_speculative_sampling_target_only",
        "filled with the PyTorch sampler (platform/cpu/spec_sampling.py)",
        scope="cpu",
    ),
    Requirement("sglang.srt.speculative.eagle_utils:top_k_renorm_prob", "filled (spec_sampling.py)", scope="cpu"),
    Requirement("sglang.srt.speculative.eagle_utils:top_p_renorm_prob", "filled (spec_sampling.py)", scope="cpu"),
    Requirement(
        "sglang.srt.speculative.dflash_utils:tree_speculative_sampling_target_only",
        "filled with the PyTorch sampler (platform/cpu/dflash.py)",
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.speculative.dflash_utils:_DFLASH_SAMPLING_VERIFY_AVAILABLE",
        "set once the sampler is filled (platform/cpu/dflash.py)",
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.arg_groups.speculative_hook:_handle_dflash",
        "AROUND hook letting DFLASH run on CPU (platform/cpu/dflash.py)",
        ("server_args",),
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.arg_groups.speculative_hook:current_platform",
        "swapped while _handle_dflash runs (platform/cpu/dflash.py)",
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.arg_groups.choices:DRAFT_ATTENTION_BACKEND_CHOICES",
        "torch_native is added (platform/cpu/dflash.py)",
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.arg_groups.choices:add_draft_attention_backend_choices",
        "adds torch_native (platform/cpu/dflash.py)",
        scope="cpu",
    ),
    Requirement(
        f"{_DFLASH_V2}:DFlashWorkerV2.forward_batch_generation",
        "AROUND hook making record_stream a no-op on CPU (platform/cpu/dflash.py)",
        ("self",),
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.models.dflash:DFlashAttention.__init__",
        "AFTER hook switching the Triton QK-norm off (platform/cpu/dflash.py)",
        ("self",),
        attributes=(),
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.models.dflash:DFlashAttention",
        "the CPU layer switches this flag off (platform/cpu/dflash.py)",
        attributes=("use_table_qk_norm_rope",),
        scope="cpu",
    ),
    Requirement(
        f"{_MODEL_RUNNER}._extend_forward_kwargs",
        "AFTER hook keeping the runner's dtype (platform/cpu/dflash.py)",
        ("self", "forward_batch"),
        scope="cpu",
    ),
    Requirement(
        f"{_MODEL_RUNNER}.load_model", "AROUND hook packing weights (platform/cpu/linear.py)", ("self",), scope="cpu"
    ),
    Requirement(
        "sglang.srt.layers.quantization.unquant:UnquantizedLinearMethod.apply",
        "AROUND hook running packed linears (platform/cpu/linear.py)",
        ("self", "layer", "x", "bias"),
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.layers.logits_processor:LogitsProcessor._compute_lm_head",
        "AROUND hook running the packed LM head (platform/cpu/linear.py)",
        ("self", "hidden_states", "lm_head", "embedding_bias"),
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.layers.logits_processor:should_apply_lm_head_quant_method",
        "decides whether an LM head is plain (platform/cpu/linear.py)",
        ("lm_head", "quant_method"),
        scope="cpu",
        calls=True,
    ),
    Requirement("sglang.srt.layers.linear:LinearBase", "packed layers (platform/cpu/linear.py)", scope="cpu"),
    Requirement(
        "sglang.srt.layers.quantization.unquant:UnquantizedLinearMethod",
        "packed layers (platform/cpu/linear.py)",
        scope="cpu",
    ),
    *(
        Requirement(
            f"{_UPDATER}.{name}",
            "AROUND hook repacking updated weights (platform/cpu/linear.py)",
            ("self",),
            scope="cpu",
        )
        for name in (
            "update_weights_from_disk",
            "update_weights_from_tensor",
            "update_weights_from_ipc",
            "load_weights_from_distributed",
        )
    ),
    Requirement(_UPDATER, "the repack hook asks for the model", attributes=("get_model",), scope="cpu"),
    Requirement(
        "sglang.srt.utils.common:get_free_cpu_memory",
        "AROUND hook counting this process's memory (platform/cpu/memory.py)",
        (),
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.mem_cache.memory_pool:KVWriteLoc",
        "CPU attention writes K/V through it (platform/cpu/attention.py)",
        ("loc", "swa_loc"),
        scope="cpu",
        calls=True,
    ),
    Requirement(
        "sglang.srt.layers.radix_attention:AttentionType",
        "CPU attention (platform/cpu/attention.py)",
        attributes=("ENCODER_ONLY",),
        scope="cpu",
    ),
    Requirement(
        "sglang.srt.runtime_context:attention_backends",
        "CPU draft backends (platform/cpu/attention.py)",
        (),
        scope="cpu",
        calls=True,
    ),
    *(
        Requirement(target, "AROUND hook timing a phase (platform/cpu/round_timing.py)", ("self",), scope="cpu-timing")
        for target in (
            f"{_MODEL_RUNNER}.forward",
            "sglang.srt.managers.scheduler:Scheduler.run_batch",
            f"{_EAGLE_V2}:EAGLEWorkerV2.forward_batch_generation",
            f"{_DFLASH_V2}:DFlashWorkerV2.forward_batch_generation",
            f"{_EAGLE_V2}:EagleDraftWorker.draft",
            f"{_EAGLE_V2}:EAGLEWorkerV2.verify",
            f"{_EAGLE_V2}:EagleDraftWorker._draft_extend_for_decode",
        )
    ),
)


# --- the checks -------------------------------------------------------------------------------


def installed_version() -> tuple[str, str]:
    """(version, location) of the importable SGLang."""
    try:
        import sglang
        from sglang.version import __version__
    except ImportError as e:
        return f"not importable ({e})", "-"
    return str(__version__), str(getattr(sglang, "__path__", ["?"])[0])


def _release(version: str) -> tuple[int, ...] | None:
    """The release numbers of a version ("0.5.23" of "0.5.23.post1+cu130"); None if it has none."""
    match = re.match(r"v?(\d+(?:\.\d+)*)", version.strip())
    return tuple(int(x) for x in match.group(1).split(".")) if match else None


def version_matches(found: str, expected: str = SGLANG_VERSION) -> bool:
    """Same release (a local build, post release or repack of it counts as the same)."""
    release = _release(found)
    return release is not None and release == _release(expected)


def resolve(target: str) -> object:
    """The object at `module:qualname` (ImportError / AttributeError when absent)."""
    module_name, _, qualname = target.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in qualname.split(".") if qualname else ():
        obj = getattr(obj, part)
    return obj


def _describe_params(sig: inspect.Signature) -> str:
    return "(" + ", ".join(_param_text(p) for p in sig.parameters.values()) + ")"


def _param_text(p: inspect.Parameter) -> str:
    prefix = {_P.VAR_POSITIONAL: "*", _P.VAR_KEYWORD: "**"}.get(p.kind, "")
    keyword_only = "*" if p.kind == _P.KEYWORD_ONLY else ""
    return f"{keyword_only}{prefix}{p.name}"


def _describe_expected(expected: tuple[str, ...]) -> str:
    return "(" + ", ".join([*expected, "..."] if expected else []) + ")"


def param_difference(expected: tuple[str, ...], sig: inspect.Signature, calls: bool = False) -> str | None:
    """What about `sig` breaks the calls declared by `expected` (see Requirement.params and .calls);
    None if nothing."""
    split = expected.index("*") if "*" in expected else len(expected)
    positional, keywords = expected[:split], expected[split + 1 :]
    params = list(sig.parameters.values())
    leading = [p.name for p in params if p.kind in _POSITIONAL]
    problems = []
    if leading[: len(positional)] != list(positional):
        problems.append(f"positional ({', '.join(leading[: len(positional) + 1])})")
    missing = [k for k in keywords if k not in sig.parameters or sig.parameters[k].kind not in _BY_KEYWORD]
    if missing and not any(p.kind == _P.VAR_KEYWORD for p in params):
        problems.append(f"no keyword {', '.join(missing)}")
    known = set(positional) | set(keywords)
    required = [p.name for p in params if p.name not in known and p.kind not in _VARIADIC and p.default is _P.empty]
    if calls and required:
        problems.append(f"new required {', '.join(required)}")
    if not problems:
        return None
    return f"{_describe_params(sig)}: {'; '.join(problems)}"


def _code_names(cls: type) -> set[str]:
    """Every name the code of `cls`'s methods (and its bases', outside builtins) mentions."""
    names: set[str] = set()

    def walk(code: types.CodeType) -> None:
        names.update(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                walk(const)

    for klass in cls.__mro__:
        if klass.__module__ == "builtins":
            continue
        for value in vars(klass).values():
            func = getattr(value, "fget", None) or getattr(value, "__func__", None) or value
            if callable(func):
                func = inspect.unwrap(func)
            code = getattr(func, "__code__", None)
            if isinstance(code, types.CodeType):
                walk(code)
    return names


def check_requirement(req: Requirement) -> list[Difference]:
    try:
        obj = resolve(req.target)
    except Exception as e:  # ImportError, AttributeError, or anything the import raises
        return [Difference(req.target, "it to exist", f"{type(e).__name__}: {e}", req.use)]
    found: list[Difference] = []
    if req.params is not None:
        try:
            sig = inspect.signature(obj)  # follows HookRegistry wrappers (__wrapped__)
        except (TypeError, ValueError) as e:
            found.append(Difference(req.target, "a callable", f"{type(obj).__name__} ({e})", req.use))
        else:
            problem = param_difference(req.params, sig, req.calls)
            if problem is not None:
                found.append(Difference(req.target, f"parameters {_describe_expected(req.params)}", problem, req.use))
    if req.attributes:
        if not isinstance(obj, type):
            found.append(Difference(req.target, "a class", type(obj).__name__, req.use))
            return found
        fields = set(getattr(obj, "__dataclass_fields__", {}))
        named: set[str] | None = None
        missing = []
        for attr in req.attributes:
            if hasattr(obj, attr) or attr in fields:
                continue
            if named is None:
                named = _code_names(obj)
            if attr not in named:
                missing.append(attr)
        if missing:
            found.append(
                Difference(
                    req.target,
                    f"attribute(s) {', '.join(missing)}",
                    "none of them (not on the class, not named in its methods' code)",
                    req.use,
                )
            )
    return found


def check(
    scopes: Iterable[str] = REGISTER_SCOPES,
    requirements: Sequence[Requirement] = REQUIREMENTS,
    expected_version: str = SGLANG_VERSION,
) -> Report:
    """Compare the installed SGLang with the declared internals of `scopes`."""
    scopes = tuple(s for s in SCOPES if s in set(scopes))
    version, location = installed_version()
    differences: list[Difference] = []
    if not version_matches(version, expected_version):
        differences.append(Difference("SGLang version", expected_version, version))
    checked = []
    seen: set[Requirement] = set()
    for req in requirements:
        if req.scope in scopes and req not in seen:
            seen.add(req)
            checked.append(req.target)
            differences.extend(check_requirement(req))
    return Report(expected_version, version, location, scopes, tuple(checked), tuple(differences))


def skip_requested() -> bool:
    return os.environ.get(SKIP_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def require(scopes: Iterable[str]) -> Report:
    """Check `scopes`; on a difference raise SGLangMismatchError, or with $SGLANG_TTS_SKIP_COMPAT_CHECK
    set log the report as a warning and go on."""
    report = check(scopes)
    if not report.ok:
        if not skip_requested():
            raise SGLangMismatchError(report)
        logger.warning("%s=1: starting anyway.\n%s", SKIP_ENV, report.format())
    return report


def register_scopes(cpu_active: bool) -> tuple[str, ...]:
    """The scopes `plugin.register()` checks in this process."""
    scopes = list(REGISTER_SCOPES)
    if cpu_active:
        scopes.append("cpu")
        if os.environ.get("SGLANG_TTS_CPU_ROUND_TIMING", "").strip():
            scopes.append("cpu-timing")
    return tuple(scopes)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_tts.sglang.compat",
        description="Check that the installed SGLang has the internals sglang-tts relies on "
        "(exit 0: all match; 1: the report names each difference).",
    )
    parser.add_argument("--all", action="store_true", help="also check the CPU layer's internals on a GPU machine")
    parser.add_argument("--verbose", "-v", action="store_true", help="list every internal checked")
    args = parser.parse_args(argv)
    from sglang_tts.platform import cpu

    cpu_active = cpu.install()  # on a CPU-only machine SGLang's modules import only with the CPU layer
    scopes = (*register_scopes(cpu_active), *LAUNCH_SCOPES)
    if args.all:
        scopes = SCOPES
    report = check(scopes)
    print(report.format(verbose=args.verbose))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
