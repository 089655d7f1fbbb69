"""Adaptation scopes: who owns the adapted drafter, and when it goes back to its base weights.

A scope is an explicit object the worker consults before each draft with the ids of the requests
in the batch. `BatchScope` is the paper's per-request reset for one shared drafter, made to hold
under continuous batching, where requests overlap forever: it works in generations. A generation
is the set of requests running when it begins; requests that arrive later belong to the next one.
Once every request of the current generation has finished, the drafter resets to base (if it
was adapted since the last reset) and the requests running then form the next generation. At
batch size 1 that is a reset at the end of each request; under rolling traffic the drafter is
reset at least once per lifetime of the longest request of a generation, however the requests
overlap. A request that arrived after a generation began may see one reset while it runs.
`GlobalScope` never resets. Scopes "request" and "group" (per-request / per-group adapters,
core/adapters.py) never reset the shared drafter either -- each request's (group's) own adapter is
freed when the request (the group's last request) leaves -- so they use `GlobalScope` for the
shared part.
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
        # The current generation's requests that are still running (bounded by the batch size).
        self.generation: set[str] = set()
        self.adapted = False  # a canvas went to the update since the last reset

    def before_round(self, live_request_ids: Iterable[str]) -> bool:
        live = set(live_request_ids)
        self.generation &= live  # finished, aborted or retracted requests leave their generation
        if self.generation:
            return False
        reset, self.adapted = self.adapted, False
        self.generation = live  # the next generation: everything running now
        return reset

    def contributed(self, request_ids: Iterable[str]) -> None:
        self.adapted = True


def make_scope(name: str) -> AdaptationScope:
    if name == "batch":
        return BatchScope()
    if name in ("global", "request", "group"):  # request / group: the shared weights never change (adapters do)
        return GlobalScope()
    raise ValueError(f"unknown TTS scope {name!r} (batch | request | group | global)")
