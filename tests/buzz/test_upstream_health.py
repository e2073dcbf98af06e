"""Issue 11: the broker says when its Nostr relay cannot be reached, and when it is back.

L{Upstream} on a fake clock against real sockets: a port that was listening and is closed (refused),
a port that accepts and never answers the handshake, then a real nostr-relay started on the closed
port. The per-identity connections' retry lines (L{NostrRelayPool}) are rate-limited and carry no
autobahn "Starting factory" lines. End to end, a real C{twistd -n relayd} broker reports the
outage in its log, C{/healthz} and C{relayd-admin status}, then the recovery.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from typing import Any

import treq
from twisted.internet import defer, protocol, reactor, task
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from relayd.base.clock import Timekeeper
from relayd.buzz import nostr
from relayd.buzz.core import contract
from relayd.buzz.nostr_upstream import NostrRelayPool, NotConnected
from relayd.buzz.upstream import LOOK_AGAIN, REPEAT_EVERY, STABLE, START_WARNING, Throttle, Upstream, public_url
from tests.buzz.harness import issue, new_channel
from tests.support.command import Command
from tests.support.skips import require_module
from tests.support.twistd import RelaydProcess

FACTORY_LINES = ("Starting factory", "Stopping factory")


def closed_port() -> int:
    """A port on 127.0.0.1 that was listening a moment ago and is closed now (connections are refused)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port: int = s.getsockname()[1]
    s.close()
    return port


class Lines:
    """Every log event published while the test runs, formatted."""

    def __init__(self, test: TestCase) -> None:
        self.events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(self.events.append)
        test.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def text(self) -> list[str]:
        return [formatEvent(e) for e in self.events]

    def about(self, namespace: str) -> list[str]:
        return [formatEvent(e) for e in self.events if e.get("log_namespace") == namespace]

    def factory_lines(self) -> list[str]:
        return [t for t in self.text() if any(marker in t for marker in FACTORY_LINES)]


def nostr_relay_on(test: TestCase, port: int) -> Any:
    """A real nostr-relay (not started) that will serve C{port}; stopped at cleanup."""
    require_module("nostr_relay", "needs a real Nostr relay")
    from tests.support.nostr import NostrRelay

    workdir = tempfile.mkdtemp(prefix="relayd-upstream-")
    test.addCleanup(shutil.rmtree, workdir, ignore_errors=True)
    relay = NostrRelay(workdir)
    relay.port = port
    test.addCleanup(relay.stop)
    return relay


class PublicURL(TestCase):
    def test_credentials_query_and_fragment_are_left_out(self) -> None:
        self.assertEqual(public_url("wss://user:pw@relay.example:444/nostr?token=x#f"), "wss://relay.example:444/nostr")
        self.assertEqual(public_url("ws://127.0.0.1:7447"), "ws://127.0.0.1:7447")
        self.assertEqual(public_url("ws://[::1]:7447/"), "ws://[::1]:7447/")

    def test_an_unparseable_url_is_not_quoted(self) -> None:
        self.assertEqual(public_url("ws://h:notaport"), "(unparseable relay URL)")


class ThrottleBoundaries(TestCase):
    def test_one_line_per_interval_exactly_at_the_limit_and_one_under(self) -> None:
        fake = task.Clock()
        throttle = Throttle(Timekeeper(fake), 60.0)
        self.assertEqual(throttle.allow(), 0)
        fake.advance(59.999)
        self.assertIsNone(throttle.allow())
        self.assertIsNone(throttle.allow())
        fake.advance(0.001)  # exactly the interval: let through, with the two held back
        self.assertEqual(throttle.allow(), 2)
        self.assertIsNone(throttle.allow())


