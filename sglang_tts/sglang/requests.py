"""What a request asks of TTS, and the request checks SGLang lacks.

A request's TTS options travel in `sampling_params.custom_params` (SGLang's per-request channel,
shared with custom logit processors, whose keys TTS leaves alone). They are parsed once per
request, when TTS first sees it, and kept on SGLang's `Req` object, so they end with the request.
Anything TTS does not understand (a `custom_params` that is not an object, an unknown `tts_*` key,
a value that is not true/false, a debug option the server does not allow) is ignored with one
warning for that request: never an error, never a log line per round.

`reject_empty_prompt_hook` answers an empty prompt with a 400 naming the problem. SGLang 0.5.23
refuses empty `input_ids` but not a text that tokenizes to nothing (`"text": ""`), whose
0-token prefill kills the scheduler, with or without speculation.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

ACCEPT_LENGTHS_KEY = "tts_return_accept_lengths"
WEIGHT_DIGEST_KEY = "tts_return_weight_digest"
GROUP_KEY = "tts_group"  # --tts-scope group: requests with the same id share one adapter
MAX_GROUP_ID = 256  # characters of a client's group id that count
DIGEST_NOT_ALLOWED = f"{WEIGHT_DIGEST_KEY} needs a server launched with --tts-allow-weight-digest"
_ATTR = "_sglang_tts_options"


@dataclass(frozen=True)
class RequestOptions:
    # the accepted length of every verify round in meta_info (cheap: one int per round)
    accept_lengths: bool = False
    # sha256 of the serving drafter at the first and last round: hashes the whole drafter whenever
    # its weights change, so only a server launched with --tts-allow-weight-digest honours it
    weight_digest: bool = False
    # a client-given group (a string or an integer): with --tts-scope group, requests that give the
    # same one share an adapter; without it, requests of the same prompt do (group_key)
    group: str | None = None


_KEYS = {ACCEPT_LENGTHS_KEY: "accept_lengths", WEIGHT_DIGEST_KEY: "weight_digest"}


def parse_custom_params(custom: Any, allow_weight_digest: bool) -> tuple[RequestOptions, list[str]]:
    """The TTS options in a request's custom_params, and what was ignored (one phrase each)."""
    if custom is None:
        return RequestOptions(), []
    if not isinstance(custom, dict):
        return RequestOptions(), [f"custom_params is a {type(custom).__name__}, not an object"]
    values: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in custom.items():
        if not (isinstance(key, str) and key.startswith("tts_")):
            continue  # another consumer's key (e.g. a custom logit processor)
        if key == GROUP_KEY:
            if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value):
                values["group"] = str(value)[:MAX_GROUP_ID]
            else:
                problems.append(f"{GROUP_KEY} must be a non-empty string or an integer, got {value!r}")
            continue
        field = _KEYS.get(key)
        if field is None:
            problems.append(f"unknown option {key!r}")
        elif not isinstance(value, bool):
            problems.append(f"{key} must be true or false, got {value!r}")
        else:
            values[field] = value
    if values.get("weight_digest") and not allow_weight_digest:
        problems.append(DIGEST_NOT_ALLOWED)
        values["weight_digest"] = False
    return RequestOptions(**values), problems


def request_options(req: Req, allow_weight_digest: bool = False) -> RequestOptions:
    """The request's TTS options, parsed (and any problem warned about) on first use only."""
    cached = getattr(req, _ATTR, None)
    if cached is not None:
        return cached
    custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    options, problems = parse_custom_params(custom, allow_weight_digest)
    if problems:
        logger.warning(
            "sglang-tts: request %s: ignored in custom_params: %s", getattr(req, "rid", "?"), "; ".join(problems)
        )
    try:
        setattr(req, _ATTR, options)
    except AttributeError:  # an object that takes no attributes: parse again next time, warn again
        pass
    return options


def group_key(req: Req, allow_weight_digest: bool = False) -> str:
    """The adapter group of a request (--tts-scope group): the client's `tts_group` if it gave one,
    else its prompt (a digest of the prompt's token ids: the n samples of one prompt, or the same
    prompt sent again). Computed once per request, when it first asks for an adapter slot."""
    group = request_options(req, allow_weight_digest).group
    if group is not None:
        return "id:" + group
    ids = getattr(req, "origin_input_ids", None) or []
    return "prompt:" + hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).hexdigest()


def _has_session(obj: GenerateReqInput) -> bool:
    session = getattr(obj, "session_params", None)
    return isinstance(session, dict) and bool(session.get("id"))


def reject_empty_prompt_hook(
    original, manager: TokenizerManager, obj: GenerateReqInput, input_ids: list[int] | None, *args, **kwargs
):
    """AROUND hook on TokenizerManager._validate_one_request (run after tokenisation and any
    multimodal processing, so `input_ids` is the final prompt). A ValueError there is SGLang's own
    way to answer 400 with the message. Session requests are left to the scheduler, which may
    prepend the session's history."""
    if input_ids is not None and len(input_ids) == 0 and not _has_session(obj):
        raise ValueError("The prompt is empty: it must contain at least one token (text or input_ids).")
    return original(manager, obj, input_ids, *args, **kwargs)


def register_hooks(registry, hook_type) -> None:
    registry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        reject_empty_prompt_hook,
        hook_type.AROUND,
    )
