"""Prometheus metrics derived from SQL (jobs and workers tables) at scrape time."""
