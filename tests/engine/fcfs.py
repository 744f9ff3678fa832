"""A tiny FCFS chunked-prefill scheduler for executor tests (not a product policy)."""

from __future__ import annotations

from gpu_runtime.request import Request
from gpu_runtime.scheduler.interface import ScheduledPrefill, Scheduler, SchedulerOutput


class FCFSTestScheduler(Scheduler):
    def __init__(self, executor, chunk: int = 64, max_decodes: int = 64) -> None:
        self.executor = executor
        self.chunk = chunk
        self.max_decodes = max_decodes
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        for q in (self.waiting, self.running):
            for r in q:
                if r.request_id == request_id:
                    q.remove(r)
                    return r
        return None

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        free = self.executor.capacity().free_blocks
        for r in self.running[: self.max_decodes]:
            need = self.executor.blocks_needed(r.request_id, 1 + 8)  # room for a small tree
            if need <= free:
                free -= need
                out.decodes.append(r)
        budget = self.chunk
        for r in self.waiting:
            if budget <= 0:
                break
            n = min(budget, r.prefill_remaining)
            need = self.executor.blocks_needed(r.request_id, n)
            if need > free:
                break
            free -= need
            budget -= n
            out.prefills.append(ScheduledPrefill(r, n))
        out.prefill_budget = self.chunk
        return out

    def update_from_output(self, output: SchedulerOutput, now: float) -> None:
        for p in output.prefills:
            r = p.request
            if r.status.finished:
                self.waiting.remove(r)
            elif not r.in_prefill:
                self.waiting.remove(r)
                self.running.append(r)
        self.running = [r for r in self.running if not r.status.finished]

    def resume(self, request_id: str) -> bool:
        return False

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def queue_depths(self) -> dict[str, int]:
        return {"prefill": len(self.waiting), "decode": len(self.running)}
