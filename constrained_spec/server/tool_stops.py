"""Stop strings of a tool-call plan with an envelope (server/tools.py): matched against what the client
sees, a call's arguments or a text answer, never the envelope. The engine gets none of them
(`engine_params`); `VisibleStops` watches each choice's visible text as the engine's updates come
and ends the choice at the first one."""
from __future__ import annotations

import dataclasses

from ..engine.request import FinishReason
from .tools import ToolCallPlan


class VisibleStops:
    """A `Generation` of an envelope plan with stop strings (the engine has none: `engine_params`),
    as a route iterates it: a choice whose visible text (its `ToolCallStream`'s) reaches a stop
    string ends at that update, its engine request aborted; the update comes as the choice's last
    (finished, `stop`, `matched_stop` the string, the tokens made so far), and what the engine sent
    for it after is dropped. The route's message or stream cuts the text at the same place."""

    def __init__(self, gen, plan: ToolCallPlan, n: int):
        self.gen = gen
        self._seen = [plan.stream() for _ in range(n)]
        self._ended = [False] * n

    async def first(self):
        return await self.gen.first()

    def abort(self) -> None:
        self.gen.abort()

    async def __aiter__(self):
        async for i, out in self.gen:
            out = self._see(i, out)
            if out is not None:
                yield i, out

    async def batches(self):
        async for items in self.gen.batches():
            seen = [(i, out) for i, out in ((i, self._see(i, out)) for i, out in items) if out is not None]
            if seen:
                yield seen

    def _see(self, i: int, out):
        if self._ended[i]:
            return None
        if out.finished:  # (the route's message or stream cuts a stop string in its text)
            self._ended[i] = True
            return out
        seen = self._seen[i]
        seen.update(out.new_text)
        if seen.stopped is None:
            return out
        self._ended[i] = True
        self.gen.end_choice(i)  # its end is this update
        return dataclasses.replace(out, finished=True, finish_reason=FinishReason.STOP, matched_stop=seen.stopped)


def engine_params(plan: ToolCallPlan | None, params_list: list) -> list:
    """The sampling parameters the engine gets: without the request's stop strings where the plan
    matches them against the visible text (an envelope's)."""
    if plan is None or not plan.stop:
        return params_list
    return [dataclasses.replace(p, stop=[]) for p in params_list]


def watch_stops(gen, plan: ToolCallPlan | None, n: int):
    """`gen` as the route iterates it: through `VisibleStops` where the plan matches stop strings."""
    return VisibleStops(gen, plan, n) if plan is not None and plan.stop else gen
