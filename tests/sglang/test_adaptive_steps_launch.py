"""Launch-time checks of `--tts-controller` (sglang_tts/sglang/adaptive_steps.py), in process."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sglang_tts.control import Action, ControllerConfig, feature_names, make_policy, save_policy
from sglang_tts.drafters.checkpoints import write_tiny_dflash, write_tiny_eagle3
from sglang_tts.sglang.adaptive_steps import _AsBuiltin, adaptive_reason_hook
from sglang_tts.sglang.algorithm import TTSLaunchError, validate_server_args
from sglang_tts.sglang.flags import ENV_VAR

ACTIONS = [Action(1, 1), Action(3, 4)]


@pytest.fixture
def eagle3(tiny_llama, tmp_path):
    return write_tiny_eagle3(tmp_path / "e3", json.loads((tiny_llama / "config.json").read_text()))


@pytest.fixture
def policy_file(tmp_path):
    policy = make_policy("linucb", ACTIONS, len(feature_names(3)))
    return save_policy(tmp_path / "policy.json", policy, ControllerConfig(persistence=4, explore=False))


def _args(tiny_llama, drafter, **extra):
    return SimpleNamespace(speculative_draft_model_path=str(drafter), model_path=str(tiny_llama), **extra)


def _with_controller(monkeypatch, path):
    monkeypatch.setenv(ENV_VAR, json.dumps({"controller": str(path)}))


def test_a_good_policy_turns_on_sglangs_adaptive_steps(tiny_llama, eagle3, policy_file, monkeypatch):
    _with_controller(monkeypatch, policy_file)
    args = _args(tiny_llama, eagle3, speculative_num_steps=3, speculative_eagle_topk=None)
    validate_server_args(args)
    assert args.speculative_adaptive is True
    assert args.speculative_eagle_topk == 1 and args.speculative_num_draft_tokens == 4
    adaptive = json.loads(open(args.speculative_adaptive_config).read())
    assert adaptive == {"1": {"candidate_steps": [1, 3]}}


def test_no_controller_leaves_the_args_alone(tiny_llama, eagle3, monkeypatch):
    monkeypatch.setenv(ENV_VAR, json.dumps({"controller": None}))
    args = _args(tiny_llama, eagle3)
    validate_server_args(args)
    assert not hasattr(args, "speculative_adaptive")


def test_a_corrupt_policy_file_is_refused_at_launch(tiny_llama, eagle3, policy_file, monkeypatch):
    policy_file.write_text(policy_file.read_text()[:150])
    _with_controller(monkeypatch, policy_file)
    with pytest.raises(TTSLaunchError, match="--tts-controller: .*policy.json is not valid JSON"):
        validate_server_args(_args(tiny_llama, eagle3))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"speculative_num_steps": 2}, r"--speculative-num-steps 2 is not a chain length .* pass one of \[1, 3\]"),
        ({"speculative_num_steps": 3, "speculative_num_draft_tokens": 8}, "must be steps \\+ 1 = 4"),
        ({"speculative_eagle_topk": 4}, "--speculative-eagle-topk 1"),
        ({"dp_size": 2}, "single rank"),  # tp/pp > 1 are refused for every TTS launch (test_algorithm.py)
        ({"speculative_adaptive_config": "x.json"}, "drop --speculative-adaptive-config"),
    ],
)
def test_a_policy_that_does_not_fit_the_launch_is_refused(tiny_llama, eagle3, policy_file, monkeypatch, extra, message):
    _with_controller(monkeypatch, policy_file)
    with pytest.raises(TTSLaunchError, match=message):
        validate_server_args(_args(tiny_llama, eagle3, **extra))


def test_a_dflash_drafter_is_refused(tiny_llama, tmp_path, policy_file, monkeypatch):
    drafter = write_tiny_dflash(tmp_path / "df", json.loads((tiny_llama / "config.json").read_text()))
    _with_controller(monkeypatch, policy_file)
    with pytest.raises(TTSLaunchError, match="needs an EAGLE-3 drafter"):
        validate_server_args(_args(tiny_llama, drafter))


def test_sglangs_adaptive_check_sees_tts_as_eagle3(tiny_llama, eagle3):
    from sglang.srt.speculative.adaptive_spec_params import adaptive_unsupported_reason

    args = SimpleNamespace(
        speculative_algorithm="TTS",
        _resolved_overrides=[("x", {"speculative_algorithm": "TTS", "speculative_eagle_topk": 1})],
        speculative_eagle_topk=1,
        enable_two_batch_overlap=False,
        enable_pdmux=False,
    )
    view = _AsBuiltin(args, "EAGLE3")
    assert view.speculative_algorithm == "EAGLE3"
    assert view._resolved_overrides == [("x", {"speculative_eagle_topk": 1})]
    assert "only EAGLE/EAGLE3" in adaptive_unsupported_reason(args)


def test_controller_flags(monkeypatch):
    import argparse

    from sglang_tts.sglang.flags import add_tts_cli_args, tts_config_from_env

    monkeypatch.delenv(ENV_VAR, raising=False)
    parser = argparse.ArgumentParser()
    add_tts_cli_args(parser)
    parser.parse_args(["--tts-controller", "p.json", "--tts-controller-learn", "--tts-controller-trace", "t.jsonl"])
    config = tts_config_from_env()
    assert (config.controller, config.controller_learn, config.controller_trace) == ("p.json", True, "t.jsonl")
    parser.parse_args(["--tts-controller", "none"])
    assert tts_config_from_env().controller is None


def test_the_adaptive_reason_hook_answers_for_tts_as_for_its_builtin():
    from sglang.srt.speculative.adaptive_spec_params import adaptive_unsupported_reason

    def args(name, topk=1):
        return SimpleNamespace(speculative_algorithm=name, _resolved_overrides=[], speculative_eagle_topk=topk)

    hook = adaptive_reason_hook("TTS", lambda: "EAGLE3")
    seen = []
    hook(lambda server_args: seen.append(server_args.speculative_algorithm), args("TTS"))
    hook(lambda server_args: seen.append(server_args.speculative_algorithm), args("NGRAM"))
    assert seen == ["EAGLE3", "NGRAM"]  # other algorithms pass through untouched
    assert "only EAGLE/EAGLE3" in adaptive_unsupported_reason(args("TTS", topk=2))
    # Through the hook TTS passes the name check, and SGLang's other conditions still apply.
    assert "only topk=1" in hook(adaptive_unsupported_reason, args("TTS", topk=2))


def test_a_policy_that_chooses_the_proposer_needs_the_hybrid(tiny_llama, eagle3, tmp_path, monkeypatch):
    from sglang_tts.control import action_grid

    actions = action_grid([1, 3], [4], ["drafter", "suffix"])
    policy = make_policy("linucb", actions, len(feature_names(3, suffix=True)))
    path = save_policy(tmp_path / "proposer.json", policy, ControllerConfig(persistence=4, explore=False))
    _with_controller(monkeypatch, path)
    with pytest.raises(TTSLaunchError, match="chooses the proposer .* needs --tts-hybrid on"):
        validate_server_args(_args(tiny_llama, eagle3, speculative_num_steps=3))
    monkeypatch.setenv(ENV_VAR, json.dumps({"controller": str(path), "hybrid": True}))
    args = _args(tiny_llama, eagle3, speculative_num_steps=3)
    validate_server_args(args)
    assert args.speculative_adaptive is True and args.speculative_eagle_topk == 1
