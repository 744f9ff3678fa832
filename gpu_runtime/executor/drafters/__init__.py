"""Drafters for speculative decoding: a draft model runner and model-free prompt lookup."""

from __future__ import annotations

from typing import Any

from gpu_runtime.executor.drafters.base import Drafter


def draft_checkpoint(spec: str) -> str | None:
    """The draft model ``spec`` (``COSERVE_DRAFT``) names, else None: ``"prompt-lookup"`` drafts without one."""
    return None if spec.startswith("prompt-lookup") else spec


def create_drafter(spec: str, **kwargs: Any) -> Drafter:
    """``"prompt-lookup"`` (optionally ``"prompt-lookup:<max_ngram>"``) or a draft checkpoint
    (dir / .gguf / bundled name)."""
    if draft_checkpoint(spec) is None:
        from gpu_runtime.executor.drafters.prompt_lookup import PromptLookupDrafter

        _, _, n = spec.partition(":")
        return PromptLookupDrafter(max_ngram=int(n)) if n else PromptLookupDrafter()
    from gpu_runtime.executor.drafters.model_runner import DraftModelRunner

    return DraftModelRunner.from_pretrained(spec, **kwargs)


__all__ = ["Drafter", "create_drafter", "draft_checkpoint"]
