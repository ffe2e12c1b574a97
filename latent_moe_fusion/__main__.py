"""Command line: `python -m latent_moe_fusion demo`, `python -m latent_moe_fusion inspect [--tp N] [--sp]` and
`python -m latent_moe_fusion switches [--markdown]`, `python -m latent_moe_fusion plan --m M` and
`python -m latent_moe_fusion plan-tail --m M`."""

from __future__ import annotations

import argparse
import sys

from . import demo, envs, graph_inspect, plan_cli, plan_tail_cli
from .cli_args import CliError


class _Switches:
    """`switches`: the operator's environment variables as set here, and the tuning overrides."""

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--markdown", action="store_true",
                            help="print docs/switches.md instead (python -m latent_moe_fusion switches --markdown > "
                                 "docs/switches.md)")

    @staticmethod
    def check_arguments(args: argparse.Namespace) -> None:
        pass  # one flag, checked by argparse

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        print(envs.markdown() if args.markdown else envs.describe(), end="" if args.markdown else "\n")
        return 0


COMMANDS = {
    "demo": (demo, "eager vs compiled vs compiled + fused on the reference block"),
    "inspect": (graph_inspect, "post-grad graph before and after the fusion pass, and a summary"),
    "plan": (plan_cli, "which routed-expert kernels run for M tokens, and why (one line per decision)"),
    "plan-tail": (plan_tail_cli, "which latent-tail backend and kernel run for M tokens, and why (one line per "
                                 "decision)"),
    "switches": (_Switches, "the operator's environment variables as set here, and the tuning overrides "
                            "(docs/switches.md)"),
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
