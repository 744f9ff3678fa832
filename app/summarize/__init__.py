"""Summarization pipeline: token-aware splitting and map-reduce over deadline batch jobs."""
