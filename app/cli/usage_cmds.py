"""CLI: ``coserve usage``, the Usage API's buckets as a table (tokens, requests and SLOs per bucket and group)."""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from app.cli.options import Key, Url, finite
from app.cli.output import Console, kept, list_table, other, print_json, print_table, when

console = Console()

# app/services/usage.py's (not imported: SQL)
GROUPS = ("project_id", "user_id", "api_key_id", "model", "batch", "service_tier")
NUMBERS = ("num_model_requests", "input_tokens", "input_cached_tokens", "output_tokens", "num_slo_met",
           "num_slo_missed", "num_relegated")
HEADERS = ("requests", "input", "cached", "output", "SLO met", "missed", "relegated")
PAGE = {"1m": 1440, "1h": 168, "1d": 31}  # the most buckets a page holds: fewer round trips


def register(cli: typer.Typer) -> None:
    @cli.command()
    def usage(days: Annotated[float, typer.Option(min=0, callback=finite, help="how far back from now")] = 1.0,
              bucket: Annotated[str, typer.Option(help="1m, 1h or 1d")] = "1h",
              by: Annotated[list[str] | None, typer.Option(help=f"group by (repeat): {', '.join(GROUPS)}")] = None,
              admin: Annotated[bool, typer.Option("--admin", help="every tenant's, with the admin key `coserve up` "
                                                                  "saved, or the --key given, which must be an admin "
                                                                  "key (else your key's tenant only)")] = False,
              as_json: Annotated[bool, typer.Option("--json", help="every bucket as JSON")] = False,
              url: Url = None, key: Key = None) -> None:
        """Tokens and requests the engines ran, and how many met their SLO, per time bucket (the Usage API)."""
        from app.cli.service_cmds import _client_config, _request, admin_key, is_admin_key

        if bucket not in PAGE:  # checked here: the API's 400 would also name the page size this command derives
            raise typer.BadParameter(f"{bucket!r}: choose {', '.join(PAGE)}", param_hint="--bucket")
        given = key is not None
        url, key = _client_config(url, admin_key() if admin and not given else key)
        start = int(time.time() - days * 86400)
        if start < 0:  # the API's 400 would name its start_time, which the operator did not give
            raise typer.BadParameter(f"{days:g} days back is before 1970; give at most {int(time.time() // 86400)}",
                                     param_hint="--days")
        if admin and given and not is_admin_key(url, key):  # its answer would be its own tenant's usage alone
            raise typer.BadParameter("the key given is not an admin key: give an admin key with --key, leave --key "
                                     "out for the admin key `coserve up` saved, or drop --admin for this key's "
                                     "tenant's usage", param_hint="--admin")
        params: dict[str, Any] = {"start_time": start, "bucket_width": bucket,
                                  "group_by": by or [], "limit": PAGE.get(bucket)}
        buckets: list[dict[str, Any]] = []
        while True:
            page = _request("GET", url, key, "/v1/organization/usage/completions", params=params)
            buckets += page["data"]
            if not page["has_more"]:
                break
            params["page"] = page["next_page"]
        if as_json:
            print_json(buckets)
            return
        groups = by or []
        results = [(b["start_time"], r) for b in buckets for r in b["results"]]
        if not results:
            console.print(f"no usage in the last {days:g} days")
            return
        rows = [(when(start), *(str(r[g]) for g in groups), *(str(r[n]) for n in NUMBERS)) for start, r in results]
        table = list_table(kept("from", [row[0] for row in rows]),
                           *(kept(g, [str(r[g]) for _, r in results]) for g in groups),
                           *(other(h, justify="right") for h in HEADERS))
        for row in rows:
            table.add_row(*row)
        table.add_row("total", *([""] * len(groups)), *(str(sum(r[n] for _, r in results)) for n in NUMBERS))
        print_table(console, table)
