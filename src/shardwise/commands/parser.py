"""The argument parser every ``shardwise`` command and sub-command is built from.

Set as the top-level parser's class, it is every sub-parser's class too (argparse's ``add_subparsers``
defaults ``parser_class`` to the parent's type), so each command refuses bad flags the same way, in one
line on stderr, exit 2, named by the command itself: a flag it does not know (with the closest real ones),
a flag missing its value. Abbreviated flags are refused rather than expanded (``--sched`` is not
``--schedule``): a typo must not run as some other setting.

No communication: command-line parsing only.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import Any, NoReturn

SHOW_DEFAULT = " (default %(default)s)"  # a flag's help ends so: argparse puts in the default


class CommandParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line, and which takes whole flags only."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]  # one signature for typeshed's overloads
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """As argparse's, but an argument this parser does not know is refused here, by this (sub-)
        command, rather than handed up to the top-level parser, which would name neither the command
        nor the flag meant."""
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self._refuse(extras)
        return parsed, extras

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _refuse(self, extras: list[str]) -> NoReturn:
        flags = [a for a in extras if a.startswith("-") and len(a) > 1]
        if not flags:
            self.error(f"unexpected argument {extras[0]!r}")
        flag = flags[0].split("=", 1)[0]
        known = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
        close = closest(flag, known)
        if not close:
            self.error(f"unknown flag {flag}")
        meant = f"{', '.join(close[:-1])} or {close[-1]}" if len(close) > 1 else close[0]
        self.exit(2, f"{self.prog}: error: unknown flag {flag}: did you mean {meant}?\n")


def closest(word: str, options: list[str]) -> list[str]:
    """The options most like ``word``, best first: up to three, each nearly as close as the best
    (``--shedule``: ``--schedule`` only, not ``--lr-schedule`` too)."""
    near = difflib.get_close_matches(word, options, n=3)
    ratio = {option: difflib.SequenceMatcher(None, word, option).ratio() for option in near}
    best = max(ratio.values(), default=0.0)
    return [option for option in near if ratio[option] >= best - 0.1]
