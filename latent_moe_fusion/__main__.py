"""Command line: `python -m latent_moe_fusion demo`, `python -m latent_moe_fusion inspect [--tp N] [--sp]` and
`python -m latent_moe_fusion switches [--markdown]`."""

from __future__ import annotations

import argparse
import sys

from . import demo, envs, graph_inspect


def _switches(args: argparse.Namespace) -> int:
    print(envs.markdown() if args.markdown else envs.describe(), end="" if args.markdown else "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m latent_moe_fusion", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(commands.add_parser("demo", help="eager vs compiled vs compiled + fused on the reference block"))
    graph_inspect.add_arguments(
        commands.add_parser("inspect", help="post-grad graph before and after the fusion pass, and a summary")
    )
    switches = commands.add_parser("switches", help="the operator's environment variables as set here, and the tuning "
                                                    "overrides (docs/switches.md)")
    switches.add_argument("--markdown", action="store_true",
                          help="print docs/switches.md instead (python -m latent_moe_fusion switches --markdown > "
                               "docs/switches.md)")
    args = parser.parse_args(argv)
    return {"demo": demo.run, "inspect": graph_inspect.run, "switches": _switches}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
