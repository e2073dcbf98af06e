"""The upstream Nostr relay client (relayd.buzz.nostr_upstream) against a scripted in-process relay;
timers on a task.Clock."""

from __future__ import annotations

import json
from typing import Any

from autobahn.twisted.websocket import WebSocketServerFactory, WebSocketServerProtocol
from twisted.internet import defer, endpoints, reactor, task
from twisted.trial import unittest

from relayd.base.clock import Timekeeper
from relayd.buzz import nostr
from relayd.buzz.nostr_upstream import ConnectionLost, NostrRelayPool, NotConnected, UpstreamTimeout


class ScriptedRelay(WebSocketServerProtocol):
    """Sends a challenge; answers EVENTs as the test's C{script} says (or not at all)."""

    def onOpen(self) -> None:
        self.factory.conns.append(self)
        self.sendMessage(json.dumps(["AUTH", "chal-1"]).encode())

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        msg = json.loads(payload)
        self.factory.received.append(msg)
        reply = self.factory.script(msg)
        for r in reply or ():
            self.sendMessage(json.dumps(r).encode())
        waiter, self.factory.waiter = self.factory.waiter, None
        if waiter is not None:
            waiter.callback(msg)


class ClientTests(unittest.TestCase):
    async def setUp(self) -> None:
        self.factory = WebSocketServerFactory()
        self.factory.protocol = ScriptedRelay
        self.factory.conns = []
        self.factory.received = []
        self.factory.waiter = None
        self.factory.script = lambda msg: None
        self.port = await endpoints.serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(self.factory)
        self.clock = task.Clock()
        self.clock.advance(1_800_000_000)
        url = f"ws://127.0.0.1:{self.port.getHost().port}"
        self.pool = NostrRelayPool(url, reactor, Timekeeper(self.clock), challenge_wait=5.0)
        self.signer = nostr.Signer(nostr.generate_secret())

    async def tearDown(self) -> None:
        await self.pool.close()
        for c in self.factory.conns:
            c.transport.abortConnection()
        await self.port.stopListening()

    def next_message(self) -> defer.Deferred[Any]:
        d: defer.Deferred[Any] = defer.Deferred()
        self.factory.waiter = d
        return d

    async def test_auth_then_ok_duplicate_counts_as_success(self) -> None:
        self.factory.script = lambda m: [["OK", m[1]["id"], False, "duplicate: exists"]] if m[0] == "EVENT" else None
        ev = self.signer.sign(9, [["h", "x"]], "hi", 1_800_000_000)
        accepted, message = await self.pool.connection(self.signer).publish(ev, 5.0)
        assert accepted and message.startswith("duplicate:")
        auth = self.factory.received[0]
        assert auth[0] == "AUTH" and auth[1]["kind"] == 22242 and nostr.verify_event(auth[1])
        assert ["challenge", "chal-1"] in auth[1]["tags"] and ["relay", self.pool.url] in auth[1]["tags"]
        assert auth[1]["pubkey"] == self.signer.pubkey

    async def test_refusal_is_not_success(self) -> None:
        self.factory.script = lambda m: [["OK", m[1]["id"], False, "blocked: no"]] if m[0] == "EVENT" else None
        ev = self.signer.sign(9, [], "hi", 1_800_000_000)
        assert await self.pool.connection(self.signer).publish(ev, 5.0) == (False, "blocked: no")

    async def test_no_ok_times_out_on_the_clock(self) -> None:
        conn = self.pool.connection(self.signer)
        ev = self.signer.sign(9, [], "hi", 1_800_000_000)
        sent = self.next_message()  # the AUTH
        d = defer.ensureDeferred(conn.publish(ev, 10.0))
        await sent
        event_seen = self.next_message()
        await event_seen
        self.assertNoResult(d)
        self.clock.advance(9.9)
        self.assertNoResult(d)
        self.clock.advance(0.2)
        with self.assertRaises(UpstreamTimeout):
            await d

    async def test_dropped_connection_fails_pending_publish_as_lost(self) -> None:
        conn = self.pool.connection(self.signer)
        ev = self.signer.sign(9, [], "hi", 1_800_000_000)
        auth = self.next_message()
        d = defer.ensureDeferred(conn.publish(ev, 10.0))
        await auth
        await self.next_message()
        self.factory.conns[0].transport.abortConnection()
        with self.assertRaises(ConnectionLost):
            await d

    async def test_query_collects_until_eose(self) -> None:
        ev = self.signer.sign(9, [], "stored", 1_800_000_000)
        self.factory.script = lambda m: [["EVENT", m[1], ev], ["EOSE", m[1]]] if m[0] == "REQ" else None
        events = await self.pool.connection(self.signer).query([{"kinds": [9]}], 5.0)
        assert events == [ev]
        assert self.factory.received[-1][0] in ("REQ", "CLOSE")

    async def test_unreachable_relay_is_not_connected(self) -> None:
        await self.port.stopListening()
        pool = NostrRelayPool(self.pool.url, reactor, Timekeeper(reactor), connect_timeout=2.0, backoff_base=0.05)
        with self.assertRaises(NotConnected):
            await pool.connection(self.signer).publish(self.signer.sign(9, [], "x", 1), 0.5)
        await pool.close()
        self.port = await endpoints.serverFromString(reactor, "tcp:0:interface=127.0.0.1").listen(self.factory)

    def test_retry_delay_doubles_up_to_the_cap_however_long_the_outage(self) -> None:
        """Twisted's backoffPolicy: exact (no jitter), capped, and still a number after thousands of failures."""
        pool = NostrRelayPool(self.pool.url, reactor, Timekeeper(self.clock), backoff_base=0.25, backoff_cap=5.0)
        assert [pool.settings.retry_delay(n) for n in range(1, 8)] == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
        assert pool.settings.retry_delay(5_000) == 5.0

    async def test_frames_split_anywhere_fragmented_or_mixed_with_control_frames(self) -> None:
        """The client's fast frame path hands whole plain frames on and leaves the rest to autobahn."""
        import struct

        conn = self.pool.connection(self.signer)
        contents = ["short", "m" * 300, "l" * 70_000, "fragmented " * 30, "after the ping"]
        for size in (None, 1, 7, 1000):
            sent = self.next_message()
            query = defer.ensureDeferred(conn.query([{"kinds": [9]}], 5.0))
            while True:  # the AUTH (first round only), then the REQ
                msg = await sent
                if msg[0] == "REQ":
                    break
                sent = self.next_message()
            sub = msg[1]
            events = [self.signer.sign(9, [], c, 1_800_000_000) for c in contents]

            def frame(payload: bytes, opcode: int = 1, fin: bool = True) -> bytes:
                n = len(payload)
                head = bytes([(0x80 if fin else 0) | opcode])
                if n < 126:
                    head += bytes([n])
                elif n < 65536:
                    head += bytes([126]) + struct.pack("!H", n)
                else:
                    head += bytes([127]) + struct.pack("!Q", n)
                return head + payload

            wire = b""
            for ev in events[:3]:
                wire += frame(json.dumps(["EVENT", sub, ev]).encode())
            text = json.dumps(["EVENT", sub, events[3]]).encode()
            wire += frame(text[:50], 1, False) + frame(b"", 9) + frame(text[50:], 0, True)  # a ping inside
            wire += frame(b"pong?", 9) + frame(json.dumps(["EVENT", sub, events[4]]).encode())
            wire += frame(json.dumps(["EOSE", sub]).encode())
            proto = conn._proto
            assert proto is not None
            step = size or len(wire)
            for i in range(0, len(wire), step):
                proto.dataReceived(wire[i : i + step])
            got = await query
            assert [e["content"] for e in got] == contents, size

    async def test_nagle_is_off_on_the_relay_connection(self) -> None:
        """Small request frames must not wait for the relay's delayed ACK (autobahn never turns Nagle off)."""
        import socket

        self.factory.script = lambda m: [["EOSE", m[1]]] if m[0] == "REQ" else None
        conn = self.pool.connection(self.signer)
        await conn.query([{"kinds": [9]}], 5.0)
        assert conn._proto is not None
        sock = conn._proto.transport.getHandle()
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0

    async def test_a_closing_connection_refuses_as_not_connected_and_leaves_no_timer(self) -> None:
        """autobahn raises its own Disconnected on a send while the close handshake runs (the
        connection still reads as ready then): publish and query say NotConnected (nothing was
        sent), and nothing is left waiting for an answer that cannot come."""
        self.factory.script = lambda m: [["EOSE", m[1]]] if m[0] == "REQ" else None
        conn = self.pool.connection(self.signer)
        await conn.query([{"kinds": [9]}], 5.0)
        assert conn._proto is not None
        conn._proto.sendClose()  # closing: autobahn refuses to send from now on
        assert conn.ready
        before = len(self.clock.getDelayedCalls())
        with self.assertRaises(NotConnected):
            await conn.publish(self.signer.sign(9, [], "late", 1_800_000_000), 5.0)
        with self.assertRaises(NotConnected):
            await conn.query([{"kinds": [9]}], 5.0)
        assert len(self.clock.getDelayedCalls()) == before
        assert not conn._publishes and not conn._queries
