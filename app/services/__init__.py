"""Service layer: job submission, state transitions, dispatch and token streaming."""
