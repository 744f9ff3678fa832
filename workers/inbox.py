"""What other threads ask of the engine thread, in one FIFO: add, abort, supersede, resume, promote, learn, reset
the prefix cache, retire runtime LoRA adapters.

The engine thread is the only caller of the engine. The Celery intake, the cancel
listener, the heartbeat and the operator's control listener put commands here; the
engine thread applies them, in order, before each step. Because the intake registers a
job and queues its ``Add`` under the registry's lock, an ``Abort`` for a job the worker
holds is always applied after its ``Add``.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from gpu_runtime.qos import Tier


@dataclass(frozen=True)
class Add:
    job_id: str


@dataclass(frozen=True)
class Abort:
    job_id: str
    attempt: int | None = None  # that attempt only (a lease lost: a rerun leased here since goes on); None: any


@dataclass(frozen=True)
class Supersede:
    """A rerun of the job came here while its attempt ``attempt`` is still served: that attempt is aborted and set
    aside (``ActiveJobs.abandon``), not waited for, and the rerun's message goes back to the head of ``queue``'s list
    of ``priority`` through the outbox, once the attempt's last stream events are published; its next take adds the
    rerun beside the aborted request (its own request id). The intake hands it over here instead of waiting for the
    engine thread: the consumer takes one message at a time."""

    job_id: str
    attempt: int
    queue: str
    priority: int


@dataclass(frozen=True)
class Resume:
    job_id: str


@dataclass(frozen=True)
class Promote:
    job_id: str
    tier: Tier
    attempt: int | None = None  # the attempt the admin's write found holding the job (None: whichever)


@dataclass(frozen=True)
class Learn:
    """Output lengths the model's other workers finished (read by the heartbeat from SQL)."""

    lengths: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class ResetPrefixCache:
    """Forget the prefix cache's blocks (vLLM's ``reset_prefix_cache``); ``done`` gets whether it was reset."""

    done: Future
    reset_running_requests: bool = False


@dataclass(frozen=True)
class RetireLoras:
    """The runtime LoRA adapters loaded now (name -> (path, version), read by the heartbeat from SQL): the engine
    removes the others it loaded (unloaded or replaced since) once no request it holds uses them."""

    loaded: dict[str, tuple[str, float]]


Command = Add | Abort | Supersede | Resume | Promote | Learn | ResetPrefixCache | RetireLoras
JobCommand = Add | Abort | Supersede | Resume | Promote  # those that name a job (the others are the engine's)


class Inbox:
    def __init__(self) -> None:
        self._commands: deque[Command] = deque()
        self._lock = threading.Lock()
        self.ready = threading.Event()

    def put(self, command: Command) -> None:
        with self._lock:
            self._commands.append(command)
        self.ready.set()

    def drain(self) -> list[Command]:
        with self._lock:
            commands, self._commands = list(self._commands), deque()
        return commands

    def wait(self, timeout: float) -> None:
        """Sleeps until a command arrives (or ``wake``), at most ``timeout`` seconds."""
        self.ready.wait(timeout)
        self.ready.clear()

    def wake(self) -> None:
        self.ready.set()

    def __len__(self) -> int:
        return len(self._commands)

    # the verbs of the operator's control messages (workers/control.py)
    def resume(self, job_id: str) -> None:
        self.put(Resume(job_id))

    def promote(self, job_id: str, tier: Tier, attempt: int | None = None) -> None:
        self.put(Promote(job_id, tier, attempt))

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> Future:
        """Whether the engine forgot its cached prefix blocks, once the engine thread got to it."""
        done: Future = Future()
        self.put(ResetPrefixCache(done, reset_running_requests))
        return done
