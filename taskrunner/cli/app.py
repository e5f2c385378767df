"""The typer application every command module registers on, its command order and ``--version``.

typer 0.29 shows a value type for every option, flags included (``--help <bool>``,
``--json <bool>``), though a flag takes no value: its help renderer now asks each
option for ``display_type_rich()`` and lost the filter that hid ``bool`` (typer 0.28
skipped types containing "bool"). An option with a metavar shows that instead, so
flags get an empty one here, which reads right on every typer version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

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


# --help lists commands in the order a newcomer meets them (README: the demo, a dev
# server, init, publish, a worker, show and wait), then the operators' commands. A command
# not named here follows the last named one of its module.
COMMAND_ORDER = (
    "demo",
    "dev-server",
    "init",
    "publish",
    "worker",
    "show",
    "wait",
    "list",
    "failed",
    "flow",
    "cancel",
    "retry",
    "purge",
    "stats",
    "workers",
    "stop-worker",
    "pause",
    "resume",
    "limit",
    "schedules",
    "dashboard",
)


def _module(command: Any) -> str:
    return str(getattr(command.callback, "__module__", ""))


class Group(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _flags_without_type(super().get_params(ctx))

    def list_commands(self, ctx: Any) -> list[str]:
        defined = super().list_commands(ctx)
        last_of_module: dict[str, int] = {}
        for name in defined:
            if name in COMMAND_ORDER:
                module = _module(self.commands[name])
                last_of_module[module] = max(last_of_module.get(module, -1), COMMAND_ORDER.index(name))

        def rank(item: tuple[int, str]) -> tuple[int, int, int]:
            position, name = item
            if name in COMMAND_ORDER:
                return COMMAND_ORDER.index(name), 0, position
            return last_of_module.get(_module(self.commands[name]), len(COMMAND_ORDER)), 1, position

        return [name for _, name in sorted(enumerate(defined), key=rank)]


def typer_app(**settings: Any) -> typer.Typer:
    return typer.Typer(
        cls=Group,
        pretty_exceptions_enable=False,
        add_completion=False,
        rich_markup_mode=None,  # click's plain help: typer's rich help imports 0.3 s of rich and pygments
        context_settings={"max_content_width": 120},  # command summaries cut at the terminal's width, not 80
        **settings,
    )


def command(
    group: typer.Typer, name: str | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``group.command(name)`` with flags shown without a type."""
    return group.command(name, cls=Command)


app = typer_app(help="Background tasks as readable MongoDB documents.", no_args_is_help=True)


def _print_version(given: bool) -> None:
    if given:
        from taskrunner._version import __version__

        print(f"taskrunner {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print taskrunner's version and exit."
        ),
    ] = False,
) -> None:
    """Background tasks as readable MongoDB documents."""
