"""RL weight sync with a TTS server (sglang/weight_sync.py): SGLang's weight-update endpoints change
the target only, the drafter keeps TTS's weights (reset to base or kept, --tts-on-target-update);
a retrained drafter sent with selector "draft" is loaded by SGLang and re-read as TTS's base (or
refused, or rolled back); and the other control endpoints an RL trainer drives answer and leave the
server healthy.

Unit tests first (the routing and the drafter's side, no server), then real servers on CPU with
the tiny loopy target: one at a time (2 cores), each started, used and stopped by its fixture.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from sglang_testing import core

from sglang_tts.bench.server import sglang_server
from sglang_tts.config import TTSConfig, TTSConfigError
from sglang_tts.core.adapters import AdaptedDrafter
from sglang_tts.drafters.loading import load_drafter
from sglang_tts.sglang import flags, weight_sync
from sglang_tts.sglang.binding import bind_draft_publisher
from sglang_tts.sglang.failures import FAULT_SITES_ENV
from sglang_tts.sglang.runtime import CHECK_ENV, TTSRuntime
from sglang_tts.sglang.weight_sync import (
    DRAFT_UPDATE_FAILED,
    DRAFT_UPDATE_REFUSED,
    RunnerView,
    TargetSync,
    refresh_borrowed_target_tensors,
    route_runners,
)
from sglang_tts.testing.reference import generate_ids

PROMPTS = [[4, 454, 607, 82, 343, 14, 357, 315, 3, 5], [4, 100, 200, 300, 3, 5]]
NEW_TOKENS = 48
INFLIGHT_TOKENS = 600  # ~8 s on CPU: still running when the endpoint is called 3 s in
CHAIN = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
DETAILS = {"tts_return_weight_digest": True}
# Global scope never resets on its own: a reset seen between two requests is the target update's.
# Stride 2: the fallback self-check (SGLANG_TTS_CHECK_FALLBACK) runs in the rounds that publish nothing.
TTS_ARGS = ["--speculative-algorithm", "TTS", "--tts-update-stride", "2", "--tts-lr", "1e-2", "--tts-scope", "global",
            "--tts-allow-weight-digest", "--enable-metrics"]  # fmt: skip


# --- unit: routing SGLang's runners -----------------------------------------------------------------


class _Updater:
    """A runner's own weight updater: records what reached it; `ok` says how its load goes."""

    def __init__(self, ok: bool | None) -> None:
        self.ok = ok  # None: a drafter, which must never see the target's weights
        self.calls: list = []

    def update_weights_from_disk(self, model_path, load_format, recapture_cuda_graph=False):
        self.calls.append(model_path)
        if self.ok is None:
            raise AssertionError("the target's checkpoint reached the drafter")
        return self.ok, "loaded" if self.ok else "failed"

    def update_weights_from_tensor(self, named_tensors, load_format=None):
        self.calls.append(("tensor", [name for name, _ in named_tensors], load_format))
        return True, "Success"

    def load_weights_from_distributed(self, named_tensors):
        self.calls.append(("distributed", [name for name, _ in named_tensors]))
        return True, "Succeeded to update parameter online."

    def begin_weight_update(self) -> None:
        self.calls.append("begin")

    def end_weight_update(self, *, run_post_load: bool) -> None:
        self.calls.append(("end", run_post_load))


class _Sync:
    mode = "reset"

    def __init__(self) -> None:
        self.sources: list[str] = []
        self.drafters: list[tuple] = []

    def target_updated(self, source):
        self.sources.append(source)

    def drafter_loaded(self, source, named_tensors, draft_model, load):
        self.drafters.append((source, draft_model))
        return load(list(named_tensors))


def _runner(name: str, ok: bool | None = None):
    return SimpleNamespace(
        name=name, weight_updater=_Updater(ok), check_weights=lambda **kw: {"runner": name}, model=f"{name} model"
    )


def _load(routed, path: str = "/new/target") -> tuple[bool, str]:
    """What SGLang's update_weights_from_disk does with the runners: load each, stop at a failure."""
    ok, message = True, ""
    for _, runner in routed:
        ok, message = runner.weight_updater.update_weights_from_disk(path, "auto", recapture_cuda_graph=False)
        if not ok:
            break
    return ok, message


def test_a_target_update_skips_the_drafter_and_tells_the_runtime_once():
    target, drafts = _runner("target", ok=True), [_runner("draft0"), _runner("draft1")]
    sync = _Sync()
    routed = route_runners([("target", target), *[("draft", d) for d in drafts]], sync)
    assert [role for role, _ in routed] == ["target", "draft", "draft"]
    ok, message = _load(routed)
    assert ok and message == "Target weights updated; the TTS drafter keeps its own weights (reset to base)."
    assert target.weight_updater.calls == ["/new/target"]  # SGLang's own load of the target
    assert sync.sources == ["disk"]  # one operation, one target update, however many draft runners
    assert all(d.weight_updater.calls == [] for d in drafts)
    for (_, view), runner in zip(routed, [target, *drafts]):
        assert isinstance(view, RunnerView)
        assert view.check_weights(action="checksum") == {"runner": runner.name}  # the rest is the runner's
        view.weight_updater.begin_weight_update()
    assert target.weight_updater.calls[-1] == "begin" and all(d.weight_updater.calls == [] for d in drafts)


