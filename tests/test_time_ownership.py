"""Only relayd/base/clock.py reads the time or schedules a call; only relayd/base/reactor.py imports the reactor.

Everything else goes through the L{relayd.base.clock.Timekeeper} it is handed (tests hand it a C{task.Clock},
so a test fixes every timestamp, duration and timer) and gets the reactor from
L{relayd.base.reactor.installed}. A module that reads the time or schedules a call by itself escapes both
the test clock and the clock's shutdown, which cancels every pending timer.

What the scan refuses, outside relayd/base/clock.py (docs/architecture.md "Checks"):

  - reading the time from the C{time} module: C{time.time}, C{time.time_ns}, C{time.monotonic},
    C{time.monotonic_ns} (called or handed on as a default), and C{time.sleep} (it blocks the
    reactor), however imported;
  - C{datetime.now}, C{datetime.utcnow}, C{datetime.today}, C{date.today};
  - C{callLater} and C{addTimeout}, spelled anywhere (a reactor's, a protocol's, a Deferred's);
  - C{twisted.internet.task} (C{LoopingCall}, C{deferLater}, C{Clock}, C{cooperate}) and
    C{TimerService}: L{Timekeeper.looping_call}, L{Timekeeper.call_later}, L{Timekeeper.timer_service}, L{NextTurn};
  - importing the global reactor (C{from twisted.internet import reactor}) outside relayd/base/reactor.py.

Allowed: C{time.perf_counter} (how long relayd's own code ran, for a metric: a test clock does not
advance while code runs, so it could not stand in) and C{datetime.fromtimestamp} (formats a time it
is given). The command-line tools are no exception: they block rather than run a reactor, and wait
and read the time through the L{relayd.base.clock.BlockingClock} they are handed.
"""

from __future__ import annotations

import ast
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

import relayd

_PACKAGE = Path(relayd.__file__).parent

_TIME_READS = frozenset({"time", "time_ns", "monotonic", "monotonic_ns", "sleep"})
_DATETIME_READS = frozenset({"now", "utcnow", "today"})
_TASK_MODULE = "twisted.internet.task"
_SCHEDULERS = frozenset({"LoopingCall", "deferLater", "TimerService", "cooperate", "Cooperator"})


def offences(source: str, relative: str) -> list[str]:
    """Where C{source} (relayd/C{relative}) reads the time, schedules a call or imports the reactor."""
    if relative == "base/clock.py":
        return []
    tree = ast.parse(source)
    time_names: set[str] = set()  # what `from time import ...` bound
    found: list[tuple[int, int, str]] = []

    def flag(node: ast.AST, what: str) -> None:
        line, column = getattr(node, "lineno", 0), getattr(node, "col_offset", 0)
        found.append((line, column, f"{relative}:{line}: {what}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if node.module == "time" and alias.name in _TIME_READS:
                    time_names.add(alias.asname or alias.name)
                    flag(node, f"time.{alias.name}")
                elif node.module == _TASK_MODULE or (node.module == "twisted.internet" and alias.name == "task"):
                    flag(node, f"{_TASK_MODULE} import {alias.name}")
                elif alias.name in _SCHEDULERS:
                    flag(node, f"{node.module} import {alias.name}")
                elif node.module == "twisted.internet" and alias.name == "reactor" and relative != "base/reactor.py":
                    flag(node, "the global reactor (relayd.base.reactor.installed)")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == _TASK_MODULE:
                    flag(node, f"import {_TASK_MODULE}")
                elif alias.name == "twisted.internet.reactor" and relative != "base/reactor.py":
                    flag(node, "the global reactor (relayd.base.reactor.installed)")
        elif isinstance(node, ast.Attribute):
            owner = node.value
            owner_name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if node.attr in ("callLater", "addTimeout"):
                flag(node, node.attr)
            elif owner_name == "time" and node.attr in _TIME_READS:
                flag(node, f"time.{node.attr}")
            elif owner_name in ("datetime", "date") and node.attr in _DATETIME_READS:
                flag(node, f"{owner_name}.{node.attr}")
            elif owner_name == "task" and node.attr in _SCHEDULERS | {"Clock"}:
                flag(node, f"task.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in time_names and isinstance(node.ctx, ast.Load):
            flag(node, f"time.{node.id}")
    return [offence for _, _, offence in sorted(found)]  # in source order (ast.walk goes breadth first)


class TimeOwnership(SynchronousTestCase):
    def test_only_the_clock_reads_the_time_or_schedules(self) -> None:
        found = [
            offence
            for path in sorted(_PACKAGE.rglob("*.py"))
            for offence in offences(path.read_text(), path.relative_to(_PACKAGE).as_posix())
        ]
        self.assertEqual(found, [], "go through relayd.base.clock.Timekeeper (or relayd.base.reactor.installed)")

    def test_the_scan_sees_every_spelling(self) -> None:
        sample = (
            "import time\n"
            "from time import monotonic as mono, perf_counter\n"
            "from datetime import datetime\n"
            "from twisted.internet import reactor, task\n"
            "from twisted.internet.task import LoopingCall\n"
            "from twisted.application.internet import TimerService\n"
            "def f(clock, now=time.time):\n"
            "    time.sleep(1)\n"
            "    reactor.callLater(0, f)\n"
            "    getter = clock.reactor.callLater\n"
            "    d.addTimeout(1, reactor)\n"
            "    return mono(), perf_counter(), datetime.now(), datetime.fromtimestamp(0), task.deferLater\n"
        )
        self.assertEqual(
            [o.split(": ", 1)[1] for o in offences(sample, "web/sample.py")],
            [
                "time.monotonic",
                "the global reactor (relayd.base.reactor.installed)",
                f"{_TASK_MODULE} import task",
                f"{_TASK_MODULE} import LoopingCall",
                "twisted.application.internet import TimerService",
                "time.time",
                "time.sleep",
                "callLater",
                "callLater",
                "addTimeout",
                "time.mono",
                "datetime.now",
                "task.deferLater",
            ],
        )

    def test_the_clock_and_the_reactor_module_are_the_exceptions(self) -> None:
        self.assertEqual(offences("import time\nt = time.time()\n", "base/clock.py"), [])
        self.assertEqual(offences("from twisted.internet import reactor\n", "base/reactor.py"), [])
        self.assertEqual(len(offences("from twisted.internet import reactor\n", "tap.py")), 1)

    def test_a_command_line_tool_is_no_exception(self) -> None:
        # The tools block rather than run a reactor: they wait and read time through a BlockingClock.
        source = "import time\ntime.sleep(1)\nd = time.monotonic()\nt = time.time()\n"
        self.assertEqual(len(offences(source, "cli/aep.py")), 3)
