"""One process of the hand-rolled baseline queue (the loop many teams write), for bench/baseline.py.

Plain synchronous PyMongo, its own collection of plain documents, one loop:

    claim = find_one_and_update({"state": "PENDING"},
                                {"$set": {"state": "RUNNING", "owner": me}, "$currentDate": {"claimed_at": True}},
                                sort=[("priority", -1), ("created_at", 1)])
    nothing -> sleep(0.1); else run the handler and
    update_one({"_id": id, "owner": me}, {"$set": {"state": "SUCCESS", "result": ...},
                                          "$currentDate": {"finished_at": True}})

Handlers: ``noop`` (result None) and ``stamp`` (result = time.time() at handler start).
A PyMongo command listener counts its round trips; on SIGTERM it finishes the current
task, prints ``{"event": "round trips", "total": N, "commands": {...}}`` and exits.
It prints ``{"event": "ready"}`` once its client has answered a first command.

    python bench/baseline_worker.py URI COLLECTION WORKER_ID [--idle-sleep 0.1]
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from collections import Counter
from typing import Any

from pymongo import MongoClient, ReturnDocument, monitoring


class Commands(monitoring.CommandListener):
    """Counts started commands by name (one loop thread, so no lock)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        self.counts[event.command_name] += 1

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        return None

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        return None


HANDLERS: dict[str, Any] = {"noop": lambda: None, "stamp": time.time}


def loop(collection: Any, me: str, idle_sleep: float, stopping: list[bool]) -> None:
    while not stopping:
        task = collection.find_one_and_update(
            {"state": "PENDING"},
            {"$set": {"state": "RUNNING", "owner": me}, "$currentDate": {"claimed_at": True}},
            sort=[("priority", -1), ("created_at", 1)],
            return_document=ReturnDocument.AFTER,
        )
        if task is None:
            time.sleep(idle_sleep)
            continue
        result = HANDLERS[task["name"]]()
        collection.update_one(
            {"_id": task["_id"], "owner": me},
            {"$set": {"state": "SUCCESS", "result": result}, "$currentDate": {"finished_at": True}},
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("uri")
    parser.add_argument("collection")
    parser.add_argument("worker_id")
    parser.add_argument("--idle-sleep", type=float, default=0.1)
    args = parser.parse_args()
    stopping: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))  # stop after the current task
    commands = Commands()
    client: MongoClient[dict[str, Any]] = MongoClient(args.uri, event_listeners=[commands])
    try:
        client.admin.command("ping")
        print(json.dumps({"event": "ready", "worker_id": args.worker_id}), flush=True)
        loop(client.get_database("baseline")[args.collection], args.worker_id, args.idle_sleep, stopping)
    finally:
        client.close()
        counts = dict(sorted(commands.counts.items()))
        print(
            json.dumps(
                {
                    "event": "round trips",
                    "worker_id": args.worker_id,
                    "total": sum(counts.values()),
                    "commands": counts,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