def test_selector_target_tells_the_runtime_and_a_failed_load_does_not():
    sync = _Sync()
    assert _load(route_runners([("target", _runner("target", ok=True))], sync))[0]
    assert sync.sources == ["disk"]
    failing = route_runners([("target", _runner("target", ok=False)), ("draft", _runner("draft"))], sync)
    assert _load(failing) == (False, "failed")
    assert sync.sources == ["disk"]  # the failed load reset nothing; the drafter never saw it


def test_drafter_weights_sent_alone_go_through_tts_into_the_draft_runner():
    draft = _runner("draft")
    sync = _Sync()
    [(_, view)] = route_runners([("draft", draft)], sync)  # selector "draft": no target runner
    updater = view.weight_updater
    updater.begin_weight_update()  # a session opened with selector "draft": the runner's own
    assert updater.update_weights_from_tensor(named_tensors=[("fc.weight", torch.zeros(1))]) == (True, "Success")
    assert updater.load_weights_from_distributed([("norm.weight", torch.zeros(1))])[0]
    updater.end_weight_update(run_post_load=False)
    # TTS's checks, then SGLang's own loader of the draft runner (named tensors), for the draft model.
    assert sync.drafters == [("tensor", "draft model"), ("distributed", "draft model")]
    assert draft.weight_updater.calls == [
        "begin",
        ("tensor", ["fc.weight"], None),
        ("distributed", ["norm.weight"]),
        ("end", False),
    ]
    ok, message = updater.update_weights_from_tensor(named_tensors=[], load_format="flattened_bucket")
    assert not ok and message.startswith(DRAFT_UPDATE_REFUSED) and "'flattened_bucket'" in message
    assert len(sync.drafters) == 2 and sync.sources == []  # refused before TTS or SGLang saw it


# --- unit: the drafter's side of a target update -------------------------------------------------------


def _fake_target(vocab: int, hidden: int, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    target = torch.nn.Module()
    target.model = torch.nn.Module()
    target.model.embed_tokens = torch.nn.Embedding(vocab, hidden)
    target.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        target.model.embed_tokens.weight.copy_(torch.randn(vocab, hidden, generator=gen))
        target.lm_head.weight.copy_(torch.randn(vocab, hidden, generator=gen))
    return target


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_the_trained_drafter_rereads_the_targets_new_embedding_and_head(kind, loopy_llama, loopy_eagle3, loopy_dflash):
    config = json.loads((loopy_llama / "config.json").read_text())
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    old, new = _fake_target(vocab, hidden, 0), _fake_target(vocab, hidden, 1)
    drafter = load_drafter(
        loopy_eagle3 if kind == "eagle3" else loopy_dflash,
        target_embedding=old.model.embed_tokens.weight.detach().clone(),
        target_lm_head=old.lm_head.weight.detach().clone(),
        target_config=config,
    )
    runtime = TTSRuntime(drafter, TTSConfig(sync=True, log_interval=0), None, "cpu")
    own_head = drafter.lm_head.weight.detach().clone() if kind == "eagle3" else None
    refreshed = refresh_borrowed_target_tensors(runtime.drafter, new)
    # EAGLE-3 with a draft vocabulary has its own LM head; DFlash borrows both.
    assert refreshed == (("embed_weight",) if kind == "eagle3" else ("embed_weight", "borrowed_lm_head"))
    for module in (drafter, runtime.distiller.base_drafter, runtime.distiller.trained_drafter):
        assert torch.equal(module.embed_weight, new.model.embed_tokens.weight)
        if kind == "dflash":
            assert torch.equal(module.borrowed_lm_head, new.lm_head.weight)
    if own_head is not None:
        assert torch.equal(drafter.lm_head.weight, own_head)


def _adapted_runtime(mode: str) -> TTSRuntime:
    settings = dict(update_stride=1, stride_pinned=True, lr=1e-2, reg_lambda=0.0, log_interval=0, sync=True)
    runtime = TTSRuntime(core.TinyDrafter(), TTSConfig(scope="global", on_target_update=mode, **settings), None, "cpu")
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        runtime.before_draft(["a"])
        canvas = core.random_canvas(generator, batch=1)
        canvas.request_ids = ["a"]
        runtime.observe(canvas)
    runtime.before_draft(["a"])
    return runtime


def _serving(runtime: TTSRuntime) -> list[torch.Tensor]:
    return [p.detach().clone() for p in runtime.distiller._serving_params]


@pytest.mark.parametrize("mode", ["reset", "keep"])
def test_a_target_update_resets_or_keeps_the_adapted_drafter(mode):
    runtime = _adapted_runtime(mode)
    stats = runtime.distiller.stats
    adapted, resets, updates = _serving(runtime), stats.num_resets, stats.num_updates
    base = runtime.distiller.base_weights
    assert updates >= 3 and any(not torch.equal(a, b) for a, b in zip(adapted, base))
    sync = TargetSync(runtime, torch.nn.Module(), mode)  # TinyDrafter borrows nothing
    report = sync.target_updated("disk")
    assert (report.source, report.action, report.index, report.refreshed) == ("disk", mode, 1, ())
    after = _serving(runtime)
    if mode == "reset":
        assert all(torch.equal(a, b) for a, b in zip(after, base))  # the next round drafts with base, bitwise
        assert stats.num_resets == resets + 1 and stats.scope_updates == 0
        assert not runtime.distiller.optimizer.state
    else:
        assert all(torch.equal(a, b) for a, b in zip(after, adapted))
        assert stats.num_resets == resets and runtime.distiller.optimizer.state
    assert runtime.failures.total == 0


def test_a_failed_refresh_is_absorbed_and_the_drafter_still_resets(monkeypatch):
    runtime = _adapted_runtime("reset")
    resets = runtime.distiller.stats.num_resets

    def broken(drafter, target):
        raise RuntimeError("the new embedding does not fit")

    monkeypatch.setattr(weight_sync, "refresh_borrowed_target_tensors", broken)
    report = TargetSync(runtime, torch.nn.Module(), "reset").target_updated("tensor")
    assert report.refreshed == () and runtime.failures.counts["target_update"] == 1
    assert runtime.distiller.stats.num_resets == resets + 1
    assert all(torch.equal(a, b) for a, b in zip(_serving(runtime), runtime.distiller.base_weights))


def test_on_target_update_flag(monkeypatch):
    monkeypatch.delenv(flags.ENV_VAR, raising=False)
    parser = argparse.ArgumentParser(prog="sglang serve")
    flags.add_tts_cli_args(parser)
    try:
        parser.parse_args([])
        assert flags.tts_config_from_env().on_target_update == "reset"
        parser.parse_args(["--tts-on-target-update", "keep"])
        assert flags.tts_config_from_env().on_target_update == "keep"
        with pytest.raises(SystemExit):
            parser.parse_args(["--tts-on-target-update", "forget"])
    finally:
        flags.reset_env()
    with pytest.raises(TTSConfigError, match="--tts-on-target-update"):
        TTSConfig(on_target_update="forget").validate()


# --- unit: a retrained drafter through selector "draft" -----------------------------------------------

FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}  # fmt: skip


