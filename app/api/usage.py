"""OpenAI's Usage API for completions: ``GET /v1/organization/usage/completions``.

An admin key sees every tenant (``project_ids`` picks some); any other key sees its own tenant's
usage only. See ``app/services/usage.py`` for what is counted.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Query

from app.api.deps import CurrentPrincipal, SessionDep, SettingsDep
from app.api.errors import openai_responses
from app.openai_schemas import OpenAIError, OpenAIRoute, service_tier
from app.services.usage import BUCKETS_PER_PAGE, GROUPS, UsageQuery, completions_usage

router = APIRouter(prefix="/v1/organization/usage", tags=["usage"], route_class=OpenAIRoute,
                   responses=openai_responses(401))

_PAGE = re.compile(r"page_(\d{1,9})")
LAST_SECOND = 253402300799  # 9999-12-31T23:59:59Z, the last time a datetime holds


@router.get("/completions", responses=openai_responses(400, 403))
def completions(session: SessionDep, principal: CurrentPrincipal, settings: SettingsDep,
                start_time: Annotated[int, Query(ge=0, le=LAST_SECOND,
                                                 description="unix seconds: the first bucket starts here")],
                end_time: Annotated[int | None, Query(ge=0, le=LAST_SECOND,
                                                      description="unix seconds, exclusive (default: the end "
                                                                  "of the current second)")] = None,
                bucket_width: Literal["1m", "1h", "1d"] = "1d",
                project_ids: Annotated[list[str] | None, Query(description="tenant ids (an admin key's choice)")]
                = None,
                user_ids: Annotated[list[str] | None, Query(description="the requests' end users (their "
                                                                        "safety_identifier, user or Anthropic "
                                                                        "metadata.user_id)")]
                = None,
                api_key_ids: Annotated[list[str] | None, Query(description="keys that submitted the jobs")]
                = None,
                models: Annotated[list[str] | None, Query()] = None,
                batch: bool | None = None,
                group_by: Annotated[list[str] | None, Query(description=f"any of {', '.join(GROUPS)}")] = None,
                limit: Annotated[int | None, Query(ge=1, description="buckets a page")] = None,
                page: Annotated[str | None, Query(description="next_page of the page before")] = None) -> dict:
    end = int(time.time()) + 1 if end_time is None else end_time  # exclusive: the jobs of this very second count
    if end <= start_time and end_time is None:  # the client sent no end_time: its start_time is what to fix
        raise OpenAIError(400, f"start_time ({start_time}) is in the future, after the default end_time (now, "
                          f"{end}); give an earlier start_time, or an end_time after it", param="start_time")
    if end <= start_time:
        raise OpenAIError(400, f"end_time ({end}) must come after start_time ({start_time})", param="end_time")
    default, most = BUCKETS_PER_PAGE[bucket_width]
    if limit is not None and limit > most:
        raise OpenAIError(400, f"limit is at most {most} buckets of {bucket_width}", param="limit")
    groups = tuple(dict.fromkeys(group_by or ()))
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise OpenAIError(400, f"cannot group by {', '.join(unknown)}: jobs record {', '.join(GROUPS)}",
                          param="group_by")
    first = 0
    if page is not None:
        if (m := _PAGE.fullmatch(page)) is None:
            raise OpenAIError(400, f"page {page!r} is not a next_page this API gave", param="page")
        first = int(m.group(1))
    tenants = tuple(project_ids) if project_ids else None
    if not principal.is_admin:
        if tenants is not None and set(tenants) != {principal.tenant_id}:
            raise OpenAIError(403, "only an admin key reads other tenants' usage; leave project_ids out",
                              param="project_ids", code="forbidden")
        tenants = (principal.tenant_id,)
    query = UsageQuery(start_time, end, bucket_width, limit or default, first, groups, tenants,
                       tuple(user_ids) if user_ids else None, tuple(api_key_ids) if api_key_ids else None,
                       tuple(models) if models else None, batch)
    if page is not None and first >= query.buckets:  # no next_page names it: the range has no bucket there
        raise OpenAIError(400, f"page {page!r} is past the range's {query.buckets} buckets", param="page")
    return completions_usage(session, query, lambda tier: service_tier(tier, settings.tiers))
