"""A batch's fan-out in a process SIGKILLed at one point of it: ``python -m tests.integration.dying_fanout BATCH_ID
POINT``, with the settings a worker takes (``tests.conftest.worker_env``). The process dies as a killed API would:
no ``finally``, no clean-up.

POINT: ``between_chunks`` (its first chunk of jobs written staged, the next not), ``keeping_line_numbers`` (its
line numbers' part file half written), ``before_sending`` (its jobs committed dispatched, no message sent).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterable, Iterator

from app.batch import fanout
from app.settings import Settings

CHUNK = 2  # jobs a staged chunk: a few lines make several


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _dying_after(first: int, items: Iterable) -> Iterator:
    """``items``' first ``first``, then the process dies as it asks for the next."""
    for i, item in enumerate(items):
        if i == first:
            _die()
        yield item


def main(batch_id: str, point: str) -> None:
    fanout.STAGE_CHUNK = CHUNK
    write_staged, keep_line_numbers = fanout.write_staged, fanout.keep_line_numbers
    if point == "between_chunks":
        fanout.write_staged = lambda url, parts, *rest: write_staged(url, _dying_after(1, parts), *rest)
    elif point == "keeping_line_numbers":
        fanout.keep_line_numbers = lambda data_dir, batch, numbered, mark: keep_line_numbers(
            data_dir, batch, _dying_after(1, numbered), mark)
    elif point == "before_sending":
        fanout.send_dispatched = lambda *args: _die()
    else:
        raise SystemExit(f"unknown point {point!r}")
    fanout.start_batch(Settings(), batch_id)
    raise SystemExit(f"the fan-out of {batch_id} ended: it was to die at {point}")


if __name__ == "__main__":
    main(*sys.argv[1:])
