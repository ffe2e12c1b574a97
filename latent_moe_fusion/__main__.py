"""Command line: `python -m latent_moe_fusion demo` and `python -m latent_moe_fusion inspect [--tp N] [--sp]`."""

from __future__ import annotations

import argparse
import sys

from . import demo, graph_inspect
from .cli_args import CliError

COMMANDS = {
    "demo": (demo, "eager vs compiled vs compiled + fused on the reference block"),
    "inspect": (graph_inspect, "post-grad graph before and after the fusion pass, and a summary"),
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command's arguments, each checked: a bad one ends in one usage line on stderr and exit code 2."""
    parser = argparse.ArgumentParser(prog="python -m latent_moe_fusion", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    parsers = {}
    for name, (module, help_text) in COMMANDS.items():
        parsers[name] = commands.add_parser(name, help=help_text)
        module.add_arguments(parsers[name])
    args = parser.parse_args(argv)
    try:
        COMMANDS[args.command][0].check_arguments(args)
    except CliError as exc:
        parsers[args.command].error(str(exc))  # usage + message on stderr, exit 2
    return args


def main(argv: list[str] | None = None) -> int:
    """Every argument is checked before any work is done (parse)."""
    args = parse(argv)
    return COMMANDS[args.command][0].run(args)


if __name__ == "__main__":
    sys.exit(main())