class UpstreamMonitor(TestCase):
    """L{Upstream} on a C{task.Clock}; connection attempts are real."""

    timeout = 30

    def monitor(self, port: int, **kw: Any) -> tuple[Upstream, task.Clock]:
        fake = task.Clock()
        upstream = Upstream(f"ws://user:hunter2@127.0.0.1:{port}", reactor, Timekeeper(fake), **kw)
        self.addCleanup(upstream.stop)
        return upstream, fake

    async def test_refused_at_start_warns_once_with_the_url_and_no_secret(self) -> None:
        lines = Lines(self)
        port = closed_port()
        upstream, fake = self.monitor(port)
        first = upstream.next_outcome()
        upstream.start()
        self.assertFalse(await first)
        warnings = lines.about("relayd.buzz.upstream")
        self.assertEqual(len(warnings), 1, warnings)
        self.assertIn(f"upstream relay ws://127.0.0.1:{port} unreachable", warnings[0])
        self.assertIn("refused", warnings[0])
        self.assertNotIn("hunter2", " ".join(lines.text()))
        health = upstream.status()
        self.assertEqual((health["url"], health["connected"]), (f"ws://127.0.0.1:{port}", False))
        self.assertIn("refused", health["last_error"])
        # The start check finds the outage already reported: no second line.
        fake.advance(START_WARNING)
        self.assertEqual(len(lines.about("relayd.buzz.upstream")), 1)

    async def test_retries_are_quiet_and_an_outage_is_repeated_once_a_minute(self) -> None:
        lines = Lines(self)
        upstream, fake = self.monitor(closed_port(), backoff_base=1.0, backoff_cap=8.0)
        first = upstream.next_outcome()
        upstream.start()
        await first
        elapsed = 0.0
        while elapsed + 8.0 < REPEAT_EVERY:  # retries at 1, 2, 4, 8, 8, ... seconds: all within a minute
            delay = min(8.0, 2.0 ** (upstream.failures - 1))
            outcome = upstream.next_outcome()
            fake.advance(delay)
            elapsed += delay
            self.assertFalse(await outcome)
        self.assertGreater(upstream.failures, 5)
        self.assertEqual(len(lines.about("relayd.buzz.upstream")), 1)
        self.assertEqual(lines.factory_lines(), [])
        # The first retry a minute after the first line says the outage goes on, once.
        outcome = upstream.next_outcome()
        fake.advance(REPEAT_EVERY - elapsed + 8.0)
        self.assertFalse(await outcome)
        said = lines.about("relayd.buzz.upstream")
        self.assertEqual(len(said), 2, said)
        self.assertIn("still unreachable after", said[1])
        self.assertEqual(lines.factory_lines(), [])

    async def test_an_action_during_an_outage_looks_again_at_most_once_a_second(self) -> None:
        """outage() names the outage, and an asking action re-checks now instead of after the backoff."""
        upstream, fake = self.monitor(closed_port(), backoff_base=30.0, backoff_cap=30.0)
        self.assertIsNone(upstream.outage())  # not checked yet: no verdict on the relay
        first = upstream.next_outcome()
        upstream.start()
        self.assertFalse(await first)
        attempts: list[float] = []
        connect = upstream._connect
        self.patch(upstream, "_connect", lambda: (attempts.append(fake.seconds()), connect()))
        outcome = upstream.next_outcome()
        self.assertIn("unreachable since", upstream.outage() or "")
        fake.advance(LOOK_AGAIN - 0.001)
        upstream.outage()
        self.assertEqual(attempts, [])  # the attempt just failed: no new one within LOOK_AGAIN
        fake.advance(0.001)
        upstream.outage()  # a second after the last attempt, 29 s before the backoff's: look again now
        self.assertEqual(attempts, [LOOK_AGAIN])
        self.assertFalse(await outcome)
        self.assertEqual(upstream.failures, 2)

    async def test_a_handshake_that_does_not_complete_warns_after_the_start_delay(self) -> None:
        silent = protocol.Factory.forProtocol(protocol.Protocol)
        silent.noisy = False
        listening = reactor.listenTCP(0, silent, interface="127.0.0.1")
        self.addCleanup(listening.stopListening)
        lines = Lines(self)
        upstream, fake = self.monitor(listening.getHost().port, connect_timeout=10.0)
        upstream.start()
        fake.advance(START_WARNING - 0.001)
        self.assertEqual(lines.about("relayd.buzz.upstream"), [])
        fake.advance(0.001)
        (warning,) = lines.about("relayd.buzz.upstream")
        self.assertIn(f"not reachable {START_WARNING:g}s after start (still connecting)", warning)
        self.assertFalse(upstream.status()["connected"])

    async def test_reachable_again_once_a_real_relay_listens(self) -> None:
        port = closed_port()
        relay = nostr_relay_on(self, port)
        lines = Lines(self)
        upstream, fake = self.monitor(port)
        first = upstream.next_outcome()
        upstream.start()
        self.assertFalse(await first)
        relay.start()  # the socket listens at once; the handshake waits for the relay to start
        outcome = upstream.next_outcome()
        fake.advance(1.0)
        self.assertTrue(await outcome)
        health = upstream.status()
        self.assertEqual((health["connected"], health["url"]), (True, f"ws://127.0.0.1:{port}"))
        said = lines.about("relayd.buzz.upstream")
        self.assertEqual(len(said), 2, said)
        self.assertRegex(said[1], r"upstream relay ws://127\.0\.0\.1:\d+ reachable again after \d+s")
        # A connection that stayed up a while and drops (a relay restart) is reopened at once,
        # without a word.
        fake.advance(STABLE)
        dropped = upstream.next_outcome()
        relay.stop()
        relay.start()
        self.assertFalse(await dropped)
        reopened = upstream.next_outcome()
        self.assertTrue(await reopened)
        self.assertEqual(len(lines.about("relayd.buzz.upstream")), 2)
        # One that drops at once counts as a failing attempt: backoff, and the throttle (the last
        # line was less than a minute ago) keeps the log quiet.
        dropped = upstream.next_outcome()
        relay.stop()
        self.assertFalse(await dropped)
        health = upstream.status()
        self.assertFalse(health["connected"])
        self.assertIn("connection lost", health["last_error"])
        self.assertEqual(len(lines.about("relayd.buzz.upstream")), 2)
        failed = upstream.next_outcome()
        fake.advance(REPEAT_EVERY)
        self.assertFalse(await failed)
        said = lines.about("relayd.buzz.upstream")
        self.assertEqual(len(said), 3, said)
        self.assertIn("unreachable (Connection was refused", said[2])


