"""Issue 11: one help style for ``twistd relayd --help`` and every ``relayd-admin`` command.

Every option of every settings table and every relayd-admin (sub)parser is walked, so an option added
later is held to the same rules: a non-empty help text in sentence case without a closing full stop,
units named, and ``[default: X]`` whenever the option has a default, X as an operator would type it
(an integer never as ``14400000.0``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from typing import Any, Iterator

from twisted.trial.unittest import TestCase

from relayd.buzz.core import contract
from relayd.cli import admin
from relayd.cli import broker as broker_admin
from relayd.cli.broker import NEEDS_A_CHANNEL
from relayd.tap import Options, all_settings

# The unit each numeric setting declares as its metavar, and the word its help must use for it.
UNIT_WORDS = {"SECONDS": "seconds", "MS": "milliseconds", "BYTES": "bytes", "N": None, "PORT": None}


def _style_problems(where: str, text: str | None) -> list[str]:
    """What is wrong with one help text: empty, not sentence case, a closing full stop."""
    if not text or not text.strip():
        return [f"{where}: no help text"]
    problems = []
    if not text[0].isupper():
        problems.append(f"{where}: not sentence case: {text!r}")
    if text.rstrip().endswith("."):
        problems.append(f"{where}: ends with a full stop: {text!r}")
    if "  " in text or text != text.strip():
        problems.append(f"{where}: stray spaces: {text!r}")
    return problems


def _typed(value: Any, separator: str) -> str:
    """How an operator types a default (the expectation, written out independently of relayd)."""
    if isinstance(value, list):
        return separator.join(_typed(v, separator) for v in value)
    if isinstance(value, float) and value == int(value):
        return str(int(value))
    return str(value)


def _numeric(setting: Any) -> bool:
    """Whether a setting's value is a number (from its default, or from what its parser makes of "1")."""
    if isinstance(setting.default, bool) or setting.switch:
        return False
    if isinstance(setting.default, (int, float)):
        return True
    try:
        return isinstance(setting.parse("1"), (int, float))
    except (ValueError, TypeError):
        return False