class _SGLangDraftModel(torch.nn.Module):
    """SGLang's EAGLE-3 draft model as TTS binds it (`model.` prefix, fused qkv / gate_up, the LM head
    at the top) with a `load_weights` that places checkpoint names as llama_eagle3.py's does: unknown
    names are silently skipped, and with `fail_after` N it raises after writing N tensors."""

    def __init__(self, drafter: torch.nn.Module) -> None:
        super().__init__()
        self.fail_after: int | None = None
        self.parts: dict[str, list[tuple[str, int]]] = {}  # fused name -> [(part leaf, rows)]
        fused: dict[str, list[torch.Tensor]] = {}
        for name, param in drafter.named_parameters():
            leaf = name.split(".")[-2]
            home = name if name.startswith("lm_head") else f"model.{name}"
            if leaf in FUSED:
                home = home.replace(leaf, FUSED[leaf])
                self.parts.setdefault(home, []).append((leaf, param.shape[0]))
                fused.setdefault(home, []).append(param.detach())
            else:
                self._put(home, param.detach())
        for home, tensors in fused.items():
            self._put(home, torch.cat(tensors))

    def _put(self, dotted: str, tensor: torch.Tensor) -> None:
        *path, leaf = dotted.split(".")
        module: torch.nn.Module = self
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor.clone(), requires_grad=False))

    def load_weights(self, weights) -> None:
        params = dict(self.named_parameters())
        for i, (name, tensor) in enumerate(weights):
            if self.fail_after is not None and i == self.fail_after:
                raise AssertionError(f"{name}: the loader gave up")
            name = name.removeprefix("model.")
            leaf = name.split(".")[-2]
            if leaf in FUSED:
                home = f"model.{name.replace(leaf, FUSED[leaf])}"
                offset = 0
                for part, rows in self.parts[home]:
                    if part == leaf:
                        params[home].data[offset : offset + rows].copy_(tensor)
                    offset += rows
            elif name in params or f"model.{name}" in params:
                params[name if name in params else f"model.{name}"].data.copy_(tensor)

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.named_parameters()}


class _DraftUpdater:
    """The draft runner's weight updater: SGLang's load through `model.load_weights` (which may raise)."""

    def __init__(self, model: _SGLangDraftModel) -> None:
        self.model = model
        self.loads = 0

    def update_weights_from_tensor(self, named_tensors, load_format=None):
        self.loads += 1
        self.model.load_weights(named_tensors)
        return True, "Success"


@pytest.fixture
def eagle3_sync(loopy_llama, loopy_eagle3):
    """A TTS runtime on the tiny EAGLE-3 drafter publishing into a stand-in of SGLang's draft model,
    adapted away from its base (an optimizer step published), with its TargetSync."""
    config = json.loads((loopy_llama / "config.json").read_text())
    embedding = torch.randn(config["vocab_size"], config["hidden_size"], generator=torch.Generator().manual_seed(0))
    drafter = load_drafter(loopy_eagle3, target_embedding=embedding, target_config=config)
    model = _SGLangDraftModel(drafter)
    settings = TTSConfig(sync=True, log_interval=0, scope="global", lr=1e-2)
    runtime = TTSRuntime(drafter, settings, bind_draft_publisher(drafter, model), "cpu")
    distiller = runtime.distiller
    generator = torch.Generator().manual_seed(1)
    for param in distiller.train_params:
        param.grad = torch.randn(param.shape, generator=generator)
    distiller.optimizer.step()
    distiller.optimizer.zero_grad(set_to_none=True)
    distiller.republish()
    distiller.barrier()  # SGLang's draft model now serves the adapted drafter
    updater = _DraftUpdater(model)
    sync = TargetSync(runtime, torch.nn.Module(), "reset")
    return SimpleNamespace(runtime=runtime, model=model, updater=updater, sync=sync, checkpoint=loopy_eagle3)


def _ship(case, state: dict[str, torch.Tensor]) -> tuple[bool, str]:
    updater = case.updater
    return case.sync.drafter_loaded(
        "tensor",
        list(state.items()),
        case.model,
        lambda tensors: updater.update_weights_from_tensor(named_tensors=tensors, load_format=None),
    )


