"""Argument types and checks of the command line: a bad value is one usage line and exit code 2, never a
traceback (argparse reports an ArgumentTypeError, or a CliError raised by a command's check, that way)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


class CliError(ValueError):
    """A combination of arguments a command cannot run; main() reports it as a usage error."""


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= low."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"  # what argparse names in its message
    return parse


positive_int = int_at_least(1)
