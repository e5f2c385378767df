"""Group commit for run writes: one round trip carries every renewal and outcome that is ready.

Runs submit fenced writes (``RunWrite``) and await their own result. While one
batch is on the wire, whatever else is submitted waits and goes out together in
the next one, so a lone write leaves at once (no added latency) and a busy worker
sends one bulk write for many runs (the group commit of databases, or Oban's
dispatch debounce without the timer).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from taskrunner.errors import StoreError
from taskrunner.store.base import RunResult, RunWrite, Store

MAX_BATCH = 500


class RunWrites:
    def __init__(self, store: Store, *, max_batch: int = MAX_BATCH) -> None:
        self.store, self.max_batch = store, max_batch
        self._pending: list[tuple[RunWrite, asyncio.Future[RunResult]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def submit(self, write: RunWrite) -> RunResult:
        """The write's result; raises ``StoreError`` when its whole batch failed."""
        [result] = await self.submit_many([write])
        return result

    async def submit_many(self, writes: Sequence[RunWrite]) -> list[RunResult]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in writes]
        self._pending.extend(zip(writes, futures, strict=True))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush(), name="run-writes")
        results = await asyncio.gather(*futures, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result  # the whole batch failed: every future holds this error
        return results  # type: ignore[return-value]

    async def _flush(self) -> None:
        # Runs on its own task: a caller that is cancelled or times out does not cancel
        # a batch other runs are waiting on.
        while self._pending:
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
            try:
                results = await self.store.write_runs([write for write, _ in batch])
            except Exception as exc:
                error = exc if isinstance(exc, StoreError) else StoreError(f"run writes failed: {exc!r}")
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
