"""Requests the CLI waits on so that one Ctrl-C always stops the wait at once.

Python acts on a SIGINT only in the main thread, between bytecodes. One that arrives after the main thread's last look
for one and before it sleeps in the socket's poll() (a loaded machine preempts a process just there) only marks the
signal: poll() sleeps on to the request's timeout (a minute; ten for ``summarize --cancel``) before the
KeyboardInterrupt is raised, and the operator's Ctrl-C seems lost. Here the request runs in a thread of its own while
the main thread waits for it in short slices, looking for a marked signal after each; a stream's each next chunk
is such a request (``interruptible_items``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

Answer = TypeVar("Answer")
Item = TypeVar("Item")

_ENDED = object()  # the end of a stream read by ``interruptible_items``
CTRL_C_LOOK_S = 0.1  # how often the waiting main thread looks for a Ctrl-C that came just before it slept


def interruptible(request: Callable[[], Answer]) -> Answer:
    """``request()``'s answer, or the exception it raised; a Ctrl-C while it waits raises KeyboardInterrupt here
    within ``CTRL_C_LOOK_S``. The request's thread is a daemon: one still waiting on a server that does not answer
    ends with the command."""
    answers: list[Answer] = []
    failures: list[BaseException] = []

    def run() -> None:
        try:
            answers.append(request())
        except BaseException as exc:  # raised again in the main thread, below
            failures.append(exc)

    waited = threading.Thread(target=run, name="request", daemon=True)
    waited.start()
    while waited.is_alive():
        waited.join(CTRL_C_LOOK_S)
    if failures:
        raise failures[0]
    return answers[0]


def interruptible_items(items: Iterator[Item]) -> Iterator[Item]:
    """``items`` (a stream's lines: each next one a blocking read, which a queued job's stream makes wait for minutes)
    read in one thread of their own and handed over one at a time: a Ctrl-C while the next one is awaited raises
    KeyboardInterrupt here within ``CTRL_C_LOOK_S`` (a thread a line, as ``interruptible`` would start, is not
    needed)."""
    handed: queue.Queue[tuple[object, BaseException | None]] = queue.Queue(maxsize=1)

    def read() -> None:
        try:
            for item in items:
                handed.put((item, None))
            handed.put((_ENDED, None))
        except BaseException as exc:  # raised again in the main thread, below
            handed.put((_ENDED, exc))

    threading.Thread(target=read, name="stream", daemon=True).start()
    while True:
        try:
            item, failure = handed.get(timeout=CTRL_C_LOOK_S)
        except queue.Empty:
            continue
        if failure is not None:
            raise failure
        if item is _ENDED:
            return
        yield item  # type: ignore[misc]  # not _ENDED: an item
