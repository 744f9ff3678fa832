"""Batch formation policies (QoServe and baselines) behind the two-call interface."""
