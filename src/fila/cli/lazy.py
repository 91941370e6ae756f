"""The CLI built lazily: typer's own commands, each made on first use, so that one command's run
does not pay for the other twenty (docs/architecture.md, start-up cost)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup


class Commands(MutableMapping[str, Any]):
    """A group's commands by name, each built by typer (`get_command_from_info`) on first use.

    typer builds every command of a group before parsing anything: the signatures and options of
    twenty commands, about a third of `fila --help`, where one command runs. Built lazily, the
    command a process runs is the very object typer's eager build makes (tests/test_cli_startup.py
    compares both builds' help and parameters, command by command), and the others cost nothing.
    """

    def __init__(self, builders: dict[str, Callable[[], Any]], summaries: dict[str, Callable[[], Any]]):
        self._builders = builders
        self._summaries = summaries
        self._built: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._built:
            self._built[name] = self._builders[name]()  # KeyError: no such command
        return self._built[name]

    def __setitem__(self, name: str, cmd: Any) -> None:
        self._builders[name] = lambda: cmd
        self._built[name] = cmd

    def __delitem__(self, name: str) -> None:
        del self._builders[name]
        self._built.pop(name, None)
        self._summaries.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._builders  # without building it

    def __iter__(self) -> Iterator[str]:
        return iter(self._builders)  # registration order, as typer lists them

    def __len__(self) -> int:
        return len(self._builders)

    def summary(self, name: str) -> Any:
        """What a group's help lists for a command (name, short help, hidden): the command itself
        when built, else the same command without its parameters, which the listing never reads."""
        if name in self._built or name not in self._summaries:
            return self[name]
        return self._summaries[name]()


def lazy_command(typer_app: typer.Typer) -> TyperGroup:
    """The click group typer makes of `typer_app` (`typer.main.get_command`), its commands and
    sub-groups built on first use (`Commands`): made by typer's own functions, with the app's
    own settings, so parsing, help and errors are typer's."""
    import copy
    import functools
    import inspect

    from typer import main as tm

    shell = copy.copy(typer_app)  # the group itself (help, settings, callback), no commands yet
    shell.registered_commands, shell.registered_groups = [], []
    group = tm.get_group(shell)
    kw: dict[str, Any] = {
        "pretty_exceptions_short": typer_app.pretty_exceptions_short,
        "rich_markup_mode": typer_app.rich_markup_mode,
    }
    builders: dict[str, Callable[[], Any]] = {}
    summaries: dict[str, Callable[[], Any]] = {}
    for info in typer_app.registered_commands:
        assert info.callback is not None
        name = info.name or tm.get_command_name(info.callback.__name__)
        builders[name] = functools.partial(tm.get_command_from_info, info, **kw)
        doc = inspect.getdoc(info.callback) if info.help is None else inspect.cleandoc(info.help)
        summaries[name] = functools.partial(
            info.cls or TyperCommand,
            name=name,
            help=doc,
            short_help=info.short_help,
            hidden=info.hidden,
            deprecated=info.deprecated,
            rich_markup_mode=typer_app.rich_markup_mode,
        )
    for sub in typer_app.registered_groups:  # `fila images`: built (its one command too) when used
        assert isinstance(sub.name, str), "fila names its sub-groups (add_typer(..., name=))"
        builders[sub.name] = functools.partial(
            tm.get_group_from_info, sub, **kw, suggest_commands=typer_app.suggest_commands
        )
        # The listing reads a sub-group's name and short help only: the group without its commands.
        info = sub.typer_instance.info if sub.typer_instance else None
        if info is not None and isinstance(info.help, str):
            summaries[sub.name] = functools.partial(
                info.cls or TyperGroup,
                name=sub.name,
                help=inspect.cleandoc(info.help),
                hidden=bool(info.hidden) if isinstance(info.hidden, bool) else False,
                rich_markup_mode=typer_app.rich_markup_mode,
            )
    group.commands = Commands(builders, summaries)
    return group