class PoolRetryLines(TestCase):
    async def test_identity_connection_retries_log_one_line_a_minute_and_no_factory_lines(self) -> None:
        lines = Lines(self)
        fake = task.Clock()
        pool = NostrRelayPool(f"ws://127.0.0.1:{closed_port()}", reactor, Timekeeper(fake), connect_timeout=5.0)
        self.addCleanup(pool.close)
        conns = [pool.connection(nostr.Signer(bytes([i]) * 32)) for i in (1, 2, 3)]
        for _ in range(3):  # three rounds of failing attempts on three identities
            for conn in conns:
                waiting = conn.ensure_ready(5.0)
                attempt = conn._connect_d
                if attempt is None:  # backing off: the attempt is scheduled on the clock
                    fake.advance(max(0.0, conn._next_attempt - fake.seconds()))
                    attempt = conn._connect_d
                done: defer.Deferred[None] = defer.Deferred()
                attempt.addBoth(lambda r, done=done: (done.callback(None), r)[1])
                await done
                fake.advance(5.0)  # the demand times out
                with self.assertRaises(NotConnected):
                    await waiting
        said = [t for t in lines.text() if "unavailable for" in t]
        self.assertEqual(len(said), 1, said)
        self.assertEqual(lines.factory_lines(), [])
        fake.advance(REPEAT_EVERY)
        conn = conns[0]
        waiting = conn.ensure_ready(5.0)
        done = defer.Deferred()
        conn._connect_d.addBoth(lambda r: (done.callback(None), r)[1])
        await done
        said = [t for t in lines.text() if "unavailable for" in t]
        self.assertEqual(len(said), 2, said)
        self.assertRegex(said[1], r"\(\d+ more such lines held back\)")
        fake.advance(5.0)
        with self.assertRaises(NotConnected):
            await waiting


