"""OpenAI Batch API: file storage, line validation, fan-out into jobs, fan-in into output files."""
