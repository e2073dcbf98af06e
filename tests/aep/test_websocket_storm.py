"""A WebSocket subscriber storm (issue 24): thousands of connections subscribing in one reactor turn,
each with a filter and a resume position, start a share of their subscriptions per turn through the
site's admission (relayd.web.admission, the count the HTTP channel's newcomers share), the rest in
arrival order on the next turns; a connection closed while it waits leaves nothing behind, what a
waiting connection sent after its subscribe is answered after it, and the subscribers already
connected are served meanwhile.

In memory (L{MemorySocket}: autobahn's protocol on a StringTransport, the clock turned by hand)
for the turns; over real sockets, through the wing as makeService builds it, for the whole shape."""

from __future__ import annotations

import json
import os
from typing import Any

from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from relayd.aep.core.relay import EventRelay
from relayd.aep.core.store import MemoryEventLog
from relayd.aep.websocket import AEPSocket, AEPSocketFactory
from relayd.base.clock import Timekeeper
from relayd.web.admission import NEWCOMERS_PER_TURN, Admission
from tests.support.aep import event, open_ws, start_relay
from tests.support.inmemory import TurnByTurn

PER_TURN = 4
STORM = 2 * PER_TURN + 3
SESSIONS = 3
HELD = 10  # events held per session
REPLAY = 5  # each subscription resumes this many events back
_HANDSHAKE = (
    b"GET /socket HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


def _masked(payload: bytes) -> bytes:
    """A client's text frame (RFC 6455 5.2: masked)."""
    mask = os.urandom(4)
    n = len(payload)
    head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big"))
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def _subscribe(n: int) -> dict[str, Any]:
    """Subscriber C{n}'s subscribe: its session's events, from C{REPLAY} back."""
    session = f"s{n % SESSIONS}"
    return {"type": "subscribe", "id": n, "filter": {"session": session},
            "from": [{"session": session, "epoch": 0, "seq": HELD - REPLAY - 1}]}


class MemorySocket:
    """One WebSocket connection to C{factory}'s protocol over a StringTransport (no socket): what the
    client sends is one read; what the relay sent is parsed back into messages."""

    def __init__(self, factory: AEPSocketFactory, port: int) -> None:
        peer = IPv4Address("TCP", "127.0.0.1", port)
        self.transport = StringTransport(peerAddress=peer)
        # (Under twisted.web the HTTP channel is the transport's producer until the flow takes over.)
        self.transport.registerProducer(self, True)
        self.protocol: AEPSocket = factory.buildProtocol(peer)
        self.protocol.makeConnection(self.transport)
        self.protocol.dataReceived(_HANDSHAKE)
        head = self.transport.value()
        assert head.startswith(b"HTTP/1.1 101"), head
        self._seen = head.index(b"\r\n\r\n") + 4

    def send(self, *messages: dict[str, Any]) -> None:
        self.protocol.dataReceived(b"".join(_masked(json.dumps(m).encode()) for m in messages))

    def received(self) -> list[Any]:
        """The messages the relay sent so far (text frames, parsed; the relay's pings left out)."""
        data, at, out = self.transport.value(), self._seen, []
        while at + 2 <= len(data):
            opcode, n = data[at] & 0x0F, data[at + 1] & 0x7F
            at += 2
            if n == 126:
                n, at = int.from_bytes(data[at : at + 2], "big"), at + 2
            elif n == 127:
                n, at = int.from_bytes(data[at : at + 8], "big"), at + 8
            if opcode == 1:
                message = json.loads(data[at : at + n])
                if message.get("type") != "ping":
                    out.append(message)
            at += n
        return out

    def kinds(self) -> list[Any]:
        """What was received, each as its C{type} (an event as its C{seq})."""
        return [m["seq"] if m.get("aep") else m["type"] for m in self.received()]

    def subscribed(self) -> bool:
        """Whether the relay has started a subscription of this connection."""
        return bool(getattr(self.protocol.phase, "subscriptions", None))

    def lose(self) -> None:
        self.protocol.connectionLost(Failure(ConnectionDone()))

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        pass


class SubscribeStorm(TestCase):
    def setUp(self) -> None:
        self.time = TurnByTurn()
        clock = Timekeeper(self.time)
        self.addCleanup(clock.shutdown)
        self.relay = EventRelay(MemoryEventLog(64, 16), token=None, buffer=64, max_from=10, seconds=self.time.seconds)
        self.sockets = AEPSocketFactory(self.relay, clock, heartbeat=3600.0, max_message=2**20)
        self.sockets.admission = self.admission = Admission(clock, per_turn=PER_TURN)
        self.ports = iter(range(40000, 50000))
        emitter = self.connect("emitter")
        emitter.send(*[event(f"s{k}", n) for k in range(SESSIONS) for n in range(HELD)])
        self.settle()
        self.assertEqual(self.relay.log.session_count(), SESSIONS)

    def connect(self, role: str = "consumer") -> MemorySocket:
        client = MemorySocket(self.sockets, next(self.ports))
        self.addCleanup(client.lose)
        client.send({"type": "hello", "versions": ["0.1"], "role": role})
        return client

    def settle(self, turns: int = 12) -> None:
        for _ in range(turns):
            self.time.turn()

    def storm(self) -> list[MemorySocket]:
        """C{STORM} greeted connections, then each one's subscribe in one reactor turn."""
        clients = [self.connect() for _ in range(STORM)]
        self.settle()
        for n, client in enumerate(clients):
            client.send(_subscribe(n))
        return clients

    def started(self, clients: list[MemorySocket]) -> list[int]:
        return [n for n, client in enumerate(clients) if client.subscribed()]

    def test_a_turn_starts_its_share_of_subscriptions_and_each_next_turn_the_next_in_order(self) -> None:
        clients = self.storm()
        started = [self.started(clients)]
        for _ in range(3):
            self.time.turn()
            started.append(self.started(clients))
        self.assertEqual(started, [list(range(PER_TURN)), list(range(2 * PER_TURN)), list(range(STORM)),
                                   list(range(STORM))])
        self.settle()
        for n, client in enumerate(clients):  # each one its replay, as alone
            self.assertEqual(client.kinds(), ["hello", "subscribed", *range(HELD - REPLAY, HELD)], n)
            self.assertEqual({m["session"] for m in client.received()[2:]}, {f"s{n % SESSIONS}"})

    def test_a_connection_closed_while_it_waits_leaves_nothing_behind(self) -> None:
        clients = self.storm()
        gone = (PER_TURN, PER_TURN + 2)
        for n in gone:
            clients[n].lose()
            self.assertIsNone(clients[n].protocol._awaiting_turn)  # (what it asked is dropped at once)
        self.time.turn()
        # (The gone ones count for nothing: the turn starts the next in line instead.)
        self.assertEqual(self.started(clients), [*range(PER_TURN), PER_TURN + 1, *range(PER_TURN + 3, 2 * PER_TURN + 2)])
        self.settle()
        self.assertEqual(len(self.admission.waiting), 0)
        self.assertEqual(len(self.relay.subscribers), STORM - len(gone))
        for n in gone:
            self.assertNotIn(clients[n].protocol, self.sockets.connections)
            self.assertFalse(clients[n].subscribed())

    def test_what_a_waiting_connection_sent_after_its_subscribe_is_answered_after_it(self) -> None:
        clients = self.storm()
        last = clients[-1]
        last.send({"type": "ping", "t": 1}, {"type": "ping", "t": 2})
        self.time.turn()  # the first turn's replies are flushed: not this one's (it waits)
        self.assertEqual(last.kinds(), ["hello"])
        self.settle()
        self.assertEqual(last.kinds(), ["hello", "subscribed", *range(HELD - REPLAY, HELD), "pong", "pong"])
        self.assertEqual([m["t"] for m in last.received()[-2:]], [1, 2])

    def test_the_subscribers_already_connected_are_served_while_the_storm_waits(self) -> None:
        live = self.connect()
        live.send({"type": "subscribe", "id": "live", "filter": {"session": "live"}})
        emitter = self.connect("emitter")
        self.settle()
        self.assertEqual(live.kinds(), ["hello", "subscribed"])
        clients = self.storm()
        emitter.send(event("live", 0))
        live.send({"type": "ping", "t": 1})
        self.time.turn()  # the storm's second slice starts; the pong goes, the event is ingested
        self.assertEqual(live.kinds(), ["hello", "subscribed", "pong"])
        self.assertLess(len(self.started(clients)), STORM)
        self.time.turn()  # the event's delivery is flushed
        self.assertEqual(live.kinds(), ["hello", "subscribed", "pong", 0])

    def test_without_an_admission_every_subscribe_starts_at_once(self) -> None:
        self.sockets.admission = None
        clients = self.storm()
        self.assertEqual(self.started(clients), list(range(STORM)))


class WingStorm(TestCase):
    """The whole shape over sockets: the wing's WebSocket subscriptions join its site's newcomers."""

    timeout = 30

    async def test_a_storm_of_subscribes_through_the_wing_is_sliced_and_each_gets_its_replay(self) -> None:
        relay = await start_relay(self, aep_buffer=64)
        for k in range(SESSIONS):
            response, _ = await relay.post(*[event(f"s{k}", n) for n in range(HELD)])
            self.assertEqual(response.code, 202)
        waited: list[Admission] = []  # the admission of each subscribe that waited for its turn
        wait_for_turn = AEPSocket.wait_for_turn

        def recorded(conn: AEPSocket, admission: Admission, start: Any) -> None:
            waited.append(admission)
            wait_for_turn(conn, admission, start)

        self.patch(AEPSocket, "wait_for_turn", recorded)
        count = 2 * NEWCOMERS_PER_TURN + 5
        clients = [await open_ws(self, relay, hello={"role": "consumer"}) for _ in range(count)]
        for n, client in enumerate(clients):  # one write each, read by the relay in one reactor turn
            client.send(_subscribe(n))
            client.send({"type": "ping", "t": n})
        for n, client in enumerate(clients):
            got = [await client.recv() for _ in range(REPLAY + 2)]
            self.assertEqual([m.get("seq", m["type"]) for m in got],
                             ["subscribed", *range(HELD - REPLAY, HELD), "pong"], n)
            self.assertEqual(got[-1]["t"], n)
        self.assertTrue(waited)  # (one reactor turn read them all: more than its share)
        self.assertEqual({id(admission) for admission in waited}, {id(relay.service.site.admission)})