class TwistdHelp(TestCase):
    """``twistd relayd --help``: the settings tables and the help lines built from them."""

    def test_every_setting_has_a_help_text_in_the_style(self) -> None:
        problems = [p for s in all_settings() for p in _style_problems(f"--{s.name}", s.help)]
        # A default is shown by the formatter, once, at the end; a help text does not spell its own.
        problems += [f"--{s.name}: spells its default" for s in all_settings() if "[default:" in s.help]
        self.assertEqual(problems, [])

    def test_every_number_names_its_unit(self) -> None:
        problems = []
        for s in all_settings():
            if not _numeric(s):
                continue
            if s.metavar not in UNIT_WORDS:
                problems.append(f"--{s.name}: metavar {s.metavar!r} is not a unit ({', '.join(UNIT_WORDS)})")
                continue
            word = UNIT_WORDS[s.metavar]
            if word is not None and word not in s.help.lower():
                problems.append(f"--{s.name}: help does not say {word!r}: {s.help!r}")
        self.assertEqual(problems, [])

    def test_every_duration_is_named_with_its_unit(self) -> None:
        """Issue 26: an option in milliseconds says so in its name (``-ms``); seconds, the unit of every
        other duration, is the one a name leaves unsaid (its help and metavar say it). Old names are
        deprecated aliases (``replaced_by``) of the one with the unit."""
        problems = []
        for s in all_settings():
            if s.replaced_by is not None:
                assert s.metavar == next(n for n in all_settings() if n.name == s.replaced_by).metavar, s.name
                continue
            if s.metavar == "MS" and not s.name.endswith("-ms"):
                problems.append(f"--{s.name}: in milliseconds, but its name does not end in -ms")
            if s.name.endswith("-ms") and s.metavar != "MS":
                problems.append(f"--{s.name}: named -ms, but its metavar is {s.metavar!r}")
            if s.metavar == "SECONDS" and s.name.endswith(("-s", "-sec", "-seconds")):
                problems.append(f"--{s.name}: seconds are the unsaid unit")
        self.assertEqual(problems, [])

    def test_every_default_is_shown_as_typed(self) -> None:
        problems = []
        for s in all_settings():
            doc = getattr(Options, "opt_" + s.name.replace("-", "_")).__doc__
            shown = re.findall(r"\[default: ([^\]]*)\]", doc)
            if s.default_help is not None:
                expected = [s.default_help]
            elif s.switch or s.default is None or s.default in ("", []):
                expected = []  # nothing to show: off, unset, empty
            else:
                expected = [_typed(s.default, " " if s.repeatable else ",")]
            if shown != expected:
                problems.append(f"--{s.name}: shows {shown}, expected {expected}")
            elif not doc.endswith("]" if expected else doc[-1]):
                problems.append(f"--{s.name}: the default is not last: {doc!r}")
        self.assertEqual(problems, [])

    def test_integer_defaults_print_without_a_fraction(self) -> None:
        text = " ".join(str(Options(environ={})).split())
        self.assertEqual(re.findall(r"\[default: [0-9]+\.0\]", text), [])
        self.assertIn("[default: 14400000]", text)  # --mcp-ttl-ms
        self.assertIn("[default: 0]", text)  # --trust-forwarded-for: 0 is a default too

    def test_help_and_version_lines_follow_the_style(self) -> None:
        text = str(Options(environ={}))
        self.assertIn("-h, --help", text)
        for name in ("help", "version"):
            doc = getattr(Options, "opt_" + name).__doc__
            self.assertEqual(_style_problems(f"--{name}", doc), [])


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """C{parser} and every parser below it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _parsers(child)


def _admin_parsers() -> list[argparse.ArgumentParser]:
    return [*_parsers(admin._parser()), *_parsers(broker_admin._parser())]


def _rendered(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """An action's help as C{--help} prints it (argparse's formatter, without the wrapping)."""
    return parser._get_formatter()._expand_help(action)


def _has_default(action: argparse.Action) -> bool:
    if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return False
    d = action.default
    return not (d is None or d is argparse.SUPPRESS or isinstance(d, bool) or d in ([], ""))


class AdminHelp(TestCase):
    """``relayd-admin`` and its broker tools: every parser, every option, every subcommand."""

    def test_every_option_and_subcommand_has_a_help_text_in_the_style(self) -> None:
        problems = []
        for parser in _admin_parsers():
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    for choice in action._choices_actions:  # the subcommands' one-line help
                        problems += _style_problems(f"{parser.prog} {choice.dest}", choice.help)
                    continue
                where = f"{parser.prog} {'/'.join(action.option_strings) or action.dest}"
                problems += _style_problems(where, action.help)
            if parser.description:
                problems += _style_problems(f"{parser.prog} (description)", parser.description)
        self.assertEqual(problems, [])

    def test_every_default_is_shown(self) -> None:
        problems = []
        for parser in _admin_parsers():
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction) or action.help is argparse.SUPPRESS:
                    continue
                rendered = _rendered(parser, action)
                where = f"{parser.prog} {'/'.join(action.option_strings) or action.dest}"
                if _has_default(action):
                    expected = f"[default: {_typed(action.default, ',')}]"
                    if expected not in rendered and "[default:" not in (action.help or ""):
                        problems.append(f"{where}: {rendered!r} does not show {expected}")
                if rendered.count("[default:") > 1:
                    problems.append(f"{where}: shows two defaults: {rendered!r}")
                if "[default:" in rendered and not rendered.endswith("]"):
                    problems.append(f"{where}: the default is not last: {rendered!r}")
        self.assertEqual(problems, [])

    def test_integer_defaults_print_without_a_fraction(self) -> None:
        for parser in _admin_parsers():
            text = " ".join(parser.format_help().split())
            self.assertEqual(re.findall(r"\[default: [^\]]*\b[0-9]+\.0\]", text), [], parser.prog)
            self.assertNotIn("[default: None]", text, parser.prog)
        connect = next(p for p in _admin_parsers() if p.prog == "relayd-admin mcp connect")
        self.assertIn("[default: 15]", " ".join(connect.format_help().split()))

    def test_every_command_knows_its_name_for_errors(self) -> None:
        """Each runnable command carries its prog, so a failure while running names it as argparse does."""
        leaves = [p for p in _admin_parsers() if not any(isinstance(a, argparse._SubParsersAction) for a in p._actions)]
        for parser in leaves:
            if parser.prog == "relayd-admin broker":
                continue  # the placeholder handing everything to relayd.cli.broker
            self.assertEqual(parser.get_default("prog"), parser.prog)

    def test_broker_issue_help_names_the_nine_actions(self) -> None:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(admin.main(["broker", "issue", "--help"]), 0)
        text = " ".join(out.getvalue().split())
        self.assertEqual(len(contract.ACTIONS), 9)
        missing = [a for a in contract.ACTIONS if a not in text]
        self.assertEqual(missing, [])
        # and which of them need --channel (NEEDS_A_CHANNEL: issue refuses them without one)
        needs = text[text.index("--actions LIST Comma-separated") : text.index("(these need --channel)")]
        self.assertEqual(sorted(a for a in contract.ACTIONS if a in needs), sorted(NEEDS_A_CHANNEL))
