"""The ``p2ptrain`` command line: one small module per subcommand, wired up here."""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from . import ckpt_cmd, demo, dht_cmd, peer_cmd, status_cmd, swarm_cmd
from .common import EXIT_USAGE, fail, setup_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2ptrain",
        description="Peer-to-peer decentralized training for PyTorch: peers find each other through a "
        "Kademlia DHT, with no master.",
    )
    parser.add_argument("--version", action="version", version=f"p2ptrain {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument("--log-json", action="store_true", help="log as JSON lines on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    ckpt_cmd.add_parser(sub)
    demo.add_parser(sub)
    dht_cmd.add_parser(sub)
    peer_cmd.add_parser(sub)
    status_cmd.add_parser(sub)
    swarm_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    setup_logging(args.verbose, args.log_json)
    from dht import ConfigError

    try:
        if hasattr(args, "config"):  # peer, swarm: flags > $P2PTRAIN_* > --config file > defaults
            from ..config import apply_config

            apply_config(args, build_parser, sys.argv[1:] if argv is None else argv)
        return args.func(args)
    except ConfigError as e:
        return fail(str(e), EXIT_USAGE)


if __name__ == "__main__":
    sys.exit(main())
