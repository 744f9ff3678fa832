"""CLI: ``coserve files list|delete``, the Files API's uploads (the JSONL files batches are made from).

An upload outlives the batch it was made for, and one without a batch (`batch create` stopped between its upload and
its start; a start the API refused deletes its upload, or names it where it cannot) is left until it expires: these
list and delete them, as OpenAI's
``client.files.list()`` and ``client.files.delete(id)`` do.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from app.cli.batch_cmds import Api
from app.cli.options import AsJson, Key, Url, in_path
from app.cli.output import Console, asking, date, kept, list_table, other, print_json, print_table, when

console = Console()

files_app = typer.Typer(help="OpenAI-compatible Files API: list and delete your uploads (a batch's input file).",
                        no_args_is_help=True)

FileId = Annotated[str, typer.Argument(help="file id (file_...)", callback=in_path)]
LIST_DEFAULT = 20
LIST_MAX = 10_000  # GET /v1/files's largest page (OpenAI's)


def _files_table(files: list[dict[str, Any]]) -> Table:
    t = list_table(kept("file", (f["id"] for f in files)), kept("purpose", (f["purpose"] for f in files)),
                   other("bytes", justify="right"), other("filename"), date("created"), date("expires"))
    for f in files:
        t.add_row(f["id"], f["purpose"], str(f["bytes"]), escape(f["filename"]), when(f["created_at"]),
                  when(f["expires_at"]))
    return t


@files_app.command("list")
def list_(purpose: Annotated[str | None, typer.Option(help="only files of this purpose, e.g. batch or "
                                                           "batch_output")] = None,
          limit: Annotated[int, typer.Option(min=1, max=LIST_MAX, help="how many files to show")] = LIST_DEFAULT,
          after: Annotated[str | None, typer.Option(help="the page after this file id (the last one the page "
                                                        "before showed)")] = None,
          as_json: AsJson = False,
          url: Url = None, key: Key = None) -> None:
    """List your files, newest first (uploads and the output and error files of your batches)."""
    params = {k: v for k, v in {"purpose": purpose, "limit": limit, "after": after}.items() if v is not None}
    page = Api(url, key).call("GET", "/v1/files", params=params).json()
    if as_json:
        print_json(page)
        return
    if not page["data"]:  # not a table of headers alone
        console.print(escape(" ".join(w for w in ("no", purpose, "files") if w) + (f" after {after}" if after else "")))
        return
    print_table(console, _files_table(page["data"]))
    if page["has_more"]:  # the same filter, the next page
        same = [*(["--purpose", purpose] if purpose else []),
                *(["--limit", str(limit)] if limit != LIST_DEFAULT else [])]
        console.print(escape(f"more: `coserve files list {' '.join([*same, '--after', page['last_id']])}`"),
                      soft_wrap=True)


@files_app.command("delete")
def delete(file_id: FileId, as_json: Annotated[bool, typer.Option("--json", help="print the API's answer ({id, "
                                                                                 "object, deleted}) as JSON, alone "
                                                                                 "on stdout")] = False,
           url: Url = None, key: Key = None) -> None:
    """Delete a file: its content is gone, and a batch can no longer be made from it."""
    with asking(f"the server may delete file {file_id}", "`coserve files list` shows whether it is there"):
        answer = Api(url, key).call("DELETE", f"/v1/files/{file_id}", looked_up=("file", file_id)).json()
    if as_json:
        print_json(answer)
        return
    console.print(f"file {answer['id']} deleted")


def register(cli: typer.Typer) -> None:
    cli.add_typer(files_app, name="files")
