"""Command line: `python -m latent_moe_fusion demo` and `python -m latent_moe_fusion inspect [--tp N] [--sp]`."""

from __future__ import annotations

import argparse
import sys

from . import demo, graph_inspect


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m latent_moe_fusion", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo.add_arguments(commands.add_parser("demo", help="eager vs compiled vs compiled + fused on the reference block"))
    graph_inspect.add_arguments(
        commands.add_parser("inspect", help="post-grad graph before and after the fusion pass, and a summary")
    )
    args = parser.parse_args(argv)
    return {"demo": demo.run, "inspect": graph_inspect.run}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
