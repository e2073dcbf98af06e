"""relayd.web.admission: a site starts at most NEWCOMERS_PER_TURN connections' first requests per
reactor turn; the rest wait in arrival order, a health check and a connection served before never
wait. In memory, a turn is TurnByTurn's; over a socket, the real reactor's."""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource

from relayd.base.clock import Timekeeper
from relayd.compat import web as fence
from relayd.web.admission import NEWCOMERS_PER_TURN, Admission
from relayd.web.channel import MAX_HEADER_BYTES, RelayChannel
from relayd.web.site import RelaySite
from tests.support.inmemory import InMemorySite, TurnByTurn
from tests.support.raw import RawClient

PER_TURN = NEWCOMERS_PER_TURN


class _Hello(Resource):
    isLeaf = True

    def render_GET(self, request: Any) -> bytes:
        request.setHeader(b"content-type", b"text/plain")
        return b"hello " + request.path


class _Newcomer:
    def __init__(self, name: int, log: list[int], gone: bool = False) -> None:
        self.name, self.log, self.gone = name, log, gone

    def admitted(self) -> bool:
        if self.gone:
            return False
        self.log.append(self.name)
        return True


class AdmissionCounts(TestCase):
    def setUp(self) -> None:
        self.clock = TurnByTurn()
        self.admission = Admission(Timekeeper(self.clock), per_turn=4)

    def storm(self, count: int, log: list[int], gone: frozenset[int] = frozenset()) -> list[int]:
        """C{count} newcomers in one turn: those started at once."""
        now = []
        for n in range(count):
            if self.admission.starts_now():
                now.append(n)
            else:
                self.admission.wait(_Newcomer(n, log, n in gone))
        return now

    def test_a_turn_starts_its_share_and_each_next_turn_the_next_slice_in_order(self) -> None:
        log: list[int] = []
        self.assertEqual(self.storm(11, log), [0, 1, 2, 3])
        slices = []
        while self.clock.getDelayedCalls():
            self.clock.turn()
            slices.append(list(log))
            log.clear()
        self.assertEqual(slices, [[4, 5, 6, 7], [8, 9, 10], []])
        self.assertEqual(self.storm(5, log), [0, 1, 2, 3])  # (a fresh count once the storm is over)

    def test_a_newcomer_that_left_while_waiting_counts_for_nothing(self) -> None:
        log: list[int] = []
        self.storm(10, log, gone=frozenset({4, 6}))
        self.clock.turn()
        self.assertEqual(log, [5, 7, 8, 9])

    def test_newer_connections_wait_behind_the_queue_even_when_the_share_is_not_spent(self) -> None:
        log: list[int] = []
        self.storm(6, log)
        self.clock.turn()  # 4 and 5 start: half the share is left, but ...
        self.assertEqual(log, [4, 5])
        self.assertTrue(self.admission.starts_now())  # (nobody waits now: a newcomer starts)

    def test_connections_arriving_one_per_turn_arm_no_timer(self) -> None:
        # (A client opening a connection per request must not pay a timer per connection.)
        self.assertTrue(self.admission.starts_now())
        self.assertEqual(self.clock.getDelayedCalls(), [])
        self.assertTrue(self.admission.starts_now())  # half the share: the reset is armed
        self.assertEqual(len(self.clock.getDelayedCalls()), 1)
        self.clock.turn()
        self.assertEqual(self.admission.started, 0)


