"""Adaptation scopes: who owns the adapted drafter, and when it goes back to its base weights.

A scope is an explicit object the worker consults before each draft with the ids of the requests
in the batch. `BatchScope` is the paper's per-request reset for one shared drafter: it adapts on the
requests that contribute canvases and resets once none of them is running any more (at batch size
1: at the end of each request; at batch size > 1 when every request it adapted on has left).
`GlobalScope` never resets. Scope "request" (per-request adapters, core/adapters.py) never resets
the shared drafter either -- each request's own adapter is freed when the request leaves -- so it
uses `GlobalScope` for the shared part.
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


class BatchScope(AdaptationScope):
    name = "batch"

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
    if name == "batch":
        return BatchScope()
    if name in ("global", "request"):  # "request": the shared weights never change (adapters do)
        return GlobalScope()
    raise ValueError(f"unknown TTS scope {name!r} (batch | request | global)")
