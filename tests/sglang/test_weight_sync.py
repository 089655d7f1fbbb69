"""RL weight sync with a TTS server (sglang/weight_sync.py): SGLang's weight-update endpoints change
the target only, the drafter keeps TTS's weights (reset to base or kept, --tts-on-target-update),
and the other control endpoints an RL trainer drives answer and leave the server healthy.

Unit tests first (the routing and the drafter's side, no server), then real servers on CPU with
the tiny loopy target: one at a time (2 cores), each started, used and stopped by its fixture.
"""

from __future__ import annotations

import argparse
import base64
import json
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
from sglang_tts.drafters.loading import load_drafter
from sglang_tts.sglang import flags, weight_sync
from sglang_tts.sglang.runtime import TTSRuntime
from sglang_tts.sglang.weight_sync import (
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
TTS_ARGS = ["--speculative-algorithm", "TTS", "--tts-update-stride", "1", "--tts-lr", "1e-2", "--tts-scope", "global",
            "--tts-allow-weight-digest", "--enable-metrics"]  # fmt: skip


# --- unit: routing SGLang's runners -----------------------------------------------------------------


class _Updater:
    """A runner's own weight updater: records what reached it; `ok` says how its load goes."""

    def __init__(self, ok: bool | None) -> None:
        self.ok = ok  # None: a drafter, which must never see the target's weights
        self.calls: list[str] = []

    def update_weights_from_disk(self, model_path, load_format, recapture_cuda_graph=False):
        self.calls.append(model_path)
        if self.ok is None:
            raise AssertionError("the target's checkpoint reached the drafter")
        return self.ok, "loaded" if self.ok else "failed"

    def begin_weight_update(self) -> None:
        self.calls.append("begin")


class _Sync:
    mode = "reset"

    def __init__(self) -> None:
        self.sources: list[str] = []

    def target_updated(self, source):
        self.sources.append(source)


def _runner(name: str, ok: bool | None = None):
    return SimpleNamespace(name=name, weight_updater=_Updater(ok), check_weights=lambda **kw: {"runner": name})


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


def test_drafter_weights_sent_alone_are_refused_with_the_reason():
    draft = _runner("draft")
    sync = _Sync()
    [(_, view)] = route_runners([("draft", draft)], sync)  # selector "draft": no target runner
    for load in ("update_weights_from_tensor", "load_weights_from_distributed"):
        ok, message = getattr(view.weight_updater, load)([("fc.weight", torch.zeros(1))])
        assert not ok and message == DRAFT_UPDATE_REFUSED
    assert "--speculative-draft-model-path" in DRAFT_UPDATE_REFUSED
    assert sync.sources == [] and draft.weight_updater.calls == []


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


def _no_traceback(server) -> None:
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log.split("The server is fired up")[-1], server.log_tail(80)


def _metric(server, name: str) -> dict[str, float]:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=60) as r:
        lines = r.read().decode().splitlines()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in lines if line.startswith(name)}


@pytest.fixture(scope="module")
def eagle3_run(loopy_llama, loopy_eagle3, new_target, reference):
    """An EAGLE-3 TTS server driven as an RL trainer would, between requests and while they run."""
    out: dict = {"endpoints": {}}
    args = [*TTS_ARGS, "--speculative-draft-model-path", str(loopy_eagle3), *CHAIN]
    with sglang_server(str(loopy_llama), args) as server:
        url = server.base_url
        out["before"] = [_run(server, p) for p in PROMPTS]
        out["disk"] = _call(url, "/update_weights_from_disk", {"model_path": str(new_target)})
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

        # The tensor path: a session, drafter weights alone (refused), the target's (applied).
        state = load_file(str(new_target / "model.safetensors"))
        out["begin"] = _call(url, "/begin_weight_update", {"selector": "all"})
        payload = _serialized(state)
        out["tensor_draft"] = _call(
            url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload], "selector": "draft"}
        )
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
        out["metrics"] = _metric(server, "sglang_tts:target_updates_total")
        _no_traceback(server)
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


def test_update_weights_from_tensor_updates_the_target_and_refuses_drafter_weights(eagle3_run, reference):
    assert eagle3_run["begin"][0] == 200 and eagle3_run["end"][0] == 200
    status, body = eagle3_run["tensor_draft"]
    assert status == 400 and json.loads(body)["message"] == DRAFT_UPDATE_REFUSED
    status, body = eagle3_run["tensor_all"]
    assert status == 200 and json.loads(body)["success"], body
    assert [r["output_ids"] for r in eagle3_run["after_tensor"]] == reference


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


def test_dflash_server_applies_the_update_to_the_target_and_keeps_adapting(
    loopy_llama, loopy_dflash, new_target, reference
):
    args = [*TTS_ARGS, "--speculative-draft-model-path", str(loopy_dflash), "--tts-on-target-update", "keep"]
    with sglang_server(str(loopy_llama), args) as server:
        before = _run(server, PROMPTS[0])
        status, body = _call(server.base_url, "/update_weights_from_disk", {"model_path": str(new_target)})
        assert server.healthy()
        after = [_run(server, p) for p in PROMPTS]
        _no_traceback(server)
    assert status == 200 and "(kept)" in json.loads(body)["message"], body
    assert [r["output_ids"] for r in after] == reference
    base = before["meta_info"]["tts_weight_digest_start"]
    assert before["meta_info"]["tts_weight_digest_end"] != base
    assert after[0]["meta_info"]["tts_weight_digest_start"] != base  # keep: not back to base
