"""The message a worker's consumer holds: its delivery tag, recorded as Celery hands it over, so that the sweep that
finds the worker lost takes it back at once.

With late acks a taken message sits in kombu's Redis unacked hash until it is acked, and only its visibility timeout
(an hour) restores it: a worker killed between taking a job's message and leasing the job left the job dispatched
with no worker, and one taken off the model's shared queue names no worker in that hash (its routing key is the
queue's), so only the sweeper's lost-message rule (``max(30 s, 5 x lease)``) sent it again. Each worker records the
tag of the message in hand in one Redis hash (``TAKEN``: worker id -> tag; one HSET per message, the consumer holds
one at a time) before the task runs; ``take_back`` removes a lost worker's entry and its unacked message at once and
returns its job, which the sweep sends again with the jobs of the worker's own queue (``sweeper.reroute``).
"""

from __future__ import annotations

import logging

import redis

from app.services.notify import redis_client

log = logging.getLogger(__name__)

TAKEN = "coserve:worker-taken"  # a Redis hash: worker id -> the delivery tag of the message its consumer took last

# KEYS: TAKEN, kombu's unacked hash, its index; ARGV: a worker id. The message the worker took and never acked
# (nil where it was acked or restored), removed with the worker's entry in one step: one sweeper takes it
_TAKE_BACK = """
local tag = redis.call('HGET', KEYS[1], ARGV[1])
if not tag then return false end
redis.call('HDEL', KEYS[1], ARGV[1])
local raw = redis.call('HGET', KEYS[2], tag)
if not raw then return false end
redis.call('HDEL', KEYS[2], tag)
redis.call('ZREM', KEYS[3], tag)
return raw
"""


def record_deliveries(client: redis.Redis, worker_id: str):
    """Records, as Celery's consumer hands this process a message (``task_received``: before the task runs, the
    earliest hook after kombu put it in its unacked hash), its delivery tag as ``worker_id``'s message in hand.
    Returns the receiver (connected strongly)."""
    from celery.signals import task_received

    def _took(request=None, **_kw) -> None:
        tag = getattr(getattr(request, "message", None), "delivery_tag", None)
        if tag is None:
            return
        try:
            client.hset(TAKEN, worker_id, tag)
        except redis.RedisError as exc:  # its job is the lost-message rule's if the worker dies holding it
            log.warning("could not record the message worker %s took (%s)", worker_id, exc)

    task_received.connect(_took, weak=False)
    return _took


def forget(client: redis.Redis, worker_id: str) -> None:
    """The message in hand went back to its queue (handed back while the task waits on): a lost worker's unacked
    copy of it is not sent again (its job already waits there)."""
    try:
        client.hdel(TAKEN, worker_id)
    except redis.RedisError as exc:  # a second message, should the worker die now: harmless (one leases the job)
        log.debug("could not forget the message worker %s handed back (%s)", worker_id, exc)


def take_back(redis_url: str, worker_ids: list[str]) -> list[bytes]:
    """The messages (kombu's unacked entries) the consumers of ``worker_ids`` (lost, or an earlier life of this
    worker) took and never acked, removed with the workers' records; a message acked since (its job leased, or
    handed back) gives none."""
    from kombu.transport.redis import Channel

    taken: list[bytes] = []
    try:
        client = redis_client(redis_url)
        for worker_id in worker_ids:
            raw = client.eval(_TAKE_BACK, 3, TAKEN, Channel.unacked_key, Channel.unacked_index_key, worker_id)
            if raw:
                taken.append(raw)
    except redis.RedisError as exc:  # the ones left: sent again later as lost (sweeper._resend_lost)
        log.warning("could not take back the messages lost workers held (%s)", exc)
    return taken


def takers(redis_url: str) -> list[str]:
    """The workers that recorded a message taken (those that are lost are ``take_back``'s)."""
    return [w.decode() for w in redis_client(redis_url).hkeys(TAKEN)]
