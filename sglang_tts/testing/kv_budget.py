"""The KV budget SGLang 0.5.23 grants a CPU server, computed in the test process by SGLang's own functions.

A one-rank server without a drafter does, at start:
1. `bootstrap.measure_pre_model_load_memory`: the free memory before the weights (the baseline);
2. loads the weights;
3. `KVCacheConfigurator._profile_available_bytes(baseline)`: the bytes the KV pool may take
   (`free_now - baseline * (1 - mem_fraction_static)`), or the ValueError "Loaded weights leave no GPU
   memory for the KV cache" when that is not positive. --max-total-tokens caps the pool only after this.

`kv_budget_bytes` runs steps 1 and 3 unchanged, with the two things a test must control replaced: the
reading of the machine's free memory (`get_free_cpu_memory`, which the CPU layer hooks) and SGLang's
runtime context, reduced to the fields those two functions read for a one-rank text-only model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any
from unittest import mock


def kv_budget_bytes(mem_fraction_static: float, read_free: Callable[[], int], load: Callable[[], Any]) -> int:
    """SGLang's KV budget for a CPU server whose free-memory reading is `read_free` (bytes; stands for
    `sglang.srt.utils.common.get_free_cpu_memory`) and whose weights load is `load()` (what it returns is
    held until the budget is read, like loaded weights). Raises SGLang's ValueError when it refuses."""
    from sglang.srt.distributed import bootstrap
    from sglang.srt.mem_cache import kv_cache_configurator
    from sglang.srt.utils import common

    one_rank = SimpleNamespace(
        gpu_id=0,
        host="127.0.0.1",
        gated_launch_port=None,
        tp_size=1,
        launch_world_size=1,
        world_size=1,
        cpu_group=None,
        world_group=SimpleNamespace(cpu_group=None),
    )
    schedule = SimpleNamespace(
        mem_fraction_static=mem_fraction_static, prefill_max_requests=None, max_mamba_cache_size=None
    )
    no_graphs = SimpleNamespace(
        graph=SimpleNamespace(cuda_graph_config=SimpleNamespace(prefill=SimpleNamespace(full_prefill_max_req=None)))
    )
    replaced = [
        (common, "get_free_cpu_memory", read_free),
        (common, "get_cpu_ids_by_node", lambda: ["0"]),  # one NUMA node: the reading is the whole machine's
        *((bootstrap, name, lambda: one_rank) for name in ("get_device", "get_serving", "get_parallel")),
        (bootstrap, "get_world_group", lambda: one_rank),
        (kv_cache_configurator, "get_parallel", lambda: one_rank),
        (kv_cache_configurator, "get_schedule", lambda: schedule),
        (kv_cache_configurator, "get_exec", lambda: no_graphs),
        (kv_cache_configurator, "get_disagg", lambda: SimpleNamespace(disaggregation_mode="null")),
        (kv_cache_configurator, "get_mm", lambda: SimpleNamespace(mm_feature_transport=None)),
    ]
    configurator = SimpleNamespace(
        device="cpu", gpu_id=0, mambaish_config=None, model_config=SimpleNamespace(is_multimodal=False)
    )
    with contextlib.ExitStack() as stack:
        for module, name, value in replaced:
            stack.enter_context(mock.patch.object(module, name, value))
        baseline_gb = bootstrap.measure_pre_model_load_memory(device="cpu", is_draft_worker=False)
        weights = load()
        budget = kv_cache_configurator.KVCacheConfigurator._profile_available_bytes(configurator, baseline_gb)
        del weights
        return budget
