"""Sustained paid overload: paid work arriving as fast as the engine can serve anything (issue 18: free work is
shed first, QoServe 3.4).

Free work already yields to a paid job its prompt would make late, and to every waiting paid job for one target
after a paid job is lost (``relegation.free_yields_until``). Both read the queue. Under sustained overload the
paid jobs that will be lost have not arrived yet: a free job that runs while the batch deadlines still absorb the
backlog takes capacity they will lack (conv at 1.5x QoServe's goodput, 20% free: 1,246 free jobs on time while
paid jobs that had waited longer ended late). This signal reads the arrival rate instead. Over a window as long
as the longest paid target, it compares the paid work arriving (prompt plus the app's mean output, tokens per
second) with the engine's own rate when saturated (tokens per second of the steps that left prompts waiting: the
most it carries under the SLOs' chunk budgets; a step of a lightly loaded engine says nothing about capacity).
At or above 1 the paid jobs alone need the whole engine. A burst shorter than the window averages out below it,
and free work keeps running through it. No saturated step in the window: no overload.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class PaidOverload:
    on_at: float = 1.0  # paid demand / engine rate at which free work starts yielding to every waiting paid job
    off_at: float = 0.9  # ... and below which it stops (hysteresis)
    warmup: float = 0.1  # share of the window that must have passed since the first paid arrival
    overloaded: bool = False
    window_s: float = 0.0  # the longest paid target seen (set by the scheduler)
    _paid: deque[tuple[float, float]] = field(default_factory=deque)  # (arrival, tokens of paid work)
    _paid_tokens: float = 0.0
    _steps: deque[tuple[float, float, int]] = field(default_factory=deque)  # (end, seconds, tokens) of steps
    _step_s: float = 0.0
    _step_tokens: int = 0
    _first: float | None = None
    _last_start: float | None = None
    _last_tokens: int = 0  # tokens of the step begun at _last_start, if it left prompts waiting (else 0)

    def paid_arrived(self, t: float, tokens: float, target_s: float) -> None:
        """A paid job of ``tokens`` (prompt + expected output) arrived at ``t`` with first target ``target_s``."""
        self.window_s = max(self.window_s, target_s)
        self._first = t if self._first is None else min(self._first, t)
        self._paid.append((t, tokens))
        self._paid_tokens += tokens

    def step_began(self, now: float, tokens: int, saturated: bool) -> None:
        """A step carrying ``tokens`` starts at ``now`` (``saturated``: it left prompts waiting); the previous
        one, if saturated, took until now."""
        if self._last_start is not None and self._last_tokens > 0 and now > self._last_start:
            self._steps.append((now, now - self._last_start, self._last_tokens))
            self._step_s += now - self._last_start
            self._step_tokens += self._last_tokens
        self._last_start, self._last_tokens = now, tokens if saturated else 0

    def ratio(self, now: float) -> float:
        """Paid tokens arriving per second over the saturated engine's tokens per second, over the window."""
        start = now - self.window_s
        while self._paid and self._paid[0][0] < start:
            self._paid_tokens -= self._paid.popleft()[1]
        while self._steps and self._steps[0][0] < start:
            _, s, n = self._steps.popleft()
            self._step_s -= s
            self._step_tokens -= n
        if self._first is None or self._step_s <= 0 or self._step_tokens <= 0:
            return 0.0
        span = min(self.window_s, now - self._first)
        if span < self.warmup * self.window_s:
            return 0.0
        return (self._paid_tokens / span) / (self._step_tokens / self._step_s)

    def update(self, now: float) -> bool:
        """Re-reads the ratio; returns whether paid work alone overloads the engine (with hysteresis)."""
        r = self.ratio(now)
        if not self.overloaded and r >= self.on_at:
            self.overloaded = True
        elif self.overloaded and r < self.off_at:
            self.overloaded = False
        return self.overloaded
