"""``runner.flow(id)``: a graph of tasks built step by step, published in one call.

Steps get readable keys derived from the flow id (``<flow id>/<name>``, then
``<flow id>/<name>-2``, ... for a name added again) unless given one, so publishing the
same flow again publishes nothing new: a flow is idempotent by its id, as a task is by its
key. ``chain`` and ``group`` are Celery's canvas: steps one after another, or side by side.
"""

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Required, Unpack

from taskrunner.errors import InvalidTask
from taskrunner.models import NewTask, Task, UpstreamPolicy
from taskrunner.options import PublishOptions
from taskrunner.store import fields as f


@dataclass(frozen=True)
class Step:
    """A step added to a ``Flow``: pass it (or a list of them) as another step's ``after``."""

    key: str
    name: str


Upstream = Step | str


class StepDict(PublishOptions, total=False):
    """``add``'s arguments as a dict, for ``chain`` and ``group`` (which set ``after``)."""

    name: Required[str]
    params: Any
    key: str | None
    compensate: tuple[str, Any] | None
    on_upstream_failure: UpstreamPolicy


StepSpec = tuple[str, Any] | StepDict
"""What ``chain`` and ``group`` take per step: ``(name, params)``, or ``add``'s keywords as
a dict (``{"name": ..., "params": ..., "key": ..., "priority": ...}``)."""


class Publisher(Protocol):
    """What a flow publishes through (``TaskClient``)."""

    def new_task(self, spec: Mapping[str, Any], *, allow_unknown: bool = False) -> NewTask: ...

    async def publish_specs(
        self,
        tasks: Iterable[Mapping[str, Any]],
        *,
        update_pending: bool = False,
        republish_finished: bool = False,
        allow_unknown: bool = False,
    ) -> list[Task]: ...


class Flow:
    """A flow being built: ``add`` steps, then ``await flow.publish()`` (docs/workflows.md)."""

    def __init__(self, publisher: Publisher, flow_id: str) -> None:
        if not isinstance(flow_id, str) or not flow_id or not flow_id.isprintable():
            raise InvalidTask("flow", f"a flow id must be a non-empty printable string, not {flow_id!r}")
        self.id = flow_id
        self._publisher = publisher
        self._steps: dict[str, dict[str, Any]] = {}
        self._names: dict[str, int] = {}

    def publishes_with(self, publisher: object) -> bool:
        """Whether ``publish`` publishes through ``publisher``."""
        return self._publisher is publisher

    @property
    def steps(self) -> list[Step]:
        """The steps added so far, in order."""
        return [Step(key, spec["name"]) for key, spec in self._steps.items()]

    def add(
        self,
        name: str,
        params: Any = None,
        *,
        key: str | None = None,
        after: Upstream | Iterable[Upstream] = (),
        compensate: tuple[str, Any] | None = None,
        on_upstream_failure: UpstreamPolicy = "cancel",
        **options: Unpack[PublishOptions],
    ) -> Step:
        """Add a step: task ``name`` with ``params``, after the steps (or stored task keys)
        in ``after``; ``compensate=(name, params)`` is the task that undoes it if a later
        step fails. ``options`` are ``publish``'s (``priority``, ``delay``, task options)."""
        if not isinstance(name, str):
            raise InvalidTask("name", "must be a string")
        key = self._key(name) if key is None else key
        if key in self._steps:
            raise InvalidTask("key", f"flow {self.id!r} has two steps keyed {key!r}; give each its own key=")
        spec: dict[str, Any] = {
            "name": name,
            "params": params,
            "key": key,
            "after": _keys(after),
            "on_upstream_failure": on_upstream_failure,
            f.FLOW: self.id,
            **options,
        }
        if compensate is not None:
            spec[f.COMPENSATE] = _compensation(compensate)
        self._steps[key] = spec
        return Step(key, name)

    def chain(self, *steps: StepSpec, after: Upstream | Iterable[Upstream] = ()) -> list[Step]:
        """Steps each after the one before (the first after ``after``)."""
        added: list[Step] = []
        for spec in steps:
            added.append(self._add_spec(spec, [added[-1]] if added else after))
        return added

    def group(self, *steps: StepSpec, after: Upstream | Iterable[Upstream] = ()) -> list[Step]:
        """Steps side by side, all after ``after``: pass the list as a later step's ``after``
        to run it once they all succeeded (Celery's chord)."""
        return [self._add_spec(spec, after) for spec in steps]

    async def publish(self, *, allow_unknown: bool = False) -> list[Task]:
        """Publish every step in one call (nothing if a step does not validate); steps
        stored already are returned as they are, so publishing a flow again is harmless."""
        if not self._steps:
            raise InvalidTask("flow", f"flow {self.id!r} has no steps")
        items = list(self._steps.values())
        saga = any(f.COMPENSATE in item for item in items)
        for item in items:
            if f.COMPENSATE in item:  # its name and params are checked now, not when it runs
                compensate = item[f.COMPENSATE]
                probe = {"name": compensate["name"], "params": compensate["params"], "key": item["key"]}
                try:
                    checked = self._publisher.new_task(probe, allow_unknown=allow_unknown)
                except InvalidTask as exc:
                    exc.place(f"steps[{item['key']!r}].compensate")  # the same error, placed in the flow
                    raise
                item[f.COMPENSATE] = {"name": checked.name, "params": checked.params}
        if saga:  # every step's end is announced: a failure stops the flow
            items = [{**item, "dependents": True} for item in items]
        return await self._publisher.publish_specs(items, allow_unknown=allow_unknown)

    def _key(self, name: str) -> str:
        count = self._names[name] = self._names.get(name, 0) + 1
        return f"{self.id}/{name}" if count == 1 else f"{self.id}/{name}-{count}"

    def _add_spec(self, spec: StepSpec, after: Upstream | Iterable[Upstream]) -> Step:
        if isinstance(spec, Mapping):
            given: dict[str, Any] = dict(spec)
            if "after" in given:
                raise InvalidTask("after", "chain and group set each step's after; use add for your own")
            name = given.pop("name", None)
            params = given.pop("params", None)
            return self.add(name, params, after=after, **given)
        if not (isinstance(spec, tuple) and len(spec) == 2):
            raise InvalidTask(
                "step", f"a step is (name, params) or a mapping of add's keywords, not {spec!r}"
            )
        return self.add(spec[0], spec[1], after=after)


def _keys(after: Upstream | Iterable[Upstream]) -> list[str]:
    """Keys of ``after``: a step, a key, or an iterable of them."""
    items: Sequence[Any] = [after] if isinstance(after, Step | str) else list(after)
    keys = []
    for item in items:
        if isinstance(item, Step):
            keys.append(item.key)
        elif isinstance(item, str):
            keys.append(item)
        else:
            raise InvalidTask("after", f"must be steps or task keys, not {item!r}")
    return keys


def _compensation(compensate: Any) -> dict[str, Any]:
    if not (isinstance(compensate, tuple) and len(compensate) == 2 and isinstance(compensate[0], str)):
        raise InvalidTask("compensate", f"must be (task name, params), not {compensate!r}")
    return {"name": compensate[0], "params": compensate[1] if compensate[1] is not None else {}}
