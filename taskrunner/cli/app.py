"""The typer application every command module registers on.

typer 0.29 shows a value type for every option, flags included (``--help <bool>``,
``--json <bool>``), though a flag takes no value: its help renderer now asks each
option for ``display_type_rich()`` and lost the filter that hid ``bool`` (typer 0.28
skipped types containing "bool"). An option with a metavar shows that instead, so
flags get an empty one here, which reads right on every typer version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption


def _flags_without_type(params: list[Any]) -> list[Any]:
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""
    return params


class Command(TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:  # click's or typer's own Context and Parameter
        return _flags_without_type(super().get_params(ctx))


# --help lists commands by group in this order, each group's in the order its module defines them.
GROUP_ORDER = ("admin", "tasks", "flow", "schedules", "worker", "dashboard", "dev")


def _group_rank(command: Any) -> int:
    module = getattr(command.callback, "__module__", "").rpartition(".")[2]
    return GROUP_ORDER.index(module) if module in GROUP_ORDER else len(GROUP_ORDER)


class Group(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_without_type(super().get_params(ctx))

    def list_commands(self, ctx: Any) -> list[str]:
        return sorted(super().list_commands(ctx), key=lambda name: _group_rank(self.commands[name]))


def typer_app(**settings: Any) -> typer.Typer:
    return typer.Typer(cls=Group, pretty_exceptions_enable=False, add_completion=False, **settings)


def command(
    group: typer.Typer, name: str | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``group.command(name)`` with flags shown without a type."""
    return group.command(name, cls=Command)


app = typer_app(help="Background tasks as readable MongoDB documents.", no_args_is_help=True)
