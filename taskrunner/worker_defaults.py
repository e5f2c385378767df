"""Each worker setting's default, written once: ``WorkerOptions`` and the ``taskrunner
worker`` command both read them (this module imports nothing, so ``--help`` stays cheap)."""

from __future__ import annotations

from typing import Final

CONCURRENCY: Final = 10
SHUTDOWN_TIMEOUT: Final = 0.5
POLL_INTERVAL: Final = 5.0
BEAT_INTERVAL: Final = 2.0
BATCH: Final = 32
DISCOVERY: Final = "stream"
QUEUE_CAPACITY: Final = 10_000
