"""The fence's twisted.internet entries (relayd/compat/tcp.py) on real loopback TCP connections: the
buffers detected, write_now and hold_writes/release_writes sending with one call and no writability
watch, and the same bytes with the shortcuts off."""

from __future__ import annotations

import socket
from typing import Any, Callable

from twisted.internet import reactor
from twisted.internet.address import IPv4Address, UNIXAddress
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import TestCase

from relayd.compat import tcp as fence
from relayd.compat.tcp import HOLD_WRITES, TCP_BUFFERS, hold_writes, nothing_queued, release_writes, write_now
from tests.compat.loopback import LoopbackCase, Server


class Answering(Protocol):
    """Answers each read with C{answer(transport)}, its writes held until the read is handled."""

    answer: Callable[[Any], None]
    watched: list[bool]
    lost: list[str] | None = None

    def dataReceived(self, data: bytes) -> None:
        held = hold_writes(self.transport)
        try:
            self.answer(self.transport)
        finally:
            if held:
                release_writes(self.transport)
        self.watched.append(self.transport in reactor.getWriters())
        if self.lost is not None:
            self.lost.append("read handled")

    def connectionLost(self, reason: Any) -> None:
        if self.lost is not None:
            self.lost.append(type(reason.value).__name__)


class Collecting(Protocol):
    def __init__(self) -> None:
        self.received = b""
        self.closed: Deferred[bytes] = Deferred()

    def connectionMade(self) -> None:
        self.transport.write(b"go")

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Any) -> None:
        self.closed.callback(self.received)


