"""Publishing in the application's transaction: what it costs beside publishing without one.

One embedded server (``taskrunner dev-server --port 0``), one application client shared with
the runner (``TaskRunner(client=...)``) and counting its commands. Each round runs the cases
side by side, N operations each, on fresh collections:

    plain        insert an order, then publish its task (two writes, no session)
    transaction  the same two writes in ``session.with_transaction`` (plus its commit)
    publish      publish alone, no session
    publish_txn  publish alone, each in its own transaction

Per case, medians of ``--rounds``: ``ms_per_op`` (wall time / N) and ``commands_per_op``
(commands the client sent / N); ``ratio_ms`` and ``ratio_commands`` against the case's
control (``plain`` for ``transaction``, ``publish`` for ``publish_txn``).

    uv run python bench/transactions.py [--ops 300] [--rounds 5] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from common import add_common_args, emit
from processes import dev_server
from pymongo import AsyncMongoClient
from pymongo.asynchronous.client_session import AsyncClientSession

from taskrunner import TaskRunner
from taskrunner.observability.roundtrips import RoundTripCounter

CASES = ("plain", "transaction", "publish", "publish_txn")
CONTROL = {"transaction": "plain", "publish_txn": "publish"}
Op = Callable[[int], Awaitable[None]]


def cases(client: AsyncMongoClient[dict[str, Any]], runner: TaskRunner, orders: str) -> dict[str, Op]:
    """Each case as one operation on item ``i``."""
    shop = client["bench_shop"][orders]

    async def both(i: int, session: AsyncClientSession | None, prefix: str) -> None:
        await shop.insert_one({"_id": f"{prefix}{i}"}, session=session)
        await runner.publish("noop", {"order": i}, key=f"{prefix}{i}", allow_unknown=True, session=session)

    async def in_transaction(body: Callable[[AsyncClientSession], Awaitable[None]]) -> None:
        async with client.start_session() as session:
            await session.with_transaction(body)

    async def plain(i: int) -> None:
        await both(i, None, "p")

    async def transaction(i: int) -> None:
        await in_transaction(lambda s: both(i, s, "t"))

    async def publish(i: int) -> None:
        await runner.publish("noop", key=f"q{i}", allow_unknown=True)

    async def publish_txn(i: int) -> None:
        async def body(session: AsyncClientSession) -> None:
            await runner.publish("noop", key=f"r{i}", allow_unknown=True, session=session)

        await in_transaction(body)

    return {"plain": plain, "transaction": transaction, "publish": publish, "publish_txn": publish_txn}


async def one_round(uri: str, ops: int) -> dict[str, tuple[float, float]]:
    """Each case's (ms per op, commands per op) in one round, on fresh collections."""
    counter = RoundTripCounter()
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(uri, event_listeners=[counter])
    suffix = uuid.uuid4().hex[:8]
    runner = TaskRunner(client=client, collection=f"txbench_{suffix}")
    await runner.init()
    await client["bench_shop"].create_collection(f"orders_{suffix}")
    measured: dict[str, tuple[float, float]] = {}
    for name, op in cases(client, runner, f"orders_{suffix}").items():
        before, started = counter.total(), time.perf_counter()
        for i in range(ops):
            await op(i)
        elapsed = time.perf_counter() - started
        measured[name] = (elapsed * 1000 / ops, (counter.total() - before) / ops)
    await client.close()
    return measured


async def main(args: argparse.Namespace) -> None:
    ops, rounds = (20, 1) if args.smoke else (args.ops, args.rounds)
    with dev_server() as uri:
        results = [await one_round(uri, ops) for _ in range(rounds)]
    figures: dict[str, Any] = {}
    for name in CASES:
        figures[name] = {
            "ms_per_op": round(statistics.median(r[name][0] for r in results), 3),
            "commands_per_op": round(statistics.median(r[name][1] for r in results), 2),
        }
    for name, control in CONTROL.items():
        figures[name]["ratio_ms"] = round(figures[name]["ms_per_op"] / figures[control]["ms_per_op"], 2)
        figures[name]["ratio_commands"] = round(
            figures[name]["commands_per_op"] / figures[control]["commands_per_op"], 2
        )
    emit(
        "transactions",
        {"ops": ops, "rounds": rounds},
        {"cases": figures},
        results=args.results,
        smoke=args.smoke,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ops", type=int, default=300, help="operations per case per round")
    parser.add_argument("--rounds", type=int, default=5)
    add_common_args(parser)
    asyncio.run(main(parser.parse_args()))
