"""A rate-limit decision written as Anthropic's ``anthropic-ratelimit-*`` headers (pure logic)."""

from __future__ import annotations

from app.services.rate_limits import Decision, Limits

NOW = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def test_an_allowed_request_says_limit_remaining_and_when_the_bucket_is_full():
    d = Decision(True, Limits(requests_per_minute=10, tokens_per_minute=600), requests_left=4.5, tokens_left=300.0)
    assert d.anthropic_headers(now=NOW) == {
        "anthropic-ratelimit-requests-limit": "10", "anthropic-ratelimit-requests-remaining": "4",
        "anthropic-ratelimit-requests-reset": "2027-01-15T08:00:33Z",  # 5.5 requests at 10 per 60 s
        "anthropic-ratelimit-tokens-limit": "600", "anthropic-ratelimit-tokens-remaining": "300",
        "anthropic-ratelimit-tokens-reset": "2027-01-15T08:00:30Z"}


def test_a_refusal_says_retry_after_unless_waiting_cannot_help():
    waited = Decision(False, Limits(requests_per_minute=2), requests_left=0.2, requests_wait_s=24.2)
    assert waited.anthropic_headers(now=NOW) == {
        "anthropic-ratelimit-requests-limit": "2", "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": "2027-01-15T08:00:54Z", "retry-after": "25"}
    huge = Decision(False, Limits(tokens_per_minute=5), tokens_left=5.0, tokens_asked=9)
    assert huge.anthropic_headers(now=NOW) == {
        "anthropic-ratelimit-tokens-limit": "5", "anthropic-ratelimit-tokens-remaining": "5",
        "anthropic-ratelimit-tokens-reset": "2027-01-15T08:00:00Z",
        "x-should-retry": "false"}  # no retry-after, and the SDKs' retries told not to try again
    assert Decision(True, Limits()).anthropic_headers(now=NOW) == {}
