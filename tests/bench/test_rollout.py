"""sglang_tts.bench.rollout: the plan, the aggregates, resuming, drifted copies, and the runner against a fake
SGLang (no real server: tests/scripts/test_bench_rollout.py runs the real ones)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_tts.bench import rollout
from sglang_tts.bench.configs import BenchConfig, ConfigError, build_configs
from sglang_tts.bench.rollout import (
    DRIFT_CONFIGS,
    ROLLOUT_VARIANTS,
    RolloutPlan,
    RolloutSettings,
    Sample,
    StepLog,
    aggregate,
    change_ratios,
    check_resumable,
    external_config,
    make_drift_checkpoints,
    parse_names,
    pending_work,
    percentile,
    plan_steps,
    rerender,
    resume_state,
    run_rollout,
    sample_agreement,
    sample_id,
    steps_share_prompts,
    weight_labels,
)
from sglang_tts.bench.runner import RequestRecord, SamplingSettings
from sglang_tts.bench.workload import BenchPrompt


def _prompts(n: int) -> list[BenchPrompt]:
    return [BenchPrompt(f"p{i}", "d" if i % 2 else "e", (1, 2, 3 + i)) for i in range(n)]


# ----------------------------------------------------------------------------------------------------------
# Pure functions
# ----------------------------------------------------------------------------------------------------------


def test_percentile_interpolates_between_order_statistics():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 90) == pytest.approx(3.7)
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0 and percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([5.0], 90) == 5.0 and percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_steps_take_different_prompts_and_the_drift_weights_in_order():
    prompts = _prompts(7)
    steps = plan_steps(prompts, 3, 2)
    assert [[p.id for p in s.prompts] for s in steps] == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"]]
    assert {s.weights for s in steps} == {"launch"} and all(s.weights_path is None for s in steps)
    drifted = plan_steps(prompts, 3, 2, ["/c/step-1", "/c/step-2"])
    assert [(s.weights, s.weights_path) for s in drifted] == [
        ("launch", None),
        ("step-1", "/c/step-1"),
        ("step-2", "/c/step-2"),
    ]
    # Steps past the last checkpoint stay on it.
    assert [s.weights for s in plan_steps(prompts, 3, 2, ["/c/only"])] == ["launch", "only", "only"]
    with pytest.raises(ConfigError, match="need 8 prompts, got 7"):
        plan_steps(prompts, 4, 2)
    # --same-prompts: every step samples step 0's prompts, so what changes between steps is the weights.
    same = plan_steps(prompts[:2], 3, 2, ["/c/step-1", "/c/step-2"], same_prompts=True)
    assert [[p.id for p in s.prompts] for s in same] == [["p0", "p1"]] * 3
    assert [s.weights for s in same] == ["launch", "step-1", "step-2"]
    with pytest.raises(ConfigError, match="need 2 prompts, got 1"):
        plan_steps(prompts[:1], 3, 2, same_prompts=True)
    # Two checkpoints with one folder name (e.g. .../step-1/actor, .../step-2/actor) get distinct labels.
    assert weight_labels(["/a/actor", "/b/actor", "/c/x"]) == ["1:actor", "2:actor", "x"]


def _sample(config: str, step: int, lengths: list[int] | None, wall: float, **kw) -> Sample:
    tokens = kw.pop("completion_tokens", 1 + sum(lengths or []))
    record = RequestRecord(
        config,
        "d",
        kw.pop("prompt_id", "p0"),
        step,
        tokens,
        wall,
        accept_lengths=lengths,
        spec_verify_ct=None if lengths is None else len(lengths),
        finish_reason=kw.pop("finish_reason", "length"),
        **kw,
    )
    return Sample(record, step, 0, f"{step}-p0", "launch" if step == 0 else "ckpt1")


def test_aggregates_per_step_and_per_configuration_by_hand():
    samples = [
        # no-spec: step 0 takes 10 s, step 1 12 s
        _sample("no-spec", 0, None, 9.0, completion_tokens=40),
        _sample("no-spec", 0, None, 10.0, completion_tokens=60),
        _sample("no-spec", 1, None, 12.0, completion_tokens=50),
        # TTS: 2 tokens per round at step 0, 1.5 after the weights changed; 4 s and 8 s
        _sample("eagle3:tts", 0, [2, 2, 2], 3.0, tts_num_updates=2, tts_update_ms=30.0),
        _sample("eagle3:tts", 0, [1, 3], 4.0, tts_num_updates=4, tts_update_ms=30.0),
        _sample(
            "eagle3:tts", 1, [1, 2, 1, 2], 8.0, tts_num_updates=0, tts_update_ms=0.0, distinct_ngrams=[1, 1, 1, 0.2]
        ),
        # a step that did not finish: ignored
        _sample("eagle3:tts", 2, [4, 4], 1.0),
    ]
    logs = [
        StepLog("no-spec", 0, "launch", True, 10.0),
        StepLog("no-spec", 1, "ckpt1", True, 12.0),
        StepLog("eagle3:tts", 0, "launch", True, 4.0),
        StepLog("eagle3:tts", 1, "ckpt1", True, 8.0),
        StepLog("eagle3:tts", 2, "ckpt1", False, error="boom"),
    ]
    agg = aggregate(samples, logs, ["no-spec", "eagle3:tts"], bucket=4)
    assert [(s.config, s.step) for s in agg.steps] == [
        ("no-spec", 0),
        ("no-spec", 1),
        ("eagle3:tts", 0),
        ("eagle3:tts", 1),
    ]
    s0, s1 = agg.step("eagle3:tts", 0), agg.step("eagle3:tts", 1)
    assert s0.counts.tokens_per_round == 2.0 and s1.counts.tokens_per_round == 1.5
    assert s0.speedup_vs_no_spec == 2.5 and s1.speedup_vs_no_spec == 1.5  # 10 / 4, 12 / 8
    assert s0.change_ratio is None and s1.change_ratio == 0.75  # the weights changed at step 1
    assert s0.counts.completion_tokens == 7 + 5 and s0.tokens_per_s == 12 / 4
    assert s0.counts.latency_p50_s == 3.5 and s0.counts.latency_max_s == 4.0
    assert s0.counts.updates_per_sample == 3.0 and s0.counts.ms_per_update == 10.0
    assert s1.counts.looping == 1 and s1.counts.distinct_last_quarter == 0.2 and s0.counts.looping == 0
    assert agg.step("no-spec", 0).counts.tokens_per_round is None and agg.step("no-spec", 0).speedup_vs_no_spec is None
    tts = agg.config("eagle3:tts")
    assert tts.steps == 2 and tts.makespan_s == 12.0 and tts.speedup_vs_no_spec == pytest.approx(22 / 12)
    assert tts.counts.samples == 3 and tts.counts.tokens_per_round == pytest.approx((6 + 4 + 6) / 9)
    assert tts.counts.hit_max_tokens == 3
    # position buckets of 4 tokens, pooled over the finished steps: rounds start at 1,3,5 | 1,2 | 1,2,4,5, so
    # positions 0-3 hold 2,2 + 1,3 + 1,2 and 4-7 hold 2 + 1,2
    buckets = [(b.start, b.rounds, b.mean) for b in agg.buckets["eagle3:tts"]]
    assert buckets == [(0, 6, pytest.approx(11 / 6)), (4, 3, pytest.approx(5 / 3))]
    assert "no-spec" not in agg.buckets
    assert json.loads(json.dumps(agg.to_json()))["steps"][3]["change_ratio"] == 0.75


def test_change_ratios_only_where_the_weights_changed_and_both_steps_ran():
    tpr = {0: 2.0, 1: 1.0, 2: 1.5, 4: 3.0, 5: None}
    weights = {0: "a", 1: "b", 2: "b", 4: "c", 5: "d"}
    assert change_ratios(tpr, weights) == {1: 0.5}


# ----------------------------------------------------------------------------------------------------------
# Configurations and names
# ----------------------------------------------------------------------------------------------------------


def test_drift_configurations_end_with_keep_or_reset():
    configs = build_configs(list(DRIFT_CONFIGS), ["eagle3"], {"eagle3": "/d"}, variants=ROLLOUT_VARIANTS)
    assert [c.name for c in configs] == [
        "eagle3:frozen",
        "eagle3:tts-s5-request",
        "eagle3:tts-s5-global+keep",
        "eagle3:tts-s5-global+reset",
    ]
    assert configs[2].server_args[-2:] == ("--tts-on-target-update", "keep")
    assert configs[3].server_args[-2:] == ("--tts-on-target-update", "reset")
    assert "--tts-scope" in configs[3].server_args and "--tts-freeze" in configs[0].server_args


def test_names_are_checked_before_anything_is_prepared():
    with pytest.raises(ConfigError, match="the stale drafter under drift is `frozen`"):
        parse_names(["frozen", "stock"], drift=True)
    parse_names(["stock"], drift=False)
    parse_names(["tts-s5-group", "tts-s5-group+hybrid"], drift=False)


def test_a_running_server_is_named_by_configs_and_checked():
    assert external_config(None, {}, None).name == "no-spec"
    tts = external_config(
        "tts-s5-global", {"speculative_algorithm": "TTS", "speculative_draft_model_path": "/d"}, "eagle3"
    )
    assert (tts.name, tts.variant, tts.drafter, tts.scope) == ("eagle3:tts-s5-global", "tts", "/d", "global")
    with pytest.raises(ConfigError, match="does not match the server"):
        external_config("ngram", {"speculative_algorithm": "TTS"}, "eagle3")
    with pytest.raises(ConfigError, match="name its configuration"):
        external_config(None, {"speculative_algorithm": "EAGLE3"}, None)


# ----------------------------------------------------------------------------------------------------------
# Resuming
# ----------------------------------------------------------------------------------------------------------


def _plan(
    tmp_path: Path, configs: list[BenchConfig], drift: list[str] | None, url: str | None = None, seed: int | None = None
) -> RolloutPlan:
    settings = RolloutSettings(
        model="m",
        sampling=SamplingSettings(max_new_tokens=8, temperature=1.0, seed=seed),
        samples=2,
        warmup_tokens=2,
        probe_tokens=4,
        cpu_defaults=False,
        base_url=url,
        bucket=4,
    )
    steps = plan_steps(_prompts(4), 2, 2, drift)
    return RolloutPlan(tmp_path / "run", ["bench_rollout.py"], configs, steps, settings, drift is not None)


NO_SPEC = BenchConfig("no-spec", "no-spec")
TTS = BenchConfig("eagle3:tts-s5-global+keep", "tts", "eagle3", "/d", 5, server_args=("--tts-scope", "global"))


def test_resume_keeps_finished_pairs_and_reruns_the_rest(tmp_path):
    plan = _plan(tmp_path, [NO_SPEC, TTS], ["/c/ckpt1"])
    logs = [StepLog("no-spec", 0, "launch", True, 1.0), StepLog("no-spec", 1, "ckpt1", False, error="Boom: x")]
    samples = [_sample("no-spec", 0, None, 1.0), _sample("no-spec", 1, None, 1.0)]
    previous = {
        "benchmark": "rollout",
        "identity": plan.identity(),
        "configs": [c.to_json() for c in plan.configs],
        "log": [vars(log) for log in logs],
        "samples": [s.to_json() for s in samples],
    }
    check_resumable(previous, plan)
    kept, kept_logs, earlier = resume_state(previous)
    assert [(s.config, s.step) for s in kept] == [("no-spec", 0)] and [log.step for log in kept_logs] == [0]
    assert [e["error"] for e in earlier] == ["Boom: x"]
    work = pending_work(plan.configs, plan.steps, {("no-spec", 0)})
    assert [(c.name, [s.index for s in steps]) for c, steps in work] == [("no-spec", [1]), (TTS.name, [0, 1])]
    assert pending_work(plan.configs, plan.steps, {(c.name, k) for c in plan.configs for k in (0, 1)}) == []

    other = _plan(tmp_path, [NO_SPEC, TTS], ["/c/another"])
    with pytest.raises(ConfigError, match="other steps"):
        check_resumable(previous, other)
    changed = _plan(tmp_path, [BenchConfig("no-spec", "no-spec", server_args=("--x",)), TTS], ["/c/ckpt1"])
    with pytest.raises(ConfigError, match="no-spec ran with other launch flags"):
        check_resumable(previous, changed)
    with pytest.raises(ConfigError, match="not a rollout"):
        check_resumable({"benchmark": "long"}, plan)


# ----------------------------------------------------------------------------------------------------------
# The runner against a fake SGLang
# ----------------------------------------------------------------------------------------------------------


class _FakeSGLang(BaseHTTPRequestHandler):
    """/generate (0.3 s each; per-round lengths when asked; greedy output depends on the weights),
    /flush_cache and /update_weights_from_disk (refused while `refuse_updates` > 0)."""

    calls: list[tuple[str, dict | None]] = []
    lock = threading.Lock()
    in_flight = 0
    most_in_flight = 0
    version = "default"
    refuse_updates = 0

    def log_message(self, *args) -> None:  # quiet
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):  # noqa: N802 - BaseHTTPRequestHandler's name
        cls = type(self)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        path = self.path.split("?")[0]
        with cls.lock:
            cls.calls.append((path, body))
        if path == "/flush_cache":
            return self._reply(200, {})
        if path == "/update_weights_from_disk":
            if cls.refuse_updates > 0:
                cls.refuse_updates -= 1
                return self._reply(400, {"success": False, "message": "cannot load"})
            cls.version = body["weight_version"]
            return self._reply(200, {"success": True, "message": "updated"})
        with cls.lock:
            cls.in_flight += 1
            cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        time.sleep(0.3)
        with cls.lock:
            cls.in_flight -= 1
        params = body["sampling_params"]
        greedy = params["temperature"] == 0
        seed = params.get("sampling_seed")
        ids = [len(cls.version), 5, 6] if greedy else [9] * 7 if seed is None else [seed % 1000] * 7
        meta = {"completion_tokens": len(ids), "prompt_tokens": 3, "weight_version": cls.version}
        meta["finish_reason"] = {"type": "length"}
        if params["custom_params"].get("tts_return_accept_lengths"):
            meta |= {"tts_accept_lengths": [2, 2, 2], "spec_verify_ct": 3, "tts_num_updates": 1, "tts_update_ms": 5.0}
        return self._reply(200, {"text": "a b c d e f g h", "output_ids": ids, "meta_info": meta})


@pytest.fixture
def fake(monkeypatch):
    """A fake SGLang that every "server start" of the runner gets, on its launch weights again."""
    from sglang_tts.bench import server as server_module

    handler = type("Fake", (_FakeSGLang,), {"calls": [], "lock": threading.Lock(), "version": "default"})
    http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    handler.url = f"http://127.0.0.1:{http.server_address[1]}"
    handler.starts = []

    def start_server(model, extra_args=(), **kwargs):
        handler.version = "default"
        handler.starts.append((model, tuple(extra_args), kwargs["kv_tokens"]))
        handler.calls.append(("start", None))
        return SimpleNamespace(base_url=handler.url, log_tail=lambda n=60: "")

    monkeypatch.setattr(server_module, "start_server", start_server)
    monkeypatch.setattr(server_module, "stop_server", lambda server: handler.calls.append(("stop", None)))
    yield handler
    http.shutdown()
    http.server_close()


def _kinds_of_calls(calls: list[tuple[str, dict | None]]) -> list[str]:
    out = []
    for path, body in calls:
        if path == "/generate":
            custom = body["sampling_params"]["custom_params"]["tts_group"]
            path = custom if custom in ("warmup", "probe") else "s"
        out.append(path)
    return out


def test_steps_run_all_samples_at_once_with_groups_flushes_and_weight_updates(tmp_path, fake):
    result = run_rollout(_plan(tmp_path, [NO_SPEC, TTS], ["/c/ckpt1"]))
    assert result.failures == []
    assert fake.starts == [("m", (), None), ("m", TTS.server_args, None)]
    generates = [body for path, body in fake.calls if path == "/generate"]
    sampled = [b for b in generates if b["sampling_params"]["custom_params"]["tts_group"] not in ("warmup", "probe")]
    # 2 configurations x 2 steps x 2 prompts x 2 samples, each with its group; details only on TTS
    assert len(sampled) == 16 and fake.most_in_flight == 4
    groups = [b["sampling_params"]["custom_params"]["tts_group"] for b in sampled]
    assert sorted(set(groups)) == ["0-p0", "0-p1", "1-p2", "1-p3"] and all(groups.count(g) == 4 for g in set(groups))
    details = [b["sampling_params"]["custom_params"].get("tts_return_accept_lengths") for b in sampled]
    assert details == [None] * 8 + [True] * 8
    # per configuration: start, warm-up, probe, flush, 4 samples | flush (idle), update, probe, flush, 4 samples
    one = ["start", "warmup", "probe", "/flush_cache", *["s"] * 4]
    one += ["/flush_cache", "/update_weights_from_disk", "probe", "/flush_cache", *["s"] * 4, "stop"]
    assert _kinds_of_calls(fake.calls) == one * 2
    probes = [
        b["sampling_params"] for p, b in fake.calls if p == "/generate" and b["sampling_params"]["temperature"] == 0
    ]
    assert len(probes) == 4 and all(p["max_new_tokens"] == 4 for p in probes)
    updates = [b for p, b in fake.calls if p == "/update_weights_from_disk"]
    assert updates == [{"model_path": "/c/ckpt1", "weight_version": "ckpt1"}] * 2

    data = json.loads(result.results.read_text())
    assert [(log["config"], log["step"], log["finished"]) for log in data["log"]] == [
        ("no-spec", 0, True),
        ("no-spec", 1, True),
        (TTS.name, 0, True),
        (TTS.name, 1, True),
    ]
    log1 = data["log"][1]
    assert log1["update"]["success"] and log1["probe"]["weight_version"] == "ckpt1"
    assert log1["probe"]["output_ids"] != data["log"][0]["probe"]["output_ids"]
    assert {(s["step"], s["weight_version"]) for s in data["samples"]} == {(0, "default"), (1, "ckpt1")}
    # all four samples of a step ran side by side: the makespan is near one request's 0.3 s, not four
    assert all(0.3 <= log["makespan_s"] < 1.0 for log in data["log"])
    assert [log["server_start_s"] is not None for log in data["log"]] == [True, False, True, False]
    tts_step = next(s for s in data["aggregates"]["steps"] if s["config"] == TTS.name and s["step"] == 1)
    assert tts_step["counts"]["tokens_per_round"] == 2.0 and tts_step["change_ratio"] == 1.0
    report = result.report.read_text()
    assert "## Policy drift: tokens per round per step" in report and f"| {TTS.name} | 2.00 | 2.00 (1.00x) |" in report
    assert "every configuration wrote the same output at every step" in report
    assert "Every step has its own prompts" in report  # steps 0 and 1 sampled p0-p1 and p2-p3
    assert {Path(p).name for p in result.plots} == {
        "makespan.png",
        "tokens_per_round_by_position.png",
        "tokens_per_round_by_step.png",
    }
    # re-rendered with another bucket, without any server
    again = rerender(result.results, bucket=2)
    assert json.loads(again.results.read_text())["aggregates"]["bucket"] == 2


def test_a_failed_update_stops_that_configuration_and_a_rerun_resumes_there(tmp_path, fake):
    fake.refuse_updates = 1
    first = run_rollout(_plan(tmp_path, [NO_SPEC, TTS], ["/c/ckpt1"]))
    assert first.failures == ["no-spec (step 1)"]
    data = json.loads(first.results.read_text())
    failed = data["log"][1]
    assert failed["error"].startswith("RuntimeError: ") and "HTTP 400" in failed["error"]
    assert [(s["config"], s["step"]) for s in data["samples"]].count(("no-spec", 1)) == 0
    assert [(log["config"], log["step"], log["finished"]) for log in data["log"]][2:] == [
        (TTS.name, 0, True),
        (TTS.name, 1, True),
    ]
    fake.calls.clear()
    second = run_rollout(_plan(tmp_path, [NO_SPEC, TTS], ["/c/ckpt1"]))
    # only no-spec's step 1 ran again: a fresh server on the launch weights, updated first
    one = ["start", "warmup", "/flush_cache", "/update_weights_from_disk", "probe", "/flush_cache", *["s"] * 4, "stop"]
    assert _kinds_of_calls(fake.calls) == one
    sampled = [b for p, b in fake.calls if p == "/generate" and b["sampling_params"]["temperature"] == 1.0]
    assert {b["sampling_params"]["custom_params"]["tts_group"] for b in sampled} - {"warmup"} == {"1-p2", "1-p3"}
    assert second.failures == []
    data = json.loads(second.results.read_text())
    assert len(data["samples"]) == 16 and len(data["sessions"]) == 2
    resumed = [log for log in data["log"] if log["resumed"]]
    assert [(log["config"], log["step"]) for log in resumed] == [("no-spec", 1)]
    assert [e["config"] for e in data["earlier_errors"]] == ["no-spec"]
    assert "(an earlier session, rerun since) no-spec, step 1" in second.report.read_text()


# ----------------------------------------------------------------------------------------------------------
# Drifted copies
# ----------------------------------------------------------------------------------------------------------


def test_drifted_copies_are_a_seeded_random_walk_of_the_weights(tmp_path):
    source = tmp_path / "target"
    source.mkdir()
    state = {"layer.weight": torch.randn(8, 8), "layer.norm.weight": torch.ones(8), "ids": torch.arange(4)}
    save_file(state, str(source / "model.safetensors"))
    (source / "config.json").write_text("{}")
    (source / "tokenizer.json").write_text("{}")
    paths = make_drift_checkpoints(source, tmp_path / "drift", copies=2, scale=0.1, seed=0)
    assert [p.name for p in paths] == ["target-drift1", "target-drift2"]
    one, two = (load_file(str(p / "model.safetensors")) for p in paths)
    assert (paths[0] / "config.json").is_file() and (paths[1] / "tokenizer.json").is_file()
    assert torch.equal(one["layer.norm.weight"], state["layer.norm.weight"]) and torch.equal(one["ids"], state["ids"])
    step1 = (one["layer.weight"] - state["layer.weight"]).std() / state["layer.weight"].std()
    assert 0.05 < step1 < 0.2  # 0.1 x the tensor's std per step
    assert not torch.equal(one["layer.weight"], two["layer.weight"])
    assert (two["layer.weight"] - state["layer.weight"]).std() > (one["layer.weight"] - state["layer.weight"]).std()
    # written once: the same recipe is reused as is, another one rewrites
    stamp = (paths[0] / "model.safetensors").stat().st_mtime_ns
    assert make_drift_checkpoints(source, tmp_path / "drift", copies=2, scale=0.1, seed=0) == paths
    assert (paths[0] / "model.safetensors").stat().st_mtime_ns == stamp
    make_drift_checkpoints(source, tmp_path / "drift", copies=2, scale=0.1, seed=1)
    assert not torch.equal(load_file(str(paths[0] / "model.safetensors"))["layer.weight"], one["layer.weight"])
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        make_drift_checkpoints(tmp_path / "drift", tmp_path / "none", copies=1, scale=0.1)


def test_rerender_refuses_other_json(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"benchmark": "long"}))
    with pytest.raises(ConfigError, match="not a rollout"):
        rerender(tmp_path / "results.json")
    assert rollout.RESULTS == "results.json"


def test_a_prompt_and_answer_longer_than_the_context_are_refused_up_front():
    short = BenchConfig("no-spec", "no-spec", server_args=("--context-length", "100"))
    rollout.check_context([short], "unused-model", longest_prompt=40, max_new_tokens=58)  # 40 + 58 + 2 fits
    with pytest.raises(ConfigError, match="no-spec: the longest prompt \\(40 tokens\\).*need a context of 101"):
        rollout.check_context([short], "unused-model", longest_prompt=40, max_new_tokens=59)


def test_drift_configurations_are_compared_with_the_stale_drafter_on_each_step():
    samples = [
        _sample("eagle3:frozen", 0, [1, 1], 1.0),
        _sample("eagle3:frozen", 1, [1, 1, 1, 1], 1.0),
        _sample("eagle3:tts", 0, [2, 2], 1.0),
        _sample("eagle3:tts", 1, [1, 2], 1.0),
    ]
    logs = [StepLog(c, k, "w", True, 1.0) for c in ("eagle3:frozen", "eagle3:tts") for k in (0, 1)]
    agg = aggregate(samples, logs, ["eagle3:frozen", "eagle3:tts"], bucket=4)
    assert rollout.frozen_reference(["no-spec", "eagle3:frozen", "dflash:frozen"]) == "eagle3:frozen"
    steps = [{"step": 0, "weights": "launch"}, {"step": 1, "weights": "ckpt1"}]
    assert rollout.relative_table(agg, steps, "eagle3:frozen").splitlines()[-1] == "| eagle3:tts | 2.00x | 1.50x |"


def test_the_drift_report_says_whether_the_steps_shared_their_prompts():
    same = [{"step": k, "prompt_ids": ["a", "b"]} for k in range(3)]
    assert steps_share_prompts(same)
    assert not steps_share_prompts([*same[:2], {"step": 2, "prompt_ids": ["c", "d"]}])
    assert not steps_share_prompts(same[:1])  # one step: nothing to compare


def test_a_sampling_seed_gives_every_sample_its_own_seed_the_same_in_every_configuration(tmp_path, fake):
    result = run_rollout(_plan(tmp_path, [NO_SPEC, TTS], None, seed=3))
    assert result.failures == []
    sampled = [
        (b["sampling_params"]["custom_params"]["tts_group"], b["sampling_params"].get("sampling_seed"))
        for path, b in fake.calls
        if path == "/generate" and b["sampling_params"]["custom_params"]["tts_group"] not in ("warmup", "probe")
    ]
    # 2 configurations x 2 steps x 2 prompts x 2 samples; each configuration sends the same 8 seeds
    assert len(sampled) == 16 and all(seed is not None for _, seed in sampled)
    first, second = sorted(sampled[:8]), sorted(sampled[8:])
    assert first == second and len({seed for _, seed in first}) == 8  # siblings differ, configurations agree
    expected = SamplingSettings(temperature=1.0, seed=3).request_seed(sample_id(1, _prompts(4)[3], 1))
    assert ("1-p3", expected) in first
    data = json.loads(result.results.read_text())
    assert data["identity"]["sampling"]["seed"] == 3
    assert {s["output_digest"] for s in data["samples"] if s["config"] == "no-spec"} == {
        s["output_digest"] for s in data["samples"] if s["config"] == TTS.name
    }
    report = result.report.read_text()
    assert "every configuration wrote the same text for each of the 8 samples they share" in report
    # a resumed run must keep the seed: another one is another run
    previous = json.loads(result.results.read_text())
    with pytest.raises(ConfigError):
        check_resumable(previous, _plan(tmp_path, [NO_SPEC, TTS], None, seed=4))


def test_sample_agreement_names_the_samples_that_differ_and_says_nothing_unseeded():
    def sample(config: str, j: int, digest: str) -> Sample:
        record = RequestRecord(config, "d", "p0", 0, 8, 1.0, output_digest=digest)
        return Sample(record, 0, j, "0-p0", "launch")

    same = [sample("a", 0, "x"), sample("b", 0, "x"), sample("a", 1, "y"), sample("b", 1, "y")]
    assert "same text for each of the 2 samples" in sample_agreement(same, 0)[0]
    differ = [*same[:2], sample("a", 1, "y"), sample("b", 1, "z"), sample("a", 2, "w")]  # 0-p0/2: one config only
    (line,) = sample_agreement(differ, 0)
    assert "1 of 2 samples differ between configurations (0-p0/1)" in line
    assert sample_agreement(differ, "none") == [] and sample_agreement(differ, None) == []
