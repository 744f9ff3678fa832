"""Per-tenant rate limits: requests and tokens per minute, as OpenAI's API applies them.

A tenant may have a limit on requests per minute and on tokens per minute (null: none). Each is
a token bucket in Redis, shared by every API process: it holds up to the limit and refills at the
limit per 60 s, so a tenant can burst up to its minute's worth and then goes at its rate. A request
costs one request and its prompt tokens plus ``max_tokens`` (OpenAI counts the tokens a request may
use, not the ones it will). Both buckets are checked and taken together in one Lua script, so
concurrent API processes never overdraw them. A refusal is a 429 that says which limit, how much
is left and when the bucket holds enough again (``retry-after``, which the official client waits
for before its retry), with OpenAI's ``x-ratelimit-*`` headers.

A tenant's requests per minute fill three buckets: its generation requests' (the chat, completions, Responses,
Messages and ``/v1/jobs`` routes, and batch creates and summarization starts, which cost a request and no tokens)
and, apart, its token-counting requests' (``COUNTING``: Anthropic limits count_tokens apart from messages, so a
client that counts before each message does not halve what it may send; the count routes tokenize on the API
process's CPU, so they are not free either), and its Message Batches calls, the create's too (``MESSAGE_BATCHES``:
Anthropic limits every batch endpoint by requests per minute apart from messages, so a client polling its batch
does not halve what it may send). A refusal is counted under its buckets' name (``refusal_prefix``).

Redis down: the request goes through (a limit is a guard against a noisy tenant, not a reason to
stop serving); the API logs it once a minute at most.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone

import redis

log = logging.getLogger(__name__)

KEY_PREFIX = "coserve:ratelimit:"
REFUSALS = "coserve:ratelimit:refused"  # hash "<tenant id>|<limit>" -> requests refused (GET /metrics, its label)
WINDOW_S = 60.0  # a limit is per minute: a bucket refills its whole capacity in this time
GENERATION = ""  # the buckets a charge takes from: the tenant's generation requests' (and their tokens)
COUNTING = "counting:"  # its token-counting requests' (count_tokens, input_tokens, /tokenize), by the same RPM
MESSAGE_BATCHES = "message_batches:"  # its Message Batches calls (create, retrieve, list, results, cancel,
# delete), by the same RPM: Anthropic limits every batch endpoint apart from Messages, so polling eats no sends


def refusal_prefix(buckets: str) -> str:
    """What comes before ``requests`` or ``tokens`` in the ``limit`` label a refusal from ``buckets`` counts under in
    ``/metrics``: nothing for the generation requests', the buckets' name for the others' (``counting_requests``),
    so an operator tells a tenant hammering /tokenize from one hammering chat."""
    return buckets.replace(":", "_")


# Several requests' charges in one call, each judged after the ones before it. KEYS: per charge its request
# bucket and its token bucket, then the refusal counts. ARGV: now ("": Redis's time), window, then per charge:
# request capacity (-1: no limit), requests, token capacity, tokens, and what its refusal counts under before the
# limit's name ("<tenant id>|" and its buckets' ``refusal_prefix``). Each bucket is a hash {used, at}: what the
# tenant took, draining capacity / window per second; its level is capacity - used. Kept as used, not as level, so
# a limit an operator changes mid-minute counts what the tenant took against the new one (raised: the rest of it at
# once; lowered: at most a minute's wait). A charge takes both costs only when both fit.
# Answers per charge: 1/0, then per bucket the level after and the seconds until its cost would fit (0: it fits).
_TAKE = """
local now, window = tonumber(ARGV[1]), tonumber(ARGV[2])
if now == nil then  -- Redis's clock: every API host's charges measured on one (hosts' clocks drift apart)
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local refusals = KEYS[#KEYS]
local out = {}
for c = 0, (#KEYS - 1) / 2 - 1 do
  local base = 3 + 5 * c
  local caps = {tonumber(ARGV[base]), tonumber(ARGV[base + 2])}
  local costs = {tonumber(ARGV[base + 1]), tonumber(ARGV[base + 3])}
  local levels, waits, ok = {-1, -1}, {0, 0}, true
  for i = 1, 2 do
    if caps[i] >= 0 then
      local state = redis.call('HMGET', KEYS[2 * c + i], 'used', 'at')
      local used, at = tonumber(state[1]), tonumber(state[2])
      if used == nil then used, at = 0, now end
      levels[i] = caps[i] - math.max(0, math.min(caps[i], used) - math.max(0, now - at) * caps[i] / window)
      if costs[i] > levels[i] then
        ok = false
        waits[i] = (costs[i] - levels[i]) * window / caps[i]
      end
    end
  end
  if ok then
    for i = 1, 2 do
      if caps[i] >= 0 then
        levels[i] = levels[i] - costs[i]
        redis.call('HSET', KEYS[2 * c + i], 'used', tostring(caps[i] - levels[i]), 'at', tostring(now))
        redis.call('EXPIRE', KEYS[2 * c + i], math.ceil(window * 2))
      end
    end
  else
    local too_large = caps[2] >= 0 and costs[2] > caps[2]  -- as Decision.limit_hit names it
    local limit = (too_large or waits[2] > waits[1]) and 'tokens' or 'requests'
    redis.call('HINCRBY', refusals, ARGV[base + 4] .. limit, 1)
  end
  table.insert(out, ok and 1 or 0)
  for i = 1, 2 do
    table.insert(out, tostring(levels[i]))
    table.insert(out, tostring(waits[i]))
  end
end
return out
"""

# Charges given back (``RateLimiter.give_back``): KEYS, per charge its request bucket and its token bucket; ARGV: now
# ("": Redis's time), window, then per charge: request capacity (-1: no limit), requests, token capacity, tokens.
# Each bucket drains to now as ``_TAKE`` reads it, then what the charge took leaves it (never below empty).
_GIVE_BACK = """
local now, window = tonumber(ARGV[1]), tonumber(ARGV[2])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
for c = 0, #KEYS / 2 - 1 do
  local base = 3 + 4 * c
  local caps = {tonumber(ARGV[base]), tonumber(ARGV[base + 2])}
  local costs = {tonumber(ARGV[base + 1]), tonumber(ARGV[base + 3])}
  for i = 1, 2 do
    local state = redis.call('HMGET', KEYS[2 * c + i], 'used', 'at')
    local used, at = tonumber(state[1]), tonumber(state[2])
    if caps[i] >= 0 and costs[i] > 0 and used ~= nil then
      used = math.max(0, math.min(caps[i], used) - math.max(0, now - at) * caps[i] / window)
      redis.call('HSET', KEYS[2 * c + i], 'used', tostring(math.max(0, used - costs[i])), 'at', tostring(now))
    end
  end
end
return #KEYS / 2
"""


@dataclass(frozen=True)
class Limits:
    """A tenant's limits (None: no limit)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    @property
    def any(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


@dataclass(frozen=True)
class Decision:
    """What the buckets said of one request."""

    allowed: bool
    limits: Limits
    requests_left: float | None = None  # after this request where allowed, else now
    tokens_left: float | None = None
    requests_wait_s: float = 0.0  # until the request bucket holds its cost (0: it does)
    tokens_wait_s: float = 0.0
    tokens_asked: int = 0

    @property
    def limit_hit(self) -> str:
        """Which limit refused it: ``tokens`` or ``requests`` (OpenAI's error type)."""
        return "tokens" if self.too_large or self.tokens_wait_s > self.requests_wait_s else "requests"

    @property
    def retry_after_s(self) -> float:
        return max(self.requests_wait_s, self.tokens_wait_s)

    @property
    def too_large(self) -> bool:
        """The request costs more tokens than the bucket can ever hold: waiting will not help."""
        tpm = self.limits.tokens_per_minute
        return tpm is not None and self.tokens_asked > tpm

    def message(self, cost_fields: str = "max_tokens") -> str:
        """Why it was refused; ``cost_fields``: the request's fields that set the tokens it may use, besides its
        prompt, as its route writes them (a native job's ``max_tokens``; chat's ``n`` too)."""
        tpm, rpm = self.limits.tokens_per_minute, self.limits.requests_per_minute
        if self.too_large:
            return (f"request too large: it may use {self.tokens_asked} tokens (its prompts, and the most it may "
                    f"generate), over this key's limit of {tpm} tokens per minute; lower {cost_fields}, or shorten "
                    "the prompt")
        if self.limit_hit == "tokens":
            return (f"rate limit reached for tokens per minute: limit {tpm}, {int(self.tokens_left or 0)} left, "
                    f"this request may use {self.tokens_asked}; try again in {_duration(self.retry_after_s)}")
        return (f"rate limit reached for requests per minute: limit {rpm}; try again in "
                f"{_duration(self.retry_after_s)}")

    def _buckets(self) -> Iterator[tuple[str, int, int, float]]:
        """Per limit that applies: its name, capacity, what is left of it and the seconds until it is full again."""
        for name, cap, left in (("requests", self.limits.requests_per_minute, self.requests_left),
                                ("tokens", self.limits.tokens_per_minute, self.tokens_left)):
            if cap is not None and left is not None:
                yield name, cap, max(0, int(left)), (cap - max(0.0, left)) * WINDOW_S / cap

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the limits that apply (and ``retry-after`` on a refusal)."""
        out: dict[str, str] = {}
        for name, cap, left, until_full in self._buckets():
            out[f"x-ratelimit-limit-{name}"] = str(cap)
            out[f"x-ratelimit-remaining-{name}"] = str(left)
            out[f"x-ratelimit-reset-{name}"] = _duration(until_full)
        if not self.allowed and not self.too_large:
            out["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
            out["retry-after-ms"] = str(max(1, math.ceil(self.retry_after_s * 1000)))
        return out | self._final()

    def _final(self) -> dict[str, str]:
        """A request too large for the minute's tokens fails the same way however long the client waits: the header
        the OpenAI and Anthropic SDKs read before retrying a 429 tells them not to."""
        return {"x-should-retry": "false"} if not self.allowed and self.too_large else {}

    def anthropic_headers(self, now: float | None = None) -> dict[str, str]:
        """The same state as Anthropic's ``anthropic-ratelimit-*`` headers (docs.anthropic.com/en/api/rate-limits):
        limit, remaining, and reset as the RFC 3339 time the bucket is full again; ``retry-after`` on a refusal."""
        now = time.time() if now is None else now
        out: dict[str, str] = {}
        for name, cap, left, until_full in self._buckets():
            out[f"anthropic-ratelimit-{name}-limit"] = str(cap)
            out[f"anthropic-ratelimit-{name}-remaining"] = str(left)
            out[f"anthropic-ratelimit-{name}-reset"] = _rfc3339(math.ceil(now + until_full))
        if not self.allowed and not self.too_large:
            out["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        return out | self._final()


def _rfc3339(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def anthropic_rate_headers(decision: Decision | None) -> dict[str, str]:
    """The answer's ``anthropic-ratelimit-*`` headers (none where no limit applied)."""
    return decision.anthropic_headers() if decision is not None else {}


def rate_headers(decision: Decision | None) -> dict[str, str]:
    """The answer's ``x-ratelimit-*`` headers (none where no limit applied)."""
    return decision.headers() if decision is not None else {}


def _duration(seconds: float) -> str:
    """OpenAI's way of writing a reset time: ``1s``, ``6m0s``, ``250ms``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, secs = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


@dataclass(frozen=True)
class Charge:
    """What one request takes from its tenant's buckets."""

    tenant_id: str
    limits: Limits
    requests: int  # 1, or 0 for a request's further jobs (its other choices and prompts)
    tokens: int
    buckets: str = GENERATION  # or COUNTING, MESSAGE_BATCHES


class RateLimiter:
    """One process's door to the shared buckets."""

    def __init__(self, redis_url: str | None) -> None:
        self._redis = (redis.Redis.from_url(redis_url, socket_connect_timeout=0.5, socket_timeout=0.5)
                       if redis_url else None)
        self._script = self._redis.register_script(_TAKE) if self._redis is not None else None
        self._give_back = self._redis.register_script(_GIVE_BACK) if self._redis is not None else None
        self._warned = 0.0

    def take(self, tenant_id: str, limits: Limits, tokens: int, requests: int = 1,
             now: float | None = None, buckets: str = GENERATION) -> Decision:
        """Takes ``requests`` and ``tokens`` from the tenant's ``buckets``, or refuses and takes nothing."""
        return self.take_many([Charge(tenant_id, limits, requests, tokens, buckets)], now)[0]

    def take_many(self, charges: list[Charge], now: float | None = None) -> list[Decision]:
        """``take`` for each charge in turn, in one Redis call (the group-commit writer's batch)."""
        limited = [c for c in charges if c.limits.any]
        if not limited or self._script is None:
            return [Decision(True, c.limits) for c in charges]
        keys, args = [], [now if now is not None else "", WINDOW_S]
        for c in limited:
            rpm, tpm = c.limits.requests_per_minute, c.limits.tokens_per_minute
            keys += [f"{KEY_PREFIX}{c.tenant_id}:{c.buckets}requests", f"{KEY_PREFIX}{c.tenant_id}:{c.buckets}tokens"]
            args += [-1 if rpm is None else rpm, c.requests, -1 if tpm is None else tpm, c.tokens,
                     f"{c.tenant_id}|{refusal_prefix(c.buckets)}"]
        try:
            answer = self._script(keys=[*keys, REFUSALS], args=args)
        except redis.RedisError as exc:
            if time.monotonic() - self._warned > 60:
                self._warned = time.monotonic()
                log.warning("rate limits not applied (Redis unavailable: %s)", exc)
            return [Decision(True, c.limits) for c in charges]
        said = iter(answer[i:i + 5] for i in range(0, len(answer), 5))
        out = []
        for c in charges:
            if not c.limits.any:
                out.append(Decision(True, c.limits))
                continue
            ok, r_left, r_wait, t_left, t_wait = next(said)
            rpm, tpm = c.limits.requests_per_minute, c.limits.tokens_per_minute
            out.append(Decision(bool(ok), c.limits, requests_left=None if rpm is None else float(r_left),
                                tokens_left=None if tpm is None else float(t_left), requests_wait_s=float(r_wait),
                                tokens_wait_s=float(t_wait), tokens_asked=c.tokens))
        return out


    def give_back(self, charges: list[Charge], now: float | None = None) -> None:
        """Returns what ``charges`` took (each one ``take_many`` allowed) to their tenants' buckets: their requests
        were refused after the charge (the database could not write them: a 503), and a client that retries them
        is not charged twice. Redis down: nothing is given back (nothing is charged while it is down either)."""
        limited = [c for c in charges if c.limits.any]
        if not limited or self._give_back is None:
            return
        keys, args = [], [now if now is not None else "", WINDOW_S]
        for c in limited:
            rpm, tpm = c.limits.requests_per_minute, c.limits.tokens_per_minute
            keys += [f"{KEY_PREFIX}{c.tenant_id}:{c.buckets}requests", f"{KEY_PREFIX}{c.tenant_id}:{c.buckets}tokens"]
            args += [-1 if rpm is None else rpm, c.requests, -1 if tpm is None else tpm, c.tokens]
        try:
            self._give_back(keys=keys, args=args)
        except redis.RedisError as exc:
            log.warning("a refused request's rate-limit charge not given back (Redis unavailable: %s)", exc)


def take_request(limiter: RateLimiter | None, tenant_id: str, limits: Limits,
                 buckets: str = GENERATION) -> Decision | None:
    """One request of no tokens from the tenant's ``buckets`` (a summarization start; a token count; a batch's
    retrieve), raising ``RateLimited`` over its requests per minute; None where that is no limit. A count's or a
    batch call's answer shows its own bucket alone (their buckets hold no tokens)."""
    if limiter is None or limits.requests_per_minute is None:
        return None
    if buckets != GENERATION:
        limits = Limits(requests_per_minute=limits.requests_per_minute)
    decision = limiter.take(tenant_id, limits, 0, buckets=buckets)
    if not decision.allowed:
        raise RateLimited(decision)
    return decision


def refusals(redis_url: str) -> dict[tuple[str, str], int]:
    """Requests refused so far, per (tenant id, limit: ``refusal_prefix`` and the limit's name); empty where Redis
    cannot say."""
    try:
        raw = redis.Redis.from_url(redis_url, socket_connect_timeout=1.0, socket_timeout=2.0).hgetall(REFUSALS)
    except redis.RedisError as exc:
        log.warning("rate-limit refusals unavailable: %s", exc)
        return {}
    out = {}
    for field, n in raw.items():
        tenant, _, limit = field.decode().rpartition("|")
        out[(tenant, limit)] = int(n)
    return out


class RateLimited(Exception):
    """A request over its tenant's limits (HTTP 429)."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(decision.message())
        self.decision = decision