class InMemoryStorm(TestCase):
    """The site's channel: what each connection receives is what it would have got at once."""

    def setUp(self) -> None:
        self.site = InMemorySite.over(_Hello(), health_paths=frozenset({b"/healthz"}))
        self.addCleanup(self.site.close)

    def storm(self, count: int) -> list[Any]:
        return [self.site.open("GET", f"/s{n}") for n in range(count)]

    def test_at_most_a_share_of_new_connections_is_answered_per_turn(self) -> None:
        connections = self.storm(3 * PER_TURN + 1)
        answered = []
        for _ in range(5):
            answered.append(sum(1 for c in connections if c.received()))
            self.site.turn()
        self.assertEqual(answered, [PER_TURN, 2 * PER_TURN, 3 * PER_TURN, 3 * PER_TURN + 1, 3 * PER_TURN + 1])
        for n, connection in enumerate(connections):
            reply = connection.reply()
            self.assertEqual((reply.code, reply.body), (200, b"hello /s%d" % n))

    def test_a_health_check_on_a_new_connection_is_answered_during_the_storm(self) -> None:
        connections = self.storm(3 * PER_TURN)
        probe = self.site.open("GET", "/healthz?deep=0")
        self.assertEqual(probe.reply().body, b"hello /healthz")
        self.assertFalse(connections[-1].received())  # the storm is not over

    def test_a_connection_served_before_never_waits(self) -> None:
        kept = self.site.open("GET", "/first")
        kept.reply()
        connections = self.storm(3 * PER_TURN)
        kept.send(b"GET /second HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual([r.body for r in kept.replies()], [b"hello /first", b"hello /second"])
        self.assertFalse(connections[-1].received())

    def test_what_a_waiting_connection_sends_meanwhile_is_read_in_order(self) -> None:
        self.storm(PER_TURN)
        waiting = self.site.connect()
        waiting.send(b"GET /a HTTP/1.1\r\nHo")
        waiting.send(b"st: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(waiting.received(), b"")
        self.site.turn()
        self.assertEqual([r.body for r in waiting.replies()], [b"hello /a", b"hello /b"])

    def test_a_connection_that_left_while_waiting_is_passed_over(self) -> None:
        self.storm(PER_TURN)
        left = self.site.open("GET", "/gone")
        after = self.site.open("GET", "/after")
        left.lose()
        self.site.turn()
        self.assertEqual(left.received(), b"")
        self.assertEqual(after.reply().body, b"hello /after")

    def test_a_connection_whose_first_request_fails_is_dropped_and_the_next_ones_start(self) -> None:
        original = RelayChannel._read

        def failing(channel: RelayChannel, data: bytes) -> None:
            if b"/broken" in data:
                raise RuntimeError("a bug")
            original(channel, data)

        self.patch(RelayChannel, "_read", failing)
        self.storm(PER_TURN)
        broken = self.site.open("GET", "/broken")
        after = self.site.open("GET", "/after")
        self.site.turn()
        self.assertTrue(broken.transport.disconnecting)
        self.assertEqual(after.reply().body, b"hello /after")
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)


class _Recording(Admission):
    """An admission that records who waited."""

    def __init__(self, clock: Timekeeper, per_turn: int) -> None:
        super().__init__(clock, per_turn)
        self.waited: list[Any] = []

    def wait(self, newcomer: Any) -> None:
        self.waited.append(newcomer)
        super().wait(newcomer)


class OverSockets(TestCase):
    """A waiting connection stops reading its socket and takes it up again on its turn."""

    async def test_connections_beyond_the_share_are_answered_on_later_turns(self) -> None:
        site = RelaySite(_Hello(), clock=Timekeeper(reactor))
        site.admission = admission = _Recording(site.clock, per_turn=2)
        port = reactor.listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        clients = []
        for _ in range(12):
            client = RawClient()
            await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port), client)
            clients.append(client)
            self.addCleanup(_close, client)
        while len(site._protocols) < len(clients):
            await deferLater(reactor, 0)  # (until the server has accepted them all)
        for n, client in enumerate(clients):  # sent together: the server reads them in one turn
            client.transport.write(b"GET /r%d HTTP/1.1\r\nHost: x\r\n\r\n" % n)
        for n, client in enumerate(clients):
            await client.wait_for(b"hello /r%d" % n)
        self.assertTrue(admission.waited, "no connection waited: the requests came in separate turns")
        for channel in admission.waited:
            self.assertIsNone(channel.kept)
            self.assertFalse(channel.newcomer)
        # They read again: a second request on a connection that waited is answered.
        waited = clients[-1]
        waited.transport.write(b"GET /again HTTP/1.1\r\nHost: x\r\n\r\n")
        await waited.wait_for(b"hello /again")

    async def test_a_waiting_connection_that_keeps_sending_stops_being_read(self) -> None:
        # A waiting connection's socket stays registered (its client sent its request and waits);
        # one that sends more than a header block's worth meanwhile is no longer read.
        site = RelaySite(_Hello(), clock=Timekeeper(reactor))
        site.admission = Admission(site.clock, per_turn=0)  # (nobody's turn comes)
        port = reactor.listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        client = RawClient()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port), client)
        self.addCleanup(_close, client)
        body = b"x" * (1024 * 1024)
        client.transport.write(b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        while not site._protocols:
            await deferLater(reactor, 0)
        (protocol,) = site._protocols
        self.addCleanup(protocol.transport.abortConnection)  # (not reading, it would not see the close)
        channel = fence.channel_of(protocol)
        while channel.kept is None or protocol.transport in reactor.getReaders():
            await deferLater(reactor, 0)  # (until the server has read enough to stop reading)
        self.assertLessEqual(sum(map(len, channel.kept)), MAX_HEADER_BYTES + 65536)  # (the read that went beyond)
        self.assertEqual(client.received, b"")


async def _close(client: RawClient) -> None:
    client.transport.loseConnection()
    await client.closed
