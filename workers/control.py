"""Operator actions reaching a worker: Redis pub/sub on ``coserve:control:<worker_id>``.

Messages are JSON ``{"action": "resume", "job_id": ...}`` or ``{"action": "promote", "job_id": ..., "tier": "free" |
"paid", "resume": bool, "attempt": int}`` (the engine's tier of the job's new service tier; ``resume``: it moved up;
``attempt``: the one the admin's write found, which a promote that comes before its add waits for) sent by
the admin API (``app/api/admin.py``), or ``{"action": "reset_prefix_cache", "reply_to": ...}``
(``POST /reset_prefix_cache``): the worker pushes ``{"worker": ..., "reset": ...}`` on the
``reply_to`` list once its engine thread reset the cache. Drain needs no message: the worker's heartbeat
reads ``workers.draining``; cancel goes through the jobs' own cancel channel.

``start_control_listener(inbox, worker_id, redis_url, stop)`` runs the listener thread; the
GPU worker starts it with its engine thread's inbox (``workers/inbox.py``), so the engine
thread applies each action between two steps.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from gpu_runtime.qos import Tier

log = logging.getLogger(__name__)


REPLY_TTL_S = 120  # a reply list nobody read goes


def control_channel(worker_id: str) -> str:
    return f"coserve:control:{worker_id}"


RESET_WAIT_S = 30.0  # how long the listener waits for the engine thread to reset the prefix cache


def handle(inbox: Any, message: dict[str, Any], reply: Callable[[str, dict[str, Any]], None] | None = None) -> bool:
    """Hands one control message to ``inbox`` (``resume``/``promote``, ``reset_prefix_cache``, whose outcome goes
    to ``reply``); False if it was not understood."""
    action, job_id = message.get("action"), message.get("job_id")
    if action == "reset_prefix_cache" and isinstance(message.get("reply_to"), str):
        done = inbox.reset_prefix_cache(bool(message.get("reset_running_requests")))
        try:
            outcome: dict[str, Any] = {"reset": bool(done.result(timeout=RESET_WAIT_S))}
        except Exception as exc:  # noqa: BLE001 - the engine's error or the wait's, said to the operator
            outcome = {"reset": False, "error": f"{exc.__class__.__name__}: {exc}"}
        if reply is not None:
            reply(message["reply_to"], outcome)
        return True
    if not job_id:
        return False
    if action == "resume":
        inbox.resume(job_id)
        return True
    if action == "promote":
        try:
            tier = Tier(message.get("tier", "paid"))
        except ValueError:
            return False
        attempt = message.get("attempt")
        # applied by the engine thread, which owns the request
        inbox.promote(job_id, tier, attempt if isinstance(attempt, int) else None)
        if message.get("resume"):  # a job moved up that was relegated comes back too
            inbox.resume(job_id)
        return True
    log.warning("unknown control action %r", action)
    return False


def start_control_listener(inbox: Any, worker_id: str, redis_url: str,
                           stop: threading.Event | None = None) -> threading.Thread:
    stop = stop or threading.Event()

    client = redis.Redis.from_url(redis_url, socket_connect_timeout=2.0)

    def answer(reply_to: str, outcome: dict[str, Any]) -> None:
        with client.pipeline() as pipe:
            pipe.rpush(reply_to, json.dumps({"worker": worker_id, **outcome}))
            pipe.expire(reply_to, REPLY_TTL_S)
            pipe.execute()

    def loop() -> None:
        while not stop.is_set():
            try:
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(control_channel(worker_id))
                while not stop.is_set():
                    msg = pubsub.get_message(timeout=1.0)
                    if msg and msg.get("type") == "message":
                        try:
                            handle(inbox, json.loads(msg["data"]), answer)
                        except (ValueError, TypeError) as exc:
                            log.warning("bad control message %r: %s", msg.get("data"), exc)
            except redis.RedisError:
                stop.wait(1.0)

    thread = threading.Thread(target=loop, name="coserve-control", daemon=True)
    thread.start()
    log.info("control listener on %s", control_channel(worker_id))
    return thread

