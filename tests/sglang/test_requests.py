"""A request's TTS options: parsed once, anything not understood ignored with one warning."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from sglang_tts.sglang.requests import (
    DIGEST_NOT_ALLOWED,
    RequestOptions,
    group_key,
    parse_custom_params,
    reject_empty_prompt_hook,
    request_options,
)


def _req(custom, rid="r1"):
    return SimpleNamespace(rid=rid, sampling_params=SimpleNamespace(custom_params=custom))


def test_known_options_are_read_and_other_consumers_keys_left_alone():
    options, problems = parse_custom_params(
        {"tts_return_accept_lengths": True, "my_logit_processor_arg": [1, 2]}, allow_weight_digest=False
    )
    assert options == RequestOptions(accept_lengths=True)
    assert problems == []


@pytest.mark.parametrize(
    "custom, problem",
    [
        (["x"], "custom_params is a list"),
        ("tts_return_accept_lengths", "custom_params is a str"),
        ({"tts_return_accept_lengths": "yes"}, "must be true or false, got 'yes'"),
        ({"tts_return_accept_lengths": 1}, "must be true or false, got 1"),
        ({"tts_typo": True}, "unknown option 'tts_typo'"),
        ({"tts_group": ""}, "tts_group must be a non-empty string or an integer"),
        ({"tts_group": [1]}, "tts_group must be a non-empty string or an integer"),
        ({"tts_group": True}, "tts_group must be a non-empty string or an integer"),
    ],
)
def test_what_tts_does_not_understand_is_ignored_and_named(custom, problem):
    options, problems = parse_custom_params(custom, allow_weight_digest=True)
    assert options == RequestOptions()
    assert len(problems) == 1 and problem in problems[0]


def test_the_group_is_the_clients_id_or_else_the_prompt():
    assert parse_custom_params({"tts_group": 7}, allow_weight_digest=False) == (RequestOptions(group="7"), [])

    def req(ids, custom=None, rid="r"):
        return SimpleNamespace(rid=rid, origin_input_ids=ids, sampling_params=SimpleNamespace(custom_params=custom))

    siblings = [group_key(req([4, 5, 6], rid=f"s{i}")) for i in range(3)]
    assert len(set(siblings)) == 1
    assert group_key(req([4, 5, 7])) != siblings[0]
    assert group_key(req([4, 5, 6, 0])) != siblings[0]
    given = group_key(req([1, 2], {"tts_group": "step3/q12"}))
    assert given == group_key(req([9], {"tts_group": "step3/q12"})) != group_key(req([1, 2]))


def test_the_weight_digest_needs_the_server_flag():
    asked = {"tts_return_weight_digest": True}
    assert parse_custom_params(asked, allow_weight_digest=True) == (RequestOptions(weight_digest=True), [])
    options, problems = parse_custom_params(asked, allow_weight_digest=False)
    assert options == RequestOptions() and problems == [DIGEST_NOT_ALLOWED]


def test_options_are_parsed_once_per_request_with_one_warning(caplog):
    req = _req(["x"])
    with caplog.at_level(logging.WARNING, logger="sglang_tts.sglang.requests"):
        for _ in range(50):  # one call per round
            assert request_options(req) == RequestOptions()
    warnings = [r for r in caplog.records if "ignored in custom_params" in r.getMessage()]
    assert len(warnings) == 1 and "r1" in warnings[0].getMessage()
    assert request_options(_req(None)) == RequestOptions()


def test_an_empty_prompt_is_a_value_error_naming_it():
    calls = []

    def original(manager, obj, input_ids):
        calls.append(input_ids)

    obj = SimpleNamespace(session_params=None)
    with pytest.raises(ValueError, match="prompt is empty"):
        reject_empty_prompt_hook(original, None, obj, [])
    reject_empty_prompt_hook(original, None, obj, [5])
    reject_empty_prompt_hook(original, None, obj, None)  # input_embeds requests carry no ids
    # a session may supply the whole prompt from its history: the scheduler decides
    reject_empty_prompt_hook(original, None, SimpleNamespace(session_params={"id": "s"}), [])
    assert calls == [[5], None, []]
