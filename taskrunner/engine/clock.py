"""The server's clock as this worker estimates it: every lease time is server time."""

from __future__ import annotations

import time

from taskrunner.store.base import Store

CLOCK_SAMPLES = 3  # round trips per estimate of the server's clock (the quickest is kept)


class ServerClock:
    """This machine's estimate of the server's clock (offset measured with ``hello``)."""

    def __init__(self) -> None:
        self.offset = 0.0
        self.error = 0.02
        """The most the estimate may be off: the server read its clock between the
        request and the reply, so by at most half their round trip from the middle."""

    async def sync(self, store: Store) -> None:
        """The offset from the quickest of ``CLOCK_SAMPLES`` round trips (the first may
        include connecting): its error bound is the smallest."""
        samples = []
        for _ in range(CLOCK_SAMPLES):
            before = time.time()
            server = (await store.server_time()).timestamp()
            after = time.time()
            samples.append((after - before, server - (before + after) / 2))
        took, self.offset = min(samples)
        self.error = took / 2

    def now(self) -> float:
        return time.time() + self.offset
