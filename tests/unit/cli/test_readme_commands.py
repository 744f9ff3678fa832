"""Every `coserve ...` command line README.md and ops/compose/*.md show (in code spans and code blocks) names a
command the CLI has, with options that command takes; `up`, `worker` and `profile` also take vLLM's engine flags
after their own, which vLLM's parser must know."""

from __future__ import annotations

import re

from typer.main import get_command

from app.cli import cli
from tests.conftest import ROOT

DOCS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.joinpath("ops/compose").glob("*.md")))
TAKE_VLLM_FLAGS = {("up",), ("worker",), ("profile",)}


def _commands() -> dict[tuple[str, ...], set[str]]:
    """Each command's path (``("batch", "create")``) and the options it takes."""
    found: dict[tuple[str, ...], set[str]] = {}

    def walk(command, path: tuple[str, ...]) -> None:
        found[path] = {o for p in command.params for o in [*getattr(p, "opts", ()), *getattr(p, "secondary_opts", ())]}
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, (*path, name))

    walk(get_command(cli), ())
    return found


def _command_lines(text: str) -> list[str]:
    """What follows ``coserve `` in each code span and each line of a code block, up to a comment or a pipe."""
    code = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    # a span opens and closes with as many backticks (``a `b` c``), and may wrap
    spans = [" ".join(span.split()) for _, span in re.findall(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", prose, re.S)]
    lines = [line for block in code for line in block.splitlines()] + spans
    return [re.split(r"\s#|\|", m)[0] for line in lines for m in re.findall(r"^(?:\S*/)?coserve (.*)", line.strip())]


def _vllm_flags() -> set[str]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return set(EngineArgs.add_cli_args(FlexibleArgumentParser(add_help=False))._option_string_actions)


def test_every_command_line_the_docs_show_is_one_the_cli_takes():
    commands, vllm_flags, checked = _commands(), None, 0
    for doc in DOCS:
        for line in _command_lines(ROOT.joinpath(doc).read_text()):
            words = line.split()
            path: tuple[str, ...] = ()
            while len(path) < len(words) and (*path, words[len(path)]) in commands:
                path = (*path, words[len(path)])
            assert path, f"{doc}: `coserve {line}` names no command"
            for option in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line):
                if option in commands[path] or option == "--help":
                    continue
                assert path in TAKE_VLLM_FLAGS, f"{doc}: `coserve {line}`: {' '.join(path)} takes no {option}"
                vllm_flags = vllm_flags if vllm_flags is not None else _vllm_flags()
                assert option in vllm_flags, f"{doc}: `coserve {line}`: {option} is no vLLM engine flag either"
            checked += 1
    assert checked >= 20  # the docs' command lines are found (many more when this was written)
