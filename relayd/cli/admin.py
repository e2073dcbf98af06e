"""C{relayd-admin}: the operator's tools for a running relayd (the console script's entry point).

    relayd-admin aep tail [URL] [--filter JSON] [--session S] [--capture LEVEL] [--from all|JSON] [--no-live]
    relayd-admin aep post [URL] [FILE]            # NDJSON events from FILE or stdin
    relayd-admin mcp connect URL [tools | call NAME [ARGS] | send FRAME | watch]
    relayd-admin status [--aep URL] [--mcp URL] [--broker URL] [--metrics URL]
    relayd-admin broker issue|revoke|list ...     # Buzz broker credentials

This module builds the command line from its groups (relayd/cli/aep.py, mcp.py, status.py), runs the
command, and turns whatever went wrong into one C{PROG: error: WHAT} line (relayd/cli/__init__.py).
C{broker} is handed whole to the broker's state tool, relayd/cli/broker.py.
"""

from __future__ import annotations

import argparse
import http.client
import sys
from typing import Sequence

import relayd
from relayd.base.clock import BlockingClock
from relayd.cli import CommandError, Failure, Parser, aep, mcp, report, status
from relayd.cli.client import Stopped, describe, stop_on_signals


def _parser() -> argparse.ArgumentParser:
    """The command line; every help text follows relayd/cli/__init__.py (tests/test_help.py checks it)."""
    p = Parser(prog="relayd-admin", description="Operator tools for a running relayd")
    p.add_argument("--version", action="version", version=f"relayd-admin {relayd.__version__}",
                   help="Show relayd-admin's version and exit")
    tools = p.add_subparsers(dest="tool", required=True, metavar="{aep,mcp,status,broker}")
    aep.add_parser(tools)
    mcp.add_parser(tools)
    status.add_parser(tools)
    # Parsed by relayd.cli.broker (main hands it everything after "broker").
    tools.add_parser("broker", help="Buzz broker credentials: issue, revoke, list (relayd-admin broker -h)",
                     add_help=False)
    return p


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The command line, options anywhere: a command whose optional positionals follow its first one
    (C{mcp connect URL [COMMAND [ARGS]]}) is parsed again intermixed, so C{URL --token T call NAME}
    means what it says (argparse alone has given the optionals nothing by the time it sees C{call})."""
    args, extra = parser.parse_known_args(argv)
    command: argparse.ArgumentParser | None = getattr(args, "intermixed", None)
    if command is None:
        if extra:
            parser.error("unrecognized arguments: " + " ".join(extra))
        return args
    # Its own arguments: what follows its name (the tool and group take no option with a value).
    words = argv[argv.index(args.tool) + 1 :]
    fresh = argparse.Namespace(tool=args.tool, subcommand=args.subcommand)
    return command.parse_intermixed_args(words[words.index(args.subcommand) + 1 :], namespace=fresh)


def main(argv: Sequence[str] | None = None, clock: BlockingClock | None = None) -> int:
    """The C{relayd-admin} console script; returns the exit status (relayd/cli/__init__.py: 2 usage, 1 failure).

    C{clock} is what the commands wait and measure time with (a test's own, else the system's).
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["broker"]:
        from relayd.cli.broker import main as broker_main  # loaded only for it: it imports the broker wing's state

        return broker_main(args_list[1:], clock=clock)
    parser = _parser()
    try:
        args = _parse(parser, args_list)
    except CommandError as e:
        return report(sys.stderr, e, parser.prog)
    stop_on_signals()
    try:
        return int(args.run(args, clock or BlockingClock()))
    except Stopped:
        return 0
    except CommandError as e:
        return report(sys.stderr, e, args.prog)
    except (OSError, http.client.HTTPException) as e:
        return report(sys.stderr, Failure(describe(e)), args.prog)
    except Exception as e:  # never a traceback for an operator: one line, and the kind of fault
        return report(sys.stderr, Failure(f"unexpected {type(e).__name__}: {e}"), args.prog)


if __name__ == "__main__":
    sys.exit(main())
