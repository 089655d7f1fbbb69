"""Adaptation scopes: who owns the adapted drafter, and when it goes back to its base weights.

A scope is an explicit object the worker consults before each draft with the ids of the requests
in the batch. `RequestScope` is the paper's per-request reset: the drafter adapts on the requests
that contribute canvases and resets once none of them is running any more (at batch size 1: at
the end of each request; at batch size > 1 the shared drafter resets when every request it adapted
on has left). `GlobalScope` never resets. Per-request adapters (one state per request) would be a
third scope that owns one state per id; the worker does not need to change for it.
"""

from __future__ import annotations

from collections.abc import Iterable


class AdaptationScope:
    name = "abstract"

    def before_round(self, live_request_ids: Iterable[str]) -> bool:
        """Called before each draft; returns True when the drafter must reset to base now."""
        raise NotImplementedError

    def contributed(self, request_ids: Iterable[str]) -> None:
        """These requests' canvases were handed to the update."""


class GlobalScope(AdaptationScope):
    name = "global"

    def before_round(self, live_request_ids: Iterable[str]) -> bool:
        return False


class RequestScope(AdaptationScope):
    name = "request"

    def __init__(self) -> None:
        self.owners: set[str] = set()

    def before_round(self, live_request_ids: Iterable[str]) -> bool:
        if not self.owners:
            return False
        if self.owners.isdisjoint(set(live_request_ids)):
            self.owners.clear()
            return True
        return False

    def contributed(self, request_ids: Iterable[str]) -> None:
        self.owners.update(request_ids)


def make_scope(name: str) -> AdaptationScope:
    if name == "request":
        return RequestScope()
    if name == "global":
        return GlobalScope()
    raise ValueError(f"unknown TTS scope {name!r} (request | global)")
