"""What a drafter does for the executor: propose a candidate token tree per request."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from gpu_runtime.executor.base import DraftEntry, KeepDrafting
    from gpu_runtime.executor.torch.executor import TorchExecutor
    from gpu_runtime.speculation.token_tree import TokenTree


class Drafter(ABC):
    """Proposes trees from a request's tokens (read from the executor it is bound to)."""

    executor: TorchExecutor

    def bind(self, executor: TorchExecutor) -> None:
        self.executor = executor

    @abstractmethod
    def draft(self, entries: list[DraftEntry], keep_drafting: KeepDrafting | None = None) -> dict[str, TokenTree]:
        """Candidate tree per request (depth/width from each entry); path probabilities filled. A drafter
        that pays per depth (a model) asks ``keep_drafting`` before each further one; a free one may ignore it."""

    def free(self, request_id: str) -> None:
        """Forget the request (drafters with a KV cache release it here)."""

    # ---- elastic memory (only model drafters hold device memory) ----
    # Whether the drafter keeps weights/KV in device memory (Nightjar may offload it).
    # Model-free drafters (prompt lookup) hold none: always usable, never offloaded.
    holds_device_memory: ClassVar[bool] = False

    def memory_plan(self) -> tuple[int, int]:
        """Device bytes ``bind`` will still allocate: (fixed bytes, bytes per target KV block)."""
        return 0, 0

    @property
    def on_device(self) -> bool:
        """Usable for drafting now (model-free drafters: always)."""
        return True

    def device_bytes(self) -> int:
        return 0

    def offload(self) -> int:
        """Move weights off the device; returns device bytes freed."""
        return 0

    def load(self) -> None:
        """Move weights back onto the device."""
