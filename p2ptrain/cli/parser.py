"""The argument parser of every ``p2ptrain`` command: ordinary conventions argparse lacks by default.

Options go anywhere on the line (``p2ptrain dht put --bootstrap X KEY VALUE``), a flag is never
silently abbreviated (``--epoch 3`` is not ``--epochs 3``), an unknown flag gets a "did you mean",
and every usage error is one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any, NoReturn

EXIT_USAGE = 2


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser (and, through ``add_subparsers``, every subcommand's) with the CLI's conventions."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._intermixing = False

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        # A command with positionals and no subcommands reads its options wherever they are
        # (argparse alone stops filling positionals at the first option that follows one).
        if self._intermixing or not self._intermixable():
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False

    def _intermixable(self) -> bool:
        positionals = self._get_positional_actions()
        return bool(positionals) and not any(
            a.nargs in (argparse.PARSER, argparse.REMAINDER) for a in positionals)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self.command_parser(parsed)
            command.error(command.unrecognized(extras))
        return parsed

    def command_parser(self, parsed: argparse.Namespace) -> CommandParser:
        """The (sub)command's parser that ``parsed`` came from: the deepest one chosen."""
        parser: CommandParser = self
        while True:
            subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            name = getattr(parsed, subs[0].dest, None) if subs and subs[0].dest else None
            if name is None or name not in subs[0].choices:
                return parser
            parser = subs[0].choices[name]

    def unrecognized(self, extras: list[str]) -> str:
        """What is wrong with the first unrecognized argument, with the closest option it may mean."""
        first = extras[0]
        if not first.startswith("-") or first in ("-", "--"):
            return f"unexpected argument {first!r}"
        flag = first.split("=", 1)[0]
        options = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        close = difflib.get_close_matches(flag, options, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"unrecognized option {flag}{hint}"

    def error(self, message: str) -> NoReturn:
        """One line naming the problem and where help is, exit code 2 (argparse prints the usage too)."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