def _retrained(checkpoint: Path, seed: int = 0, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """A drafter checkpoint's tensors after a "retraining": every float tensor moved by `scale` of its
    spread; d2t / t2d (the draft vocabulary) as they are."""
    generator = torch.Generator().manual_seed(seed)
    state = load_file(str(checkpoint / "model.safetensors"))
    return {
        name: t + scale * t.std() * torch.randn(t.shape, generator=generator) if t.is_floating_point() else t
        for name, t in state.items()
    }


def _state(case) -> dict:
    """Everything a drafter update may change: the trained copy, the base weights, the optimizer
    state, SGLang's draft model."""
    distiller = case.runtime.distiller
    return {
        "trained": [p.detach().clone() for p in distiller.train_params],
        "base": [b.clone() for b in distiller.base_weights],
        "optimizer": len(distiller.optimizer.state),
        "served": case.model.snapshot(),
    }


def _same(a: dict, b: dict) -> bool:
    return (
        all(torch.equal(x, y) for x, y in zip(a["trained"], b["trained"]))
        and all(torch.equal(x, y) for x, y in zip(a["base"], b["base"]))
        and a["optimizer"] == b["optimizer"]
        and a["served"].keys() == b["served"].keys()
        and all(torch.equal(a["served"][k], b["served"][k]) for k in a["served"])
    )


def _serves_the_trained_copy(case) -> bool:
    """SGLang's draft model holds exactly the trained copy (what the fallback self-check needs)."""
    trained = dict(case.runtime.drafter.trainable_named_parameters())
    return all(
        torch.equal(b.dst, torch.cat([trained[s].detach() for s in b.sources], b.cat_dim))
        for b in case.runtime.distiller.publisher.bindings
    )


def test_a_retrained_drafter_becomes_the_base_and_adaptation_restarts(eagle3_sync):
    case = eagle3_sync
    distiller = case.runtime.distiller
    resets, version = distiller.stats.num_resets, distiller.weight_version
    assert distiller.optimizer.state and _serves_the_trained_copy(case)
    retrained = _retrained(case.checkpoint)  # every tensor, d2t / t2d included (unchanged)
    ok, message = _ship(case, retrained)
    assert ok and "re-read them as its base" in message, message
    # The trained copy and the base weights are the shipped tensors, bitwise (re-read from the fused model).
    named = dict(case.runtime.drafter.named_parameters())
    base = dict(zip(distiller.train_names, distiller.base_weights))
    for name, tensor in retrained.items():
        if name in named:
            assert torch.equal(named[name], tensor) and torch.equal(base[name], tensor), name
    qkv = case.model.get_parameter("model.layers.0.self_attn.qkv_proj.weight")
    assert torch.equal(qkv[:64], retrained["layers.0.self_attn.q_proj.weight"])  # SGLang's fused layout
    assert _serves_the_trained_copy(case)
    # A fresh adaptation: optimizer state gone, one reset, the new weights published (a new version).
    assert not distiller.optimizer.state and distiller.stats.num_resets == resets + 1
    assert distiller.weight_version > version and distiller.stats.scope_updates == 0
    assert case.sync.num_drafter_updates == 1 and case.runtime.failures.total == 0


def test_tensors_not_shipped_go_back_to_base_not_to_the_adapted_values(eagle3_sync):
    case = eagle3_sync
    distiller = case.runtime.distiller
    base = dict(zip(distiller.train_names, [b.clone() for b in distiller.base_weights]))
    fc = _retrained(case.checkpoint)["fc.weight"]
    ok, message = _ship(case, {"model.fc.weight": fc})  # a checkpoint name with SGLang's prefix
    assert ok, message
    for name, param in case.runtime.drafter.trainable_named_parameters():
        assert torch.equal(param, fc if name == "fc.weight" else base[name]), name
    assert _serves_the_trained_copy(case)


@pytest.mark.parametrize(
    ("bad", "named", "reason"),
    [
        ("shape", "layers.0.self_attn.q_proj.weight", "checkpoint shape (64, 64) != model (64, 128)"),
        ("unknown", "layers.1.mlp.up_proj.weight", "no tensor of the eagle3 drafter has this name"),
        ("borrowed", "embed_tokens.weight", "the drafter uses the target's embed_tokens"),
        ("vocabulary", "d2t", "differs from the launched draft vocabulary map"),
        ("non-finite", "norm.weight", "has non-finite values"),
    ],
)
def test_drafter_tensors_that_do_not_fit_are_refused_by_name_and_change_nothing(eagle3_sync, bad, named, reason):
    case = eagle3_sync
    shipped = _retrained(case.checkpoint)
    if bad == "shape":
        shipped[named] = shipped[named][:, :64]
    elif bad == "unknown":
        shipped[named] = shipped["layers.0.mlp.up_proj.weight"]
    elif bad == "borrowed":
        shipped[named] = torch.zeros(1024, 64)
    elif bad == "vocabulary":
        shipped[named] = shipped[named] + 1
    else:
        shipped[named] = shipped[named].clone()
        shipped[named][3] = math.nan
    before = _state(case)
    ok, message = _ship(case, shipped)
    assert not ok and message.startswith(DRAFT_UPDATE_REFUSED) and f"{named}: {reason}" in message, message
    assert case.updater.loads == 0  # SGLang's loader never saw them
    assert _same(before, _state(case)) and case.sync.num_drafter_updates == 0


@pytest.mark.parametrize("failure", ["loader raises", "loader skips a tensor", "rebase fails"])
def test_a_drafter_load_that_fails_part_way_is_rolled_back(eagle3_sync, monkeypatch, failure):
    case = eagle3_sync
    distiller = case.runtime.distiller
    shipped = _retrained(case.checkpoint)
    if failure == "loader raises":
        case.model.fail_after = 5  # five tensors written into SGLang's draft model, then an assertion
    elif failure == "loader skips a tensor":  # e.g. a name SGLang's loader does not know (it skips those)
        real = case.model.load_weights
        monkeypatch.setattr(case.model, "load_weights", lambda ws: real([w for w in ws if w[0] != "fc.weight"]))
    else:

        def broken_reset() -> None:
            raise RuntimeError("reset broke")

        monkeypatch.setattr(distiller, "reset", broken_reset)
    before = _state(case)
    ok, message = _ship(case, shipped)
    assert not ok and message.startswith(DRAFT_UPDATE_FAILED), message
    assert case.runtime.failures.counts["drafter_update"] == 1
    after = _state(case)
    assert all(torch.equal(before["served"][k], after["served"][k]) for k in before["served"])  # SGLang's restored
    assert all(torch.equal(x, y) for x, y in zip(before["base"], after["base"]))
    if failure == "rebase fails":  # reset had begun: the trained copy is back at the old base, republished
        assert "reset broke" in message
        assert all(torch.equal(x, y) for x, y in zip(after["trained"], after["base"])) and not after["optimizer"]
        distiller.barrier()
        assert _serves_the_trained_copy(case)
    else:  # nothing of TTS's was touched: the adapted drafter serves on, with its optimizer state
        assert ("gave up" if failure == "loader raises" else "fc.weight") in message
        assert _same(before, after) and _serves_the_trained_copy(case)
    assert case.sync.num_drafter_updates == 0


def test_under_per_request_adapters_the_plain_drafter_is_rebased_and_every_adapter_reset(loopy_llama, loopy_eagle3):
    config = json.loads((loopy_llama / "config.json").read_text())
    embedding = torch.randn(config["vocab_size"], config["hidden_size"], generator=torch.Generator().manual_seed(0))
    drafter = load_drafter(loopy_eagle3, target_embedding=embedding, target_config=config)
    model = _SGLangDraftModel(drafter)  # SGLang's draft model holds the plain drafter; adapters are hooked in
    adapted = AdaptedDrafter(drafter, num_slots=2, rank=2)
    settings = TTSConfig(sync=True, log_interval=0, scope="request", lr=1e-2)
    runtime = TTSRuntime(adapted, settings, None, "cpu")  # publisher None: the adapters serve in place
    distiller = runtime.distiller
    with torch.no_grad():
        for param in distiller.train_params:  # both requests' adapters have moved
            param.add_(0.1)
    distiller.republish()
    distiller.barrier()
    sync = TargetSync(runtime, torch.nn.Module(), "reset")
    case = SimpleNamespace(runtime=runtime, model=model, updater=_DraftUpdater(model), sync=sync)
    retrained = _retrained(loopy_eagle3)
    ok, message = _ship(case, retrained)
    assert ok, message
    for module in (distiller.trained_drafter.base, distiller.base_drafter.base, adapted.base):
        named = dict(module.named_parameters())
        assert all(torch.equal(named[n], t) for n, t in retrained.items() if n in named)
    # Every adapter is back at its start (what serves drafts with the retrained drafter alone).
    assert all(torch.equal(p, b) for p, b in zip(_serving(runtime), distiller.base_weights))
    assert all(torch.equal(b, torch.zeros_like(b)) for b in adapted.bank.b)


def test_rebase_discards_the_update_in_flight(monkeypatch):
    runtime = _adapted_runtime("reset")
    distiller = runtime.distiller
    canvas = core.random_canvas(torch.Generator().manual_seed(5), batch=1)
    canvas.request_ids = ["a"]
    runtime.observe(canvas)
    assert distiller.executor.pending  # an update trained on the old drafter, not yet collected
    updates, resets = distiller.stats.num_updates, distiller.stats.num_resets
    new = {name: torch.full_like(p, 0.25) for name, p in distiller.trained_drafter.named_parameters()}
    distiller.rebase(new)
    assert not distiller.executor.pending and distiller.stats.num_updates == updates + 1  # collected...
    # ...and discarded: the serving copy, the trained copy and the base drafter hold the new weights,
    # trained and frozen ones alike (TinyDrafter's embedding and LM head are frozen).
    assert set(new) - set(distiller.train_names) == {"embed.weight", "lm_head.weight"}
    serving = dict(runtime.drafter.named_parameters())
    trained = dict(distiller.trained_drafter.named_parameters())
    base = dict(distiller.base_drafter.named_parameters())
    for name, value in new.items():
        assert torch.equal(serving[name], value) and torch.equal(trained[name], value), name
        assert torch.equal(base[name], value), name
    assert distiller.stats.num_resets == resets + 1 and not distiller.optimizer.state


# --- servers ------------------------------------------------------------------------------------------


def _call(base_url: str, path: str, body: dict | None = None, timeout: float = 120.0) -> tuple[int, str]:
    """POST (or GET without a body) -> (HTTP status, body text); 4xx/5xx are returned, not raised."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base_url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _update_when_idle(base_url: str, body: dict) -> tuple[int, str]:
    """`/update_weights_from_disk` between requests, as a trainer's step does it: `/flush_cache?timeout=30`
    first, which waits until SGLang's scheduler has let go of the last finished batch (a call that lands
    before it does is answered 400: weights applied, cache not flushed; a race of SGLang's, not TTS's)."""
    status, text = _call(base_url, "/flush_cache?timeout=30", {})
    assert status == 200, text
    return _call(base_url, "/update_weights_from_disk", body)


def _serialized(state: dict[str, torch.Tensor]) -> str:
    """SGLang's tensor payload (MultiprocessingSerializer, base64), readable by the server process:
    storages shared by file name (the default, file descriptors, needs a process SGLang started)."""
    from sglang.srt.utils import MultiprocessingSerializer

    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        payload = MultiprocessingSerializer.serialize(list(state.items()), output_str=True)
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    base64.b64decode(payload)  # what the HTTP body carries: base64 text
    return payload


@pytest.fixture(scope="module")
def new_target(loopy_llama, tmp_path_factory) -> Path:
    """The loopy target after a "training step": every non-norm tensor moved by half its spread."""
    out = tmp_path_factory.mktemp("weight-sync") / "loopy-llama-step1"
    shutil.copytree(loopy_llama, out)
    generator = torch.Generator().manual_seed(0)
    state = load_file(str(out / "model.safetensors"))
    state = {
        name: t if "norm" in name else t + 0.5 * t.std() * torch.randn(t.shape, generator=generator)
        for name, t in state.items()
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def reference(new_target):
    """Greedy outputs of a server without speculation launched on the new weights."""
    with sglang_server(str(new_target)) as server:
        return [generate_ids(server.base_url, p, NEW_TOKENS)["output_ids"] for p in PROMPTS]


def _run(server, prompt, n=NEW_TOKENS):
    return generate_ids(server.base_url, prompt, n, custom_params=DETAILS)


def _no_traceback(server, injected: int = 0) -> None:
    """No traceback in the server's log after start-up, but `injected` of the fault injected on purpose."""
    log = server.log_path.read_text(errors="replace").split("The server is fired up")[-1]
    tracebacks = log.split("Traceback")[1:]
    unexpected = [t for t in tracebacks if "InjectedFault: injected fault at drafter_update" not in t]
    assert not unexpected and len(tracebacks) == injected, server.log_tail(80)


