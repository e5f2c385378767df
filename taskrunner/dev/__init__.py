"""For development and tests, not the engine: the embedded server, the demo, worker processes."""
