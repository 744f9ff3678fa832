"""Options that several commands share, written once so that every command's help says the same."""

from __future__ import annotations

from typing import Annotated

import typer

Url = Annotated[str | None, typer.Option("--url", help="API base URL (default: COSERVE_URL, else `coserve up`'s)")]
Key = Annotated[str | None, typer.Option("--key", help="API key (default: COSERVE_API_KEY, else `coserve up`'s)")]
AsJson = Annotated[bool, typer.Option("--json", help="print the API's JSON instead of a table")]
Tier = Annotated[str | None, typer.Option("--tier", help="tier to run as, e.g. free or paid (at most your key's; "
                                                         "default: the key's tier)")]
JobId = Annotated[str, typer.Argument(help="job id (job_...)")]
