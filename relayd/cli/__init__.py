"""The command-line style every C{relayd-admin} tool shares (docs/decisions.md P-6); the tools are
this package's modules.

Help texts are in sentence case without a closing full stop; an option with a default ends with
C{[default: X]}, X printed as an operator would type it. Errors have argparse's shape, whatever found
them: C{PROG: error: WHAT} on stderr (argparse's own errors print the usage line first), exit status 2
for a usage error (the command line cannot work as written) and 1 for a failure while running.

The modules, one per tool or command group:

    client   what the tools that talk to a running relayd share: its URLs, plain HTTP, stopping on a signal
    admin    C{relayd-admin}: the command line and its dispatch (the console script's entry point)
    aep      C{relayd-admin aep tail|post}
    mcp      C{relayd-admin mcp connect}
    status   C{relayd-admin status}
    broker   C{relayd-admin broker issue|revoke|list}

C{relayd-admin broker} works on the broker's state directory, not over HTTP: L{relayd.cli.broker} is
the one tool that imports a wing (the broker's state, keys and contract, never its HTTP door), and
no wing imports a tool; the rest speak HTTP to a running relayd and import no wing (pyproject.toml's
import contracts).
"""

from __future__ import annotations

import argparse
from typing import IO, Any, Callable, NoReturn, TypeVar

from relayd.base.config import integer_at_least, show_value

T = TypeVar("T")

USAGE = 2
FAILED = 1


class CommandError(Exception):
    """An error to print as C{PROG: error: WHAT} before exiting with C{status}."""

    status = FAILED

    def __init__(self, message: str, prog: str | None = None, usage: str = "") -> None:
        super().__init__(message)
        self.prog = prog
        self.usage = usage


class UsageError(CommandError):
    """The command line cannot work as written: a bad value, a missing or conflicting option (exit 2)."""

    status = USAGE


class Failure(CommandError):
    """Running the command failed: unreachable, refused, unreadable state (exit 1)."""

    status = FAILED


def report(err: IO[str], error: CommandError, prog: str) -> int:
    """Print C{error} in the one format and return its exit status."""
    one_line = " ".join(str(error).split()) or type(error).__name__
    err.write(f"{error.usage}{error.prog or prog}: error: {one_line}\n")
    err.flush()
    return error.status


def has_default(action: argparse.Action) -> bool:
    """Whether an option has a default worth showing (a switch's C{False} or an unset C{None} is not)."""
    if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return False
    default = action.default
    if default is None or default is argparse.SUPPRESS or isinstance(default, bool):
        return False
    return default not in ([], "")


class HelpFormatter(argparse.HelpFormatter):
    """Appends C{[default: X]} to every option that has a default (unless its help names it already)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "[default:" in text or not has_default(action):
            return text
        shown = show_value(action.default, ",").replace("%", "%%")  # argparse %-formats help
        return f"{text} [default: {shown}]"


class Parser(argparse.ArgumentParser):
    """An C{ArgumentParser} in the shared style; its errors raise L{UsageError} for the caller to report."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        add_help = kwargs.pop("add_help", True)
        kwargs["add_help"] = False
        super().__init__(*args, **kwargs)
        if add_help:  # argparse's own text is lower case with no unit of style
            self.add_argument("-h", "--help", action="help", help="Show this help and exit")

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, prog=self.prog, usage=self.format_usage())


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return _argument(text, integer_at_least, 1, "must be a positive integer", "is not an integer")


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return _argument(text, integer_at_least, 0, "must be 0 or more", "is not an integer")


def _argument(text: str, parse: Callable[..., T], *args: Any) -> T:
    """C{parse(text, *args)}, its C{ValueError} as argparse reports a bad value: C{'TEXT' WHAT}."""
    try:
        return parse(text, *args)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} {e}") from None


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds, 0 or more")
    return value


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 seconds")
    return value
