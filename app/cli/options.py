"""Options that several commands share, written once so that every command's help says the same."""

from __future__ import annotations

import math
import shlex
from typing import Annotated, Any
from urllib.parse import quote

import typer

Url = Annotated[str | None, typer.Option("--url", help="API base URL, with or without /v1 (default: COSERVE_URL, else "
                                                              "`coserve up`'s)")]
Key = Annotated[str | None, typer.Option("--key", help="API key (default: COSERVE_API_KEY, else `coserve up`'s)")]
AsJson = Annotated[bool, typer.Option("--json", help="print the API's JSON instead of a table")]
Tier = Annotated[str | None, typer.Option("--tier", help="tier to run as, e.g. free or paid (at most your key's; "
                                                         "default: the key's tier)")]


def in_path(value: str | None) -> str | None:
    """An id argument's callback: the id as one URL path segment, so "../batches" or "x?limit=1" is asked for as
    the id it is (a 404 names it: ``error_line``) and does not reach another route whose answer the command misreads.
    "." and ".." too: httpx drops such a segment from the URL ("." asked for the job list), not its escaped form.
    An empty id is a usage error naming the argument: it asked for the list ("/v1/jobs/"), or was taken as not given."""
    if value is None:
        return None
    if not value:
        raise typer.BadParameter("the id is empty; give one")
    return quote(value, safe="") if value.strip(".") else value.replace(".", "%2E")


JobId = Annotated[str, typer.Argument(help="job id (job_...)", callback=in_path)]


def finite(value: float | None) -> float | None:
    """A float option's callback: click's FloatRange lets "nan" through its bounds and takes "inf", which the JSON
    sent to the API cannot hold and no duration or rate means; a usage error instead of a traceback later."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value}: give a finite number")
    return value


NOT_GIVEN = {"DEFAULT", "DEFAULT_MAP"}  # the names of click's ParameterSource for a value the operator did not give


def given_beside(ctx: typer.Context, applying: set[str]) -> list[Any]:
    """The command's parameters (click's) the operator gave, on the command line or in the environment, other than
    ``applying`` (their names): what a mode of the command (`--cancel ID`, `--list`) would otherwise ignore without a
    word. The source is compared by name: Typer runs on its own copy of click, whose enum is not ``click``'s."""
    return [p for p in ctx.command.params if p.name not in applying
            and (source := ctx.get_parameter_source(p.name)) is not None and source.name not in NOT_GIVEN]


# vLLM's engine options follow a command's own, as `vllm serve` takes them (worker, up, profile)
VLLM_OPTIONS = {"allow_extra_args": True, "ignore_unknown_options": True}


def vllm_flags(ctx: typer.Context, settings: Any, backend: str | None = None) -> tuple[str, dict[str, Any]]:
    """COSERVE_VLLM_ARGS with the command's trailing vLLM engine options after it (the last of a flag wins), and the
    engine arguments they set, checked with vLLM's parser first: a flag it refuses stops the command (exit 2) before
    anything starts. ``backend``: the engine the command runs (default: the settings')."""
    joined = f"{settings.vllm_args} {shlex.join(ctx.args)}".strip()
    if not joined:
        return "", {}
    backend = backend or settings.engine_backend
    if backend != "vllm":
        if not ctx.args:
            return joined, {}  # COSERVE_VLLM_ARGS alone: the torch engine leaves it unread, as the other vllm settings
        raise typer.BadParameter(f"{shlex.join(ctx.args)!r}: vLLM engine options need the vLLM backend (this one "
                                 f"is {backend!r}; COSERVE_BACKEND=vllm, with vLLM installed)")
    from gpu_runtime.vllm.build import checked_overrides
    from gpu_runtime.vllm.cli_args import engine_cli_args

    try:  # vLLM's parser, then what coserve refuses of them (the fields it sets itself, ...)
        return joined, checked_overrides(engine_cli_args(joined), settings.spec_policy)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
