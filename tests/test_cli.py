"""relayd/cli/: the relayd-admin tools wait and measure time through the clock they are handed
(relayd.base.clock.BlockingClock), never the system's directly, and share one integer parser with the
settings (relayd.base.config.integer_at_least) while each keeps its own wording."""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
from contextlib import redirect_stderr

from twisted.trial.unittest import TestCase

from relayd import cli
from relayd.base import config
from relayd.base.clock import BlockingClock
from relayd.cli import admin, non_negative_int, positive_int
from relayd.cli.aep import Tail
from relayd.cli.broker import main as broker_main
from relayd.cli.client import Stopped, Target
from relayd.cli.mcp import McpEndpoints, McpSession


class FakeClock(BlockingClock):
    """Time that moves only when a tool waits; records every wait, and stops the tool after C{stop_after}."""

    def __init__(self, stop_after: int = 1000) -> None:
        self.time = 0.0
        self.slept: list[float] = []
        self.stop_after = stop_after

    def monotonic(self) -> float:
        return self.time

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.time += seconds
        if len(self.slept) >= self.stop_after:
            raise Stopped()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ToolsWaitOnTheirClock(TestCase):
    def setUp(self) -> None:
        # main() installs SIGINT/SIGTERM handlers for the tools; put the test runner's back.
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.addCleanup(signal.signal, signum, signal.getsignal(signum))

    def test_tail_backs_off_on_the_clock_between_reconnects(self) -> None:
        clock = FakeClock(stop_after=5)
        err = io.StringIO()
        tail = Tail(Target.parse(f"http://127.0.0.1:{closed_port()}"), None, clock=clock, err=err, retry_max=2.0)
        self.assertRaises(Stopped, tail.run)
        self.assertEqual(clock.slept, [0.4, 0.8, 1.6, 2.0, 2.0])  # doubling, capped at --retry-max
        self.assertIn("reconnecting in 0.4s", err.getvalue())

    def test_tail_progress_lines_follow_the_clock(self) -> None:
        clock = FakeClock()
        err = io.StringIO()
        tail = Tail(Target.parse("http://127.0.0.1:1"), None, clock=clock, err=err, progress_every=10.0)
        clock.time = 100.0
        tail.report_progress()
        clock.time = 105.0
        tail.report_progress()  # within --progress of the last line: nothing
        clock.time = 110.0
        tail.report_progress()
        self.assertEqual(err.getvalue().count("tail: 0 events, 0 sessions"), 2)

    def test_post_retries_a_batch_after_waits_on_the_clock(self) -> None:
        fd, path = tempfile.mkstemp(suffix=".ndjson")
        os.write(fd, b'{"type":"x"}\n')
        os.close(fd)
        self.addCleanup(os.unlink, path)
        clock = FakeClock()
        err = io.StringIO()
        with redirect_stderr(err):
            status = admin.main(["aep", "post", f"http://127.0.0.1:{closed_port()}", path, "--retries", "3"], clock)
        self.assertEqual(status, 1, err.getvalue())
        self.assertEqual(clock.slept, [0.2, 0.4, 0.8])
        self.assertIn("relayd-admin aep post: error: batch 1 (1 events) got no answer", err.getvalue())

    def test_mcp_answer_deadline_is_read_on_the_clock(self) -> None:
        class Late(FakeClock):
            def monotonic(self) -> float:  # every reading 20 seconds on
                self.time += 20.0
                return self.time

        session = McpSession(McpEndpoints("http://127.0.0.1:1", "S", "T"), timeout=15.0, clock=Late())
        answered: list[object] = []
        # Past the deadline on the tool's clock, the wait ends at once (the system clock has not moved).
        waiter = threading.Thread(target=lambda: answered.append(session.await_id(1)))
        waiter.start()
        waiter.join(5.0)
        self.assertFalse(waiter.is_alive(), "await_id waited on the system clock")
        self.assertEqual(answered, [None])


class BrokerToolStampsOnItsClock(TestCase):
    """relayd-admin broker: what it issues is stamped, and its expiry judged, on the clock it is handed."""

    def test_issue_and_list_read_the_wall_on_the_clock(self) -> None:
        clock = FakeClock()
        clock.wall = lambda: 2_000_000_000.0  # type: ignore[method-assign]
        state = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, state)
        out = io.StringIO()
        base = ["broker", "issue", "--state-dir", state, "--agent", "a", "--actions", "profile.set"]
        with redirect_stderr(io.StringIO()):
            self.assertEqual(admin.main([*base, "--expires", "90s"], clock=clock), 0)
        clock.wall = lambda: 2_000_000_091.0  # type: ignore[method-assign]
        self.assertEqual(broker_main(["list", "--state-dir", state], out, io.StringIO(), clock=clock), 0)
        listed = json.loads(out.getvalue().splitlines()[0])
        self.assertEqual(
            (listed["createdAt"], listed["expiresAt"], listed["expired"]), (2_000_000_000, 2_000_000_090, True)
        )


class OneIntegerParser(TestCase):
    """The settings and relayd-admin parse integers with the same function, each in its own words."""

    def test_admin_wording(self) -> None:
        self.assertEqual(positive_int(" 7 "), 7)
        self.assertEqual(non_negative_int("0"), 0)
        for parse, text, message in (
            (positive_int, "0", "'0' must be a positive integer"),
            (positive_int, "ten", "'ten' is not an integer"),
            (non_negative_int, "-1", "'-1' must be 0 or more"),
            (non_negative_int, "1.5", "'1.5' is not an integer"),
        ):
            with self.assertRaises(argparse.ArgumentTypeError) as raised:
                parse(text)
            self.assertEqual(str(raised.exception), message)

    def test_settings_wording(self) -> None:
        self.assertEqual(config.positive_int(" 7 "), 7)
        for parse, text, message in (
            (config.positive_int, "0", "must be a positive integer"),
            (config.positive_int, "ten", "must be an integer"),
            (config.non_negative_int, "-1", "must be a non-negative integer"),
        ):
            with self.assertRaises(ValueError) as raised:
                parse(text)
            self.assertEqual(str(raised.exception), message)

    def test_one_implementation(self) -> None:
        calls: list[tuple[str, int]] = []
        original = config.integer_at_least

        def spy(text: str, minimum: int, *args: str) -> int:
            calls.append((text, minimum))
            return original(text, minimum, *args)

        self.patch(config, "integer_at_least", spy)
        self.patch(cli, "integer_at_least", spy)
        positive_int("3")
        config.non_negative_int("4")
        self.assertEqual(calls, [("3", 1), ("4", 0)])
