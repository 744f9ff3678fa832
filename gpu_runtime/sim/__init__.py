"""Simulation: traces, workload generators, the event loop over SimExecutor replicas, metrics, capacity search."""