class BrokerProcessHealth(TestCase):
    """A real C{twistd -n relayd} broker whose relay is down at start, then comes up."""

    timeout = 90

    async def test_log_healthz_and_status_follow_the_relay(self) -> None:
        port = closed_port()
        relay = nostr_relay_on(self, port)
        state = tempfile.mkdtemp(prefix="relayd-upstream-state-")
        self.addCleanup(shutil.rmtree, state, ignore_errors=True)
        kek_file = os.path.join(state, "kek")
        with open(kek_file, "w") as f:
            f.write(os.urandom(32).hex())
        proc = await RelaydProcess.start(
            ["--no-aep", "--no-mcp", "--broker-listen", "tcp:0:interface=127.0.0.1",
             "--broker-nostr-relay", f"ws://127.0.0.1:{port}", "--broker-state-dir", state,
             "--broker-kek-file", kek_file],
            wait_for=("broker",),
        )
        self.addCleanup(proc.kill)
        broker = f"http://127.0.0.1:{proc.port('broker')}"
        await proc.wait_for(rb"upstream relay ws://127\.0\.0\.1:%d unreachable" % port)
        pool = HTTPConnectionPool(reactor, persistent=False)

        async def health() -> dict[str, Any]:
            response = await treq.get(broker + "/healthz", pool=pool)
            self.assertEqual(response.code, 200)
            self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"application/json"])
            return json.loads(await treq.content(response))

        down = await health()
        self.assertEqual((down["ok"], down["status"]), (True, "degraded"))
        self.assertEqual((down["upstream"]["url"], down["upstream"]["connected"]), (f"ws://127.0.0.1:{port}", False))
        self.assertIn("refused", down["upstream"]["last_error"])
        status = Command.admin("status", "--broker", broker)
        self.assertEqual(await status.finished(), 0, status.stderr)
        self.assertRegex(status.stdout, rb"broker +degraded .*upstream\.connected=False")
        self.assertIn(b"upstream.last_error=", status.stdout)

        # While /healthz says degraded, an action answers at once (not after its timeout), saying why.
        credential = issue(state, "--agent", "bot", "--channel", new_channel(), kek_file=kek_file)["credential"]

        async def post(action: str, args: dict[str, Any]) -> dict[str, Any]:
            req = contract.build_request(action, args, f"r-{os.urandom(8).hex()}")
            response = await treq.post(
                broker + "/v1/action", data=contract.freeze(req), pool=pool,
                headers={b"content-type": [b"application/json"], b"authorization": [b"Bearer " + credential.encode()]},
            )
            self.assertEqual(response.code, 200)
            return json.loads(await treq.content(response))

        refused = await post("profile.set", {"displayName": "bot"})
        self.assertEqual((refused["status"], refused["error"]["code"]), ("failed", "internal"), refused)
        self.assertRegex(refused["error"]["message"], r"^relay unavailable: the upstream relay has been unreachable since ")

        relay.start()
        await proc.wait_for(rb"upstream relay ws://127\.0\.0\.1:%d reachable again" % port, timeout=60)
        up = await health()
        self.assertEqual((up["status"], up["upstream"]["connected"]), ("ok", True))
        self.assertEqual((await post("profile.set", {"displayName": "bot"}))["status"], "succeeded")
        status = Command.admin("status", "--broker", broker, "--json")
        self.assertEqual(await status.finished(), 0, status.stderr)
        report = json.loads(status.stdout)["broker"]
        self.assertEqual((report["up"], report["status"], report["upstream"]["connected"]), (True, "ok", True))

        self.assertEqual(await proc.terminate(), 0)
        text = proc.log.decode()
        self.assertEqual(text.count("unreachable ("), 1, text)  # one line for the outage, not one per retry
        for marker in FACTORY_LINES:
            self.assertNotIn(marker, text)