def _draft_checksums(base_url: str) -> dict[str, str]:
    """SGLang's per-tensor checksums of the draft model (/weights_checker), but the embedding it
    shares with the target."""
    body = {"action": "checksum", "selector": "draft", "skip_tensor_list": ["embed_tokens"]}
    status, text = _call(base_url, "/weights_checker", body)
    assert status == 200, text
    [rank] = json.loads(text)["ranks"]
    return rank["checksums"]


def _ship_drafter(base_url: str, state: dict[str, torch.Tensor]) -> list[tuple[int, str]]:
    """A trainer shipping a retrained drafter: a session of its own, the tensors with selector "draft"."""
    payload = _serialized(state)
    return [
        _call(base_url, "/begin_weight_update", {"selector": "draft"}),
        _call(base_url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload], "selector": "draft"}),
        _call(base_url, "/end_weight_update", {}),
    ]


def _metric(server, name: str) -> dict[str, float]:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=60) as r:
        lines = r.read().decode().splitlines()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in lines if line.startswith(name)}


@pytest.fixture(scope="module")
def eagle3_run(loopy_llama, loopy_eagle3, new_target, reference):
    """An EAGLE-3 TTS server driven as an RL trainer would, between requests and while they run. The
    fallback self-check is on throughout; the second drafter load that passes TTS's checks fails on
    purpose after SGLang loaded it (an injected fault at the drafter_update site)."""
    out: dict = {"endpoints": {}}
    args = [*TTS_ARGS, "--speculative-draft-model-path", str(loopy_eagle3), *CHAIN]
    env = {CHECK_ENV: "1", FAULT_SITES_ENV: "drafter_update:2"}
    with sglang_server(str(loopy_llama), args, env=env) as server:
        url = server.base_url
        out["launch_checksums"] = _draft_checksums(url)
        out["before"] = [_run(server, p) for p in PROMPTS]
        out["disk"] = _update_when_idle(url, {"model_path": str(new_target)})
        out["healthy_after_disk"] = server.healthy()
        out["after"] = [_run(server, p) for p in PROMPTS]

        # The control endpoints of an RL step, between requests.
        for path, body in (
            ("/pause_generation", {}),
            ("/continue_generation", {}),
            ("/flush_cache", {}),
            ("/release_memory_occupation", {}),
            ("/resume_memory_occupation", {}),
            ("/abort_request", {"abort_all": True}),
            ("/update_weight_version", {"new_version": "step-1"}),
        ):
            out["endpoints"][path] = _call(url, path, body)
        out["healthy_after_endpoints"] = server.healthy()

        # The tensor path: a session, the target's tensors sent as the drafter's (refused: they do not
        # fit it; SGLang's draft model is left as it was), then as the target's (applied).
        state = load_file(str(new_target / "model.safetensors"))
        out["begin"] = _call(url, "/begin_weight_update", {"selector": "all"})
        payload = _serialized(state)
        out["checksums_before_refusal"] = _draft_checksums(url)
        out["tensor_draft"] = _call(
            url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload], "selector": "draft"}
        )
        out["checksums_after_refusal"] = _draft_checksums(url)
        out["healthy_after_refusal"] = server.healthy()
        out["tensor_all"] = _call(url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
        out["end"] = _call(url, "/end_weight_update", {})
        out["after_tensor"] = [_run(server, p) for p in PROMPTS]

        # While a request runs: abort_all, then a weight update.
        for key, path, body, n in (
            ("inflight_abort", "/abort_request", {"abort_all": True}, 2000),
            ("inflight_disk", "/update_weights_from_disk", {"model_path": str(new_target)}, INFLIGHT_TOKENS),
        ):
            result: dict = {}
            thread = threading.Thread(target=lambda r=result, n=n: r.update(_run(server, PROMPTS[0], n)))
            thread.start()
            time.sleep(3.0)
            out[key] = _call(url, path, body)
            thread.join(timeout=300)
            out[key + "_request"] = result
        out["healthy_at_end"] = server.healthy()
        out["final"] = [_run(server, p)["output_ids"] for p in PROMPTS]

        # A retrained drafter (its tensors perturbed) shipped with selector "draft", then served.
        original = load_file(str(loopy_eagle3 / "model.safetensors"))
        out["draft_retrained"] = _ship_drafter(url, _retrained(loopy_eagle3))
        out["checksums_retrained"] = _draft_checksums(url)
        out["retrained"] = [_run(server, p) for p in PROMPTS]
        # The next load fails after SGLang loaded it (injected): rolled back, the drafter serves on.
        out["checksums_before_failure"] = _draft_checksums(url)
        out["draft_failed"] = _ship_drafter(url, original)
        out["checksums_after_failure"] = _draft_checksums(url)
        out["after_failure"] = _run(server, PROMPTS[0])
        # The launched drafter shipped back: served bitwise as at launch.
        out["draft_original"] = _ship_drafter(url, original)
        out["checksums_original"] = _draft_checksums(url)
        out["original"] = _run(server, PROMPTS[0])
        out["healthy_after_drafters"] = server.healthy()
        out["metrics"] = _metric(server, "sglang_tts:target_updates_total")
        out["drafter_metrics"] = _metric(server, "sglang_tts:drafter_updates_total")
        _no_traceback(server, injected=1)
    return out


def test_update_weights_from_disk_changes_the_target_and_keeps_the_server(eagle3_run, reference):
    status, body = eagle3_run["disk"]
    assert status == 200 and json.loads(body)["success"], body
    assert "TTS drafter keeps its own weights (reset to base)" in json.loads(body)["message"]
    assert eagle3_run["healthy_after_disk"]
    for before, after, ref in zip(eagle3_run["before"], eagle3_run["after"], reference):
        assert after["output_ids"] == ref  # token for token a no-speculation server on the new weights
        assert before["output_ids"] != ref  # the update changed the policy


def test_the_adapted_drafter_is_reset_to_base_by_the_target_update(eagle3_run):
    first, second = eagle3_run["before"]
    base = first["meta_info"]["tts_weight_digest_start"]
    # Scope global: the drafter adapts across requests and is never reset on its own...
    assert second["meta_info"]["tts_weight_digest_start"] != base
    assert first["meta_info"]["tts_weight_digest_end"] != base
    # ...until the target changed: the first request after it starts from the base drafter.
    assert eagle3_run["after"][0]["meta_info"]["tts_weight_digest_start"] == base
    assert eagle3_run["after"][0]["meta_info"]["tts_num_updates"] > 0  # and adapts on


def test_control_endpoints_answer_and_leave_the_server_healthy(eagle3_run, reference):
    for path, (status, body) in eagle3_run["endpoints"].items():
        assert status == 200, (path, body)
    assert eagle3_run["healthy_after_endpoints"] and eagle3_run["healthy_at_end"]
    assert eagle3_run["final"] == reference


def test_update_weights_from_tensor_updates_the_target_and_refuses_target_tensors_as_the_drafters(
    eagle3_run, reference
):
    assert eagle3_run["begin"][0] == 200 and eagle3_run["end"][0] == 200
    status, body = eagle3_run["tensor_draft"]
    message = json.loads(body)["message"]
    assert status == 400 and message.startswith(DRAFT_UPDATE_REFUSED), body
    # Named: a tensor the drafter borrows from the target, and one of the wrong shape.
    assert "model.embed_tokens.weight: the drafter uses the target's embed_tokens" in message
    assert "model.layers.0.self_attn.q_proj.weight: checkpoint shape (64, 64) != model (64, 128)" in message
    assert eagle3_run["checksums_after_refusal"] == eagle3_run["checksums_before_refusal"]  # unchanged
    assert eagle3_run["healthy_after_refusal"]
    status, body = eagle3_run["tensor_all"]
    assert status == 200 and json.loads(body)["success"], body
    assert [r["output_ids"] for r in eagle3_run["after_tensor"]] == reference


def _launched_digest(eagle3_run) -> str:
    return eagle3_run["before"][0]["meta_info"]["tts_weight_digest_start"]


def test_a_retrained_drafter_is_served_and_re_read_as_ttss_base(eagle3_run, reference):
    for status, body in eagle3_run["draft_retrained"]:
        assert status == 200 and json.loads(body)["success"], body
    assert "re-read them as its base" in json.loads(eagle3_run["draft_retrained"][1][1])["message"]
    changed = eagle3_run["checksums_retrained"]
    assert changed.keys() == eagle3_run["launch_checksums"].keys()
    # SGLang's draft model holds new values in every tensor the drafter has (all were perturbed).
    assert all(changed[k] != eagle3_run["checksums_before_refusal"][k] for k in changed)
    first, second = eagle3_run["retrained"]
    digest = first["meta_info"]["tts_weight_digest_start"]
    assert digest != _launched_digest(eagle3_run)  # TTS serves (and digests) the new drafter
    for result, ref in zip(eagle3_run["retrained"], reference):
        assert result["output_ids"] == ref  # lossless: the target's greedy output
        assert result["meta_info"]["tts_num_updates"] > 0  # adaptation goes on from the new base
        # The differentiable drafter predicts every token SGLang's draft model drafted: the re-read
        # base is what serves.
        assert result["meta_info"]["tts_fallback_checked"] > 0
        assert result["meta_info"]["tts_fallback_mismatches"] == 0
    assert second["meta_info"]["tts_weight_digest_start"] != digest  # scope global: it adapted on


def test_a_drafter_load_that_fails_is_rolled_back_and_the_server_serves_on(eagle3_run, reference):
    begin, tensor, end = eagle3_run["draft_failed"]
    assert begin[0] == 200 and end[0] == 200
    status, body = tensor
    assert status == 400 and json.loads(body)["message"].startswith(DRAFT_UPDATE_FAILED), body
    assert "injected fault at drafter_update" in json.loads(body)["message"]
    # SGLang had loaded the launched drafter; it is written back to the retrained, adapted one.
    assert eagle3_run["checksums_after_failure"] == eagle3_run["checksums_before_failure"]
    assert eagle3_run["checksums_after_failure"] != eagle3_run["launch_checksums"]
    after = eagle3_run["after_failure"]
    assert after["output_ids"] == reference[0]
    assert after["meta_info"]["tts_weight_digest_start"] != _launched_digest(eagle3_run)
    assert after["meta_info"]["tts_fallback_mismatches"] == 0 and after["meta_info"]["tts_num_updates"] > 0


def test_the_launched_drafter_shipped_back_is_served_bitwise(eagle3_run, reference):
    for status, body in eagle3_run["draft_original"]:
        assert status == 200 and json.loads(body)["success"], body
    assert eagle3_run["checksums_original"] == eagle3_run["launch_checksums"]
    result = eagle3_run["original"]
    assert result["meta_info"]["tts_weight_digest_start"] == _launched_digest(eagle3_run)
    assert result["output_ids"] == reference[0] and result["meta_info"]["tts_fallback_mismatches"] == 0
    assert eagle3_run["healthy_after_drafters"]


def test_drafter_updates_are_counted(eagle3_run):
    counts = {}
    for key, value in eagle3_run["drafter_metrics"].items():
        labels = dict(pair.split("=") for pair in key.partition("{")[2].rstrip("}").split(","))
        counts[labels["source"].strip('"'), labels["result"].strip('"')] = value
    assert counts == {("tensor", "applied"): 2, ("tensor", "refused"): 1, ("tensor", "failed"): 1}


def test_endpoints_while_a_request_runs(eagle3_run):
    status, _ = eagle3_run["inflight_abort"]
    assert status == 200
    aborted = eagle3_run["inflight_abort_request"]
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(aborted["output_ids"]) < 2000
    # A weight update mid-request: applied, but SGLang cannot flush the cache a running request
    # holds, and says so (400); the request runs to its end on the new weights.
    status, body = eagle3_run["inflight_disk"]
    message = json.loads(body)["message"]
    assert status == 200 or (status == 400 and "cache was not flushed because requests are still running" in message)
    finished = eagle3_run["inflight_disk_request"]
    assert len(finished["output_ids"]) == INFLIGHT_TOKENS and finished["meta_info"]["finish_reason"]["type"] == "length"


def test_target_updates_are_counted(eagle3_run):
    metrics = eagle3_run["metrics"]
    assert metrics['sglang_tts:target_updates_total{source="disk"}'] == 2
    assert metrics['sglang_tts:target_updates_total{source="tensor"}'] == 1


def test_dflash_server_takes_target_and_drafter_updates_and_keeps_adapting(
    loopy_llama, loopy_dflash, new_target, reference
):
    args = [*TTS_ARGS, "--speculative-draft-model-path", str(loopy_dflash), "--tts-on-target-update", "keep"]
    with sglang_server(str(loopy_llama), args, env={CHECK_ENV: "1"}) as server:
        launch = _draft_checksums(server.base_url)
        before = _run(server, PROMPTS[0])
        status, body = _update_when_idle(server.base_url, {"model_path": str(new_target)})
        assert server.healthy()
        after = [_run(server, p) for p in PROMPTS]
        # A retrained DFlash drafter, then the launched one shipped back.
        retrained_calls = _ship_drafter(server.base_url, _retrained(loopy_dflash))
        retrained = _run(server, PROMPTS[1])
        original_calls = _ship_drafter(server.base_url, load_file(str(loopy_dflash / "model.safetensors")))
        original = _draft_checksums(server.base_url)
        _no_traceback(server)
    assert status == 200 and "(kept)" in json.loads(body)["message"], body
    assert [r["output_ids"] for r in after] == reference
    base = before["meta_info"]["tts_weight_digest_start"]
    assert before["meta_info"]["tts_weight_digest_end"] != base
    assert after[0]["meta_info"]["tts_weight_digest_start"] != base  # keep: not back to base
    for status, body in (*retrained_calls, *original_calls):
        assert status == 200 and json.loads(body)["success"], body
    assert retrained["output_ids"] == reference[1] and retrained["meta_info"]["tts_num_updates"] > 0
    assert retrained["meta_info"]["tts_fallback_checked"] > 0 and retrained["meta_info"]["tts_fallback_mismatches"] == 0
    assert original == launch  # the re-read and republished base is bitwise what was shipped