class HeldWrites(TestCase):
    def serve(self, answer: Callable[[Any], None], lost: list[str] | None = None) -> tuple[int, list[bool]]:
        watched: list[bool] = []
        attributes = {"answer": staticmethod(answer), "watched": watched, "lost": lost}
        factory = Factory.forProtocol(type("A", (Answering,), attributes))
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return port.getHost().port, watched

    async def exchange(self, answer: Callable[[Any], None], lost: list[str] | None = None) -> tuple[bytes, list[bool]]:
        """Connect, send one read, and collect everything until the server closes."""
        port, watched = self.serve(answer, lost)
        client = Collecting()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), client)
        return await client.closed, watched

    async def test_an_answer_goes_out_at_once_without_a_writability_watch(self) -> None:
        def answer(transport: Any) -> None:
            transport.write(b"HTTP/1.1 202 Accepted\r\n")
            transport.writeSequence([b"content-length: 0\r\n", b"\r\n"])
            transport.loseConnection()

        received, _ = await self.exchange(answer)
        # The close asked for while writes were held still comes after every byte.
        self.assertEqual(received, b"HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\n\r\n")

    @staticmethod
    def answer_and_close(transport: Any) -> None:
        transport.write(b"HTTP/1.1 202 Accepted\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
        transport.loseConnection()

    async def test_a_close_asked_for_while_held_closes_within_the_read(self) -> None:
        # A connection closed after one answer is closed as the reactor would close it, but within
        # the read: no writability watch, no reactor turn (docs/performance.md, issue 24).
        self.assertTrue(fence.CLOSE_NOW)
        lost: list[str] = []
        received, watched = await self.exchange(self.answer_and_close, lost)
        self.assertEqual(received, b"HTTP/1.1 202 Accepted\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
        self.assertEqual(lost, ["ConnectionDone", "read handled"])  # once, cleanly, before the read returned
        self.assertEqual(watched, [False])

    async def test_without_close_now_the_reactor_closes_after_sending_the_same_bytes(self) -> None:
        self.patch(fence, "CLOSE_NOW", False)
        lost: list[str] = []
        received, watched = await self.exchange(self.answer_and_close, lost)
        self.assertEqual(received, b"HTTP/1.1 202 Accepted\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
        self.assertEqual(lost, ["read handled", "ConnectionDone"])
        self.assertEqual(watched, [True])  # watched for writability until the next turn sent and closed

    @staticmethod
    def counting_writes(calls: list[str]) -> Callable[[Any], None]:
        """L{answer_and_close}, with each C{doWrite} of the transport counted in C{calls}."""

        def answer(transport: Any) -> None:
            do_write = transport.doWrite

            def counted() -> Any:
                calls.append("doWrite")
                return do_write()

            transport.doWrite = counted
            HeldWrites.answer_and_close(transport)

        return answer

    async def test_a_closing_answer_is_sent_and_closed_without_do_write(self) -> None:
        # One send, then connectionLost: none of doWrite's bookkeeping, nor the socket taken out of
        # the reactor's sets twice (issue 24, a connection per request).
        self.assertTrue(fence.CLOSE_AT_ONCE)
        calls: list[str] = []
        lost: list[str] = []
        received, watched = await self.exchange(self.counting_writes(calls), lost)
        self.assertEqual(received, b"HTTP/1.1 202 Accepted\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
        self.assertEqual((calls, lost, watched), ([], ["ConnectionDone", "read handled"], [False]))

    async def test_without_close_at_once_do_write_closes_within_the_read(self) -> None:
        self.patch(fence, "CLOSE_AT_ONCE", False)
        calls: list[str] = []
        lost: list[str] = []
        received, watched = await self.exchange(self.counting_writes(calls), lost)
        self.assertEqual(received, b"HTTP/1.1 202 Accepted\r\nconnection: close\r\ncontent-length: 0\r\n\r\n")
        self.assertEqual((calls, lost, watched), (["doWrite"], ["ConnectionDone", "read handled"], [False]))

    async def test_a_close_with_nothing_queued_closes_within_the_read(self) -> None:
        lost: list[str] = []
        received, watched = await self.exchange(lambda transport: transport.loseConnection(), lost)
        self.assertEqual((received, lost, watched), (b"", ["ConnectionDone", "read handled"], [False]))

    async def test_a_closing_answer_over_the_send_limit_is_finished_by_the_reactor(self) -> None:
        big = b"x" * (16 * 2**20)
        lost: list[str] = []

        def answer(transport: Any) -> None:
            transport.write(b"y")
            transport.write(big)
            transport.loseConnection()

        received, watched = await self.exchange(answer, lost)
        self.assertEqual(received, b"y" + big)
        self.assertEqual((lost, watched), (["read handled", "ConnectionDone"], [True]))

    async def test_what_the_kernel_does_not_take_is_left_to_the_reactor(self) -> None:
        big = b"x" * (16 * 2**20)  # more than a loopback socket buffer takes at once

        def answer(transport: Any) -> None:
            transport.write(big)
            transport.loseConnection()

        received, watched = await self.exchange(answer)
        self.assertEqual(len(received), len(big))
        self.assertEqual(watched, [True])  # the rest was queued and the socket watched

    async def test_a_small_answer_leaves_the_socket_unwatched(self) -> None:
        def answer(transport: Any) -> None:
            transport.write(b"pong")

        port, watched = self.serve(answer)
        client = Collecting()
        got: Deferred[bytes] = Deferred()
        client.dataReceived = lambda data: got.callback(data)  # type: ignore[method-assign]
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), client)
        self.assertEqual(await got, b"pong")
        self.assertEqual(watched, [False])  # sent within the read: never registered for writability
        client.transport.loseConnection()
        await client.closed


class Transports(LoopbackCase):
    async def test_tcp_buffers_are_detected_on_a_real_connection(self) -> None:
        self.assertTrue(TCP_BUFFERS)
        self.assertTrue(HOLD_WRITES)
        transport, _ = await self.tcp_pair()
        self.assertIsInstance(transport._tempDataBuffer, list)
        self.assertIsInstance(transport.dataBuffer, bytes)
        self.assertIsInstance(transport.offset, int)
        self.assertTrue(nothing_queued(transport))
        transport.write(b"queued")  # waits for the next reactor turn
        self.assertFalse(nothing_queued(transport))

    async def test_write_now_sends_within_the_call(self) -> None:
        transport, client = await self.tcp_pair()
        write_now(transport, b"now")
        self.assertNotIn(transport, reactor.getWriters())  # sent, not queued for writability
        await client.wait_for(b"now")

    async def test_write_now_fallback_delivers_the_same_bytes(self) -> None:
        self.patch(fence, "TCP_BUFFERS", False)
        transport, client = await self.tcp_pair()
        self.assertFalse(nothing_queued(transport))
        write_now(transport, b"one ")
        write_now(transport, b"two")
        await client.wait_for(b"one two")
        self.assertEqual(client.received, b"one two")

    async def test_held_writes_leave_the_socket_unwatched(self) -> None:
        transport, client = await self.tcp_pair()
        self.assertTrue(hold_writes(transport))
        self.assertIn("startWriting", transport.__dict__)  # held: Twisted's write path calls this stand-in
        transport.write(b"held")
        self.assertNotIn(transport, reactor.getWriters())
        release_writes(transport)
        self.assertNotIn("startWriting", transport.__dict__)
        await client.wait_for(b"held")

    async def test_hold_writes_fallback_holds_nothing_and_delivers_the_same_bytes(self) -> None:
        self.patch(fence, "HOLD_WRITES", False)
        transport, client = await self.tcp_pair()
        self.assertFalse(hold_writes(transport))
        transport.write(b"held")
        await client.wait_for(b"held")
        self.assertEqual(client.received, b"held")



class HeldWritesSentWhole(LoopbackCase):
    """release_writes sends what was held with one C{send} of its own, and leaves to Twisted's
    C{doWrite} what needs more than clearing the buffers."""

    def count_do_write(self, transport: Any) -> list[int]:
        calls: list[int] = []
        do_write = transport.doWrite

        def counted() -> Any:
            calls.append(1)
            return do_write()

        transport.doWrite = counted
        return calls

    async def test_an_answer_goes_out_whole_without_do_write(self) -> None:
        self.assertTrue(fence.SEND_AT_ONCE)
        transport, client = await self.tcp_pair()
        calls = self.count_do_write(transport)
        hold_writes(transport)
        transport.write(b"HTTP/1.1 202 Accepted\r\n")
        transport.writeSequence([b"content-length: 2\r\n\r\n", b"{}"])
        release_writes(transport)
        self.assertEqual(calls, [])
        self.assertTrue(nothing_queued(transport))
        self.assertNotIn(transport, reactor.getWriters())
        await client.wait_for(b"{}")
        self.assertEqual(client.received, b"HTTP/1.1 202 Accepted\r\ncontent-length: 2\r\n\r\n{}")

    async def test_without_it_do_write_sends_the_same_bytes(self) -> None:
        self.patch(fence, "SEND_AT_ONCE", False)
        transport, client = await self.tcp_pair()
        calls = self.count_do_write(transport)
        hold_writes(transport)
        transport.writeSequence([b"one ", b"two"])
        release_writes(transport)
        self.assertEqual(calls, [1])
        await client.wait_for(b"one two")
        self.assertEqual(client.received, b"one two")

    async def test_a_paused_producer_is_left_to_do_write_which_resumes_it(self) -> None:
        transport, client = await self.tcp_pair()
        producer = Producer()
        transport.registerProducer(producer, True)
        calls = self.count_do_write(transport)
        hold_writes(transport)
        big = b"y" * (transport.bufferSize + 1)  # over the transport's buffer: it pauses its producer
        transport.write(big)
        self.assertEqual(producer.calls, ["pause"])
        release_writes(transport)
        self.assertEqual(calls, [1])  # (sent whole by its own send, the producer would stay paused)
        self.assertEqual(producer.calls, ["pause", "resume"])
        await client.wait_for(big)
        transport.unregisterProducer()

    async def test_what_the_kernel_does_not_take_is_queued_and_watched(self) -> None:
        transport, client = await self.tcp_pair()
        transport.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        client.transport.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.transport.pauseProducing()  # (reads nothing: the kernel takes what its buffers hold)
        data = bytes(range(256)) * (transport.SEND_LIMIT // 256)
        hold_writes(transport)
        transport.write(data)
        release_writes(transport)
        self.assertFalse(nothing_queued(transport))
        self.assertIn(transport, reactor.getWriters())  # the rest is the reactor's to send
        client.transport.resumeProducing()
        await client.wait_for(data)
        self.assertEqual(client.received, data)
        self.assertNotIn(transport, reactor.getWriters())


class Producer:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def pauseProducing(self) -> None:
        self.calls.append("pause")

    def resumeProducing(self) -> None:
        self.calls.append("resume")

    def stopProducing(self) -> None:
        self.calls.append("stop")


class PeerHost(LoopbackCase):
    async def test_a_server_connections_peer_host_is_its_address_host(self) -> None:
        self.assertTrue(fence.SERVER_PEER_HOST)
        transport, _ = await self.tcp_pair()
        self.assertEqual(fence.peer_host(transport), transport.getPeer().host)
        self.assertEqual(fence.peer_host(transport), "127.0.0.1")

    async def test_without_the_state_the_address_is_asked(self) -> None:
        self.patch(fence, "SERVER_PEER_HOST", False)
        transport, _ = await self.tcp_pair()
        transport.hostname = "not read"
        self.assertEqual(fence.peer_host(transport), "127.0.0.1")

    def test_another_transports_peer_host_is_its_address_host(self) -> None:
        transport = StringTransport(peerAddress=IPv4Address("TCP", "10.0.0.7", 4321))
        self.assertEqual(fence.peer_host(transport), "10.0.0.7")
        self.assertIsNone(fence.peer_host(StringTransport(peerAddress=UNIXAddress(b"/tmp/s"))))


class QuickAccept(LoopbackCase):
    async def accepted(self, quick: bool) -> tuple[Any, Any]:
        made: Deferred[Any] = Deferred()
        port = reactor.listenTCP(0, Factory.forProtocol(type("S", (Server,), {"made": made})), interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.assertIs(fence.quick_accept(port), quick)
        await self.connect(port.getHost().port)
        transport = await made
        return port, transport

    async def test_a_port_accepts_sockets_as_pythons_accept_makes_them(self) -> None:
        self.assertTrue(fence.QUICK_ACCEPT)
        port, transport = await self.accepted(True)
        self.assertIsInstance(port.socket, fence._QuickAccept)
        sock = transport.socket
        self.assertIs(type(sock), socket.socket)
        self.assertIs(sock.family, socket.AF_INET)  # (the enum, asked of the socket as before)
        self.assertIs(sock.type, socket.SOCK_STREAM)
        self.assertEqual((sock.proto, sock.gettimeout(), sock.getblocking()), (0, 0.0, False))
        self.assertEqual(transport.getPeer().host, "127.0.0.1")

    async def test_without_the_accept_known_the_port_is_left_as_it_is(self) -> None:
        self.patch(fence, "QUICK_ACCEPT", False)
        port, transport = await self.accepted(False)
        self.assertIs(type(port.socket), socket.socket)
        self.assertIs(transport.socket.family, socket.AF_INET)

    def test_python_and_the_quick_accept_make_the_same_socket(self) -> None:
        for quick in (False, True):
            with socket.socket() as listening:
                listening.bind(("127.0.0.1", 0))
                listening.listen()
                listening.settimeout(2.5)  # (a listening timeout: the accepted socket is blocking)
                if quick:
                    listening.__class__ = fence._QuickAccept
                with socket.create_connection(listening.getsockname()):
                    sock, addr = listening.accept()
                    with sock:
                        seen = (type(sock), sock.family, sock.type, sock.proto, sock.gettimeout(), addr[0])
                        self.assertEqual(seen, (socket.socket, socket.AF_INET, socket.SOCK_STREAM, 0, None, "127.0.0.1"))
