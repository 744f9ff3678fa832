"""vLLM's engine arguments as ``vllm serve`` takes them on its command line (``coserve worker --tensor-parallel-size 2
--max-num-seqs 128``), read with vLLM's own parser into the ``EngineArgs`` fields they set."""

from __future__ import annotations

import argparse
import copy
import shlex
from collections.abc import Sequence
from functools import lru_cache
from typing import Any


def engine_cli_args(argv: str | Sequence[str]) -> dict[str, Any]:
    """The ``EngineArgs`` fields that ``argv`` (a list, or one string split as a shell would) sets, and only those:
    a field it leaves out keeps the worker's value, not vLLM's default. A ValueError names what vLLM's parser
    refused (an unknown flag, a value of the wrong type)."""
    parts = tuple(shlex.split(argv) if isinstance(argv, str) else argv)
    return copy.deepcopy(_parsed(parts)) if parts else {}  # a copy: vLLM may fill in the configs it is given


@lru_cache(maxsize=8)
def _parsed(parts: tuple[str, ...]) -> dict[str, Any]:
    """One parse per command line: the API checks each job against the context length they set."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):
        def error(self, message: str):  # noqa: ANN201 - argparse's hook; raises instead of exiting
            raise ValueError(f"vLLM engine arguments {shlex.join(parts)!r}: {message} (they are `vllm serve`'s "
                             f"engine options; see `vllm serve --help`)")

    parser = EngineArgs.add_cli_args(Parser(add_help=False))
    for action in parser._actions:  # argparse has no public way to tell a given option from its default
        action.default = argparse.SUPPRESS
    return vars(parser.parse_args(list(parts)))


def operator_engine_args(json_args: dict[str, Any], cli_args: str) -> dict[str, Any]:
    """The engine arguments an operator set: COSERVE_VLLM_ENGINE_ARGS (a JSON object), then COSERVE_VLLM_ARGS (the
    command line's flags), which win where both set a field."""
    return {**json_args, **engine_cli_args(cli_args)}
