"""Bounds the API's schemas and the CLI share, in a module of no imports (the CLI starts without pydantic)."""

MAX_RATE = 2**31 - 1  # a tenant's limit is an SQL integer
JOBS_PAGE_MAX = 500  # the most jobs one page of GET /v1/jobs (and so `coserve jobs --limit`) holds
BATCHES_PAGE_MAX = 100  # the most batches one page of GET /v1/batches (`coserve batch list --limit`) holds
RUNS_PAGE_MAX = 100  # the most runs one page of GET /v1/summarize (`coserve summarize --list --limit`) holds
