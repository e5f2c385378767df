"""Tests that start real processes: ``taskrunner worker`` fleets, CLI commands, the demo, the benchmark scripts."""
