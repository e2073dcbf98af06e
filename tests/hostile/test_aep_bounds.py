"""Hostile consumers of the AEP relay's output side: every byte a client does not read counts against
its backlog bound (aep.md "Consumers that cannot keep up"), replays are produced as the client reads,
subscriptions are capped, and WebSocket violations end with the close code the docs promise.

The memory tests run a real ``twistd -n relayd`` and read its RSS from /proc; each asserts the
documented bound (clients × 8 MiB × 1.25 + slack). Live SSE and WebSocket event consumers that never
read are covered the same way by tests/robustness/test_slow_consumers.py.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import time
from typing import Any, Callable
from urllib.parse import quote

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import ClientFactory, Protocol
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from tests.support.aep import event, ndjson, open_sse, open_ws, start_relay
from tests.support.connections import memory, sse_request, ws_request
from tests.support.redis import RedisServer, shared_redis
from tests.support.twistd import RelaydProcess

MiB = 2**20
HARD = 8 * MiB  # the documented per-client hard backlog bound
SLACK = 48 * MiB  # allocator noise, cached wire forms of what did go out, the test's own HTTP traffic
TIMEOUT = 30.0
PAD = "x" * 1000


# Clients ----------------------------------------------------------------------------------------


class Reader(Protocol):
    """A raw HTTP client that sends one request, can stop and resume reading, and counts what it got.

    C{marker} fires when the given bytes have been received (also across reads); C{count} counts
    occurrences of C{counted} in the body; C{keep} keeps the body.
    """

    def __init__(
        self, request: bytes, *, stop_reading: bool = False, marker: bytes = b"", counted: bytes = b"", keep: bool = False
    ) -> None:
        self.request = request
        self.body = bytearray() if keep else None
        self.stop_reading = stop_reading
        self.marker = marker
        self.counted = counted
        self.ready: Deferred[bytes] = Deferred()
        self.seen: Deferred[None] = Deferred()
        self.lost: Deferred[None] = Deferred()
        self.head = b""
        self.count = 0
        self._tail = b""

    def connectionMade(self) -> None:
        self.transport.write(self.request)

    def dataReceived(self, data: bytes) -> None:
        if not self.ready.called:
            self.head += data
            if b"\r\n\r\n" not in self.head:
                return
            head, data = self.head.split(b"\r\n\r\n", 1)
            if self.stop_reading:
                self.transport.pauseProducing()
            self.ready.callback(head.split(b"\r\n", 1)[0])
        if self.body is not None:
            self.body += data
        window = self._tail + data
        if self.counted:
            self.count += window.count(self.counted) - self._tail.count(self.counted)
        if self.marker and not self.seen.called and self.marker in window:
            self.seen.callback(None)
        self._tail = window[-64:]

    def resume(self) -> None:
        self.transport.resumeProducing()

    def connectionLost(self, reason: Any) -> None:
        if not self.ready.called:
            self.ready.errback(reason)
        self.lost.callback(None)


class RawSocket(Protocol):
    """A WebSocket client that writes raw frames and parses the server's frames itself.

    Text payloads are kept only when C{keep} says so (a flood need not be held); C{frames} lists
    C{(opcode, payload)} in arrival order; C{count} counts the text frames holding C{counted};
    C{wait(predicate)} fires on the first frame it accepts.
    """

    def __init__(
        self, headers: dict[str, str] | None = None, keep: Callable[[bytes], bool] = lambda p: True, counted: bytes = b"\x00"
    ) -> None:
        request = ws_request()
        for name, value in (headers or {}).items():
            request = request[:-2] + f"{name}: {value}\r\n\r\n".encode()
        self.request = request
        self.keep = keep
        self.counted = counted
        self.count = 0  # text frames holding C{counted}
        self.opened: Deferred[bytes] = Deferred()
        self.lost: Deferred[None] = Deferred()
        self.frames: list[tuple[int, bytes]] = []
        self.texts = 0
        self._head = b""
        self._buffer = bytearray()
        self._waiters: list[tuple[Callable[[int, bytes], bool], Deferred[bytes]]] = []

    def connectionMade(self) -> None:
        self.transport.write(self.request)

    def dataReceived(self, data: bytes) -> None:
        if not self.opened.called:
            self._head += data
            if b"\r\n\r\n" not in self._head:
                return
            head, data = self._head.split(b"\r\n\r\n", 1)
            self.opened.callback(head.split(b"\r\n", 1)[0])
        self._buffer += data
        buffer, at = self._buffer, 0
        while len(buffer) - at >= 2:
            opcode, length, start = buffer[at] & 0x0F, buffer[at + 1] & 0x7F, at + 2
            if length == 126:
                if len(buffer) - at < 4:
                    break
                length, start = struct.unpack_from("!H", buffer, at + 2)[0], at + 4
            elif length == 127:
                if len(buffer) - at < 10:
                    break
                length, start = struct.unpack_from("!Q", buffer, at + 2)[0], at + 10
            if len(buffer) - start < length:
                break
            payload = bytes(buffer[start : start + length])
            at = start + length
            self._frame(opcode, payload)
        del buffer[:at]

    def _frame(self, opcode: int, payload: bytes) -> None:
        if opcode == 1:
            self.texts += 1
            if self.counted in payload:
                self.count += 1
        self.frames.append((opcode, payload if opcode != 1 or self.keep(payload) else b""))
        for waiter in list(self._waiters):
            accept, d = waiter
            if accept(opcode, payload):
                self._waiters.remove(waiter)
                d.callback(payload)

    def wait(self, accept: Callable[[int, bytes], bool], timeout: float = TIMEOUT) -> Deferred[bytes]:
        """The payload of the first frame from now on that C{accept(opcode, payload)} takes."""
        d: Deferred[bytes] = Deferred()
        self._waiters.append((accept, d))
        return d.addTimeout(timeout, reactor)

    def send_frame(self, payload: bytes, opcode: int = 1, *, rsv: int = 0, masked: bool = True) -> None:
        """One frame, masked as a client must (unless told not to)."""
        head = bytes([0x80 | rsv << 4 | opcode])
        size = len(payload)
        flag = 0x80 if masked else 0
        if size < 126:
            head += bytes([flag | size])
        elif size < 2**16:
            head += bytes([flag | 126]) + struct.pack("!H", size)
        else:
            head += bytes([flag | 127]) + struct.pack("!Q", size)
        if masked:
            key = os.urandom(4)
            payload = bytes(b ^ key[i % 4] for i, b in enumerate(payload))
            head += key
        self.transport.write(head + payload)

    def send(self, message: Any) -> None:
        self.send_frame(json.dumps(message).encode())

    def close_code(self) -> int | None:
        """The code of the first Close frame received, if any."""
        for opcode, payload in self.frames:
            if opcode == 8:
                return struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
        return None

    def connectionLost(self, reason: Any) -> None:
        if not self.opened.called:
            self.opened.errback(reason)
        waiters, self._waiters = self._waiters, []
        for _, d in waiters:
            d.errback(reason)  # what it waited for will never come
        self.lost.callback(None)


class _Factory(ClientFactory):
    def __init__(self, protocol: Protocol) -> None:
        self.protocol_instance = protocol

    def buildProtocol(self, addr: Any) -> Protocol:
        return self.protocol_instance


async def connect(port: int, protocol: Any) -> Any:
    """Connect C{protocol} (a L{Reader} or L{RawSocket}) to 127.0.0.1:C{port}; wait for its answer head."""
    reactor.connectTCP("127.0.0.1", port, _Factory(protocol), timeout=TIMEOUT)
    head = await (protocol.ready if isinstance(protocol, Reader) else protocol.opened).addTimeout(TIMEOUT, reactor)
    assert b" 200 " in head or b" 101 " in head, head
    return protocol


async def raw_socket(port: int, role: str = "consumer", **options: Any) -> RawSocket:
    """A L{RawSocket} past its hello."""
    client = await connect(port, RawSocket(**options))
    hello = client.wait(lambda op, p: b'"hello"' in p)
    client.send({"type": "hello", "versions": ["0.1"], "role": role})
    await hello
    return client


def hang_up(client: RawSocket) -> Deferred[None]:
    """End C{client}'s connection with a closing handshake (a test cleanup: the relay keeps no timer)."""
    if not client.lost.called:
        client.send_frame(struct.pack("!H", 1000), opcode=8)
        client.lost.addTimeout(TIMEOUT, reactor)
    return client.lost


async def ping(client: RawSocket) -> None:
    """A ping/pong round trip on C{client}."""
    pong = client.wait(is_text(b'"t":"sync"'))
    client.send({"type": "ping", "t": "sync"})
    await pong


def is_text(marker: bytes) -> Callable[[int, bytes], bool]:
    return lambda opcode, payload: opcode == 1 and marker in payload


def is_close(opcode: int, payload: bytes) -> bool:
    return opcode == 8


# A real relayd ------------------------------------------------------------------------------------


class Relayd:
    """A ``twistd -n relayd`` with the AEP relay only, plus a keep-alive HTTP pool to drive it."""

    def __init__(self, proc: RelaydProcess) -> None:
        self.proc = proc
        self.port = proc.port("aep")
        self.pid = proc.transport.pid
        self.pool = HTTPConnectionPool(reactor, persistent=True)

    @classmethod
    async def start(cls, tc: TestCase, *options: str) -> Relayd:
        proc = await RelaydProcess.start_for(
            tc,
            ["--aep-listen", "tcp:0:interface=127.0.0.1", "--no-mcp", "--no-access-log", *options]
        )
        if "--redis" in options:  # listening comes before the Redis pool is up (a POST then is a 503)
            await proc.wait_for(rb"connected to Redis at ")
        relayd = cls(proc)
        tc.addCleanup(relayd.pool.closeCachedConnections)
        return relayd

    async def post(self, events: list[dict[str, Any]], token: str | None = None) -> None:
        headers = {"aep-version": "0.1", "content-type": "application/x-ndjson"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        url = f"http://127.0.0.1:{self.port}/events"
        response = await treq.post(url, ndjson(*events), headers=headers, pool=self.pool)
        await treq.content(response)
        assert response.code == 202, response.code

    async def fill(self, sessions: list[str], per_session: int) -> None:
        """Buffer C{per_session} events of ~1 KB in each session."""
        for session in sessions:
            await self.post([event(session, seq, data={"pad": PAD}) for seq in range(per_session)])

    async def settle(self) -> None:
        """Two HTTP round trips: what clients sent before them has been read and handled by now."""
        for _ in range(2):
            response = await treq.get(f"http://127.0.0.1:{self.port}/healthz", pool=self.pool)
            await treq.content(response)

    def rss(self) -> int:
        return memory(self.pid)["VmRSS"]

    def peak(self) -> int:
        return memory(self.pid)["VmHWM"]

    def assert_growth(self, tc: TestCase, base: int, clients: int, what: str) -> None:
        growth = self.peak() - base
        bound = clients * HARD * 1.25 + SLACK
        print(f"\n{what}: server RSS {base / MiB:.0f} MiB, peak +{growth / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB)")
        tc.assertLess(growth, bound)

    async def stop(self) -> None:
        await self.pool.closeCachedConnections()
        assert await self.proc.terminate(signal.SIGTERM) == 0


def from_query(sessions: list[str]) -> str:
    return quote(json.dumps([{"session": s} for s in sessions], separators=(",", ":")))


# Never-reading consumers: memory -------------------------------------------------------------------


REPLAYED = [f"R{i}" for i in range(4)]
PER_SESSION = 10_000  # 4 × 10 000 × ~1.2 KB frames: ~48 MB of history per replay


class NeverReadingReplay(TestCase):
    timeout = 120

    async def test_sse_replay_is_produced_as_the_client_reads(self) -> None:
        """Defect 6: a replay was built whole before any of it was sent (a client that never read
        cost the whole history, per request); now it is produced as the transport drains, and live
        events held meanwhile count against the same bound (past 8 MiB the stream is cut)."""
        relayd = await Relayd.start(self)
        await relayd.fill(REPLAYED, PER_SESSION)
        base = relayd.rss()

        history = f"/stream?live=0&from={from_query(REPLAYED)}"
        stalled = [
            await connect(relayd.port, Reader(sse_request(history), stop_reading=True, marker=b": replay-complete\n",
                                              counted=b"\nid: R"))
            for _ in range(3)
        ]
        # Resuming with live events after its replay: the live events it holds meanwhile are bounded too.
        resuming = await connect(relayd.port, Reader(sse_request(f"/stream?from={from_query(REPLAYED)}"), stop_reading=True))
        await relayd.settle()
        for batch in range(20):  # 20 MiB of live-only (never buffered) events while nobody reads
            await relayd.post([event(f"L{batch}", None, "agent.heartbeat", id=f"L{batch}-{i}", severity="notice",
                                     data={"pad": PAD}) for i in range(1000)])
        await relayd.settle()
        relayd.assert_growth(self, base, 4, "SSE replay to clients that never read")

        resuming.resume()  # (a client that does not read does not see its connection end either)
        await resuming.lost.addTimeout(TIMEOUT, reactor)  # cut off: it held more than 8 MiB of live events
        for reader in stalled:
            reader.resume()  # the replay goes on as the client reads, to its end
            await reader.seen.addTimeout(TIMEOUT, reactor)
            self.assertEqual(reader.count, len(REPLAYED) * PER_SESSION)
            reader.transport.abortConnection()
        await relayd.stop()

    async def test_websocket_replay_is_produced_as_the_client_reads(self) -> None:
        """Defect 6 over WebSocket: the whole replay was queued at once, so a client that paused for
        a moment was cut off (1013) and every replayed event's frame was built; now the replay waits
        for the client, and live events held meanwhile count against its bound (then 1013)."""
        relayd = await Relayd.start(self)
        await relayd.fill(REPLAYED, PER_SESSION)
        base = relayd.rss()

        clients = []
        for _ in range(2):
            client = await raw_socket(relayd.port, keep=lambda p: b'"seq"' not in p, counted=b'"seq"')
            subscribed = client.wait(is_text(b'"subscribed"'))
            client.send({"type": "subscribe", "id": "h", "filter": {"type": "session.started"},
                         "from": [{"session": s} for s in REPLAYED]})
            await subscribed
            client.transport.pauseProducing()  # never reads its replay
            clients.append(client)
        held = await raw_socket(relayd.port)  # subscribed to everything: holds the live events below
        subscribed = held.wait(is_text(b'"subscribed"'))
        held.send({"type": "subscribe", "id": "all", "from": [{"session": s} for s in REPLAYED]})
        await subscribed
        held.transport.pauseProducing()
        await relayd.settle()
        for batch in range(20):
            await relayd.post([event(f"L{batch}", None, "agent.heartbeat", id=f"L{batch}-{i}", severity="notice",
                                     data={"pad": PAD}) for i in range(1000)])
        await relayd.settle()
        relayd.assert_growth(self, base, 3, "WebSocket replay to clients that never read")
        response = await treq.get(f"http://127.0.0.1:{relayd.port}/healthz", pool=relayd.pool)
        self.assertEqual(json.loads(await treq.content(response))["subscribers"], 2)  # `held` was cut off

        for client in clients:
            done = client.wait(is_text(b'"t":"end"'))
            client.send({"type": "ping", "t": "end"})  # answered after the replay: messages keep their order
            client.transport.resumeProducing()
            await done
            self.assertIsNone(client.close_code())  # never cut off
            self.assertEqual(client.count, len(REPLAYED) * PER_SESSION)
            client.transport.abortConnection()
        held.transport.resumeProducing()
        await held.lost.addTimeout(TIMEOUT, reactor)
        assert_cut_off(self, held)
        await relayd.stop()


class RedisReplayPages(TestCase):
    """With --redis a replay is read from the store a page (512 events) at a time as it is sent,
    instead of every named session at once before anything is sent."""

    timeout = 120

    async def test_a_replay_to_clients_that_never_read_holds_a_page_each(self) -> None:
        redis = RedisServer.start()
        self.addCleanup(redis.cleanup)
        relayd = await Relayd.start(self, "--redis", redis.url)
        await relayd.fill(REPLAYED, PER_SESSION)
        base = relayd.rss()
        history = f"/stream?live=0&from={from_query(REPLAYED)}"
        stalled = [
            await connect(relayd.port, Reader(sse_request(history), stop_reading=True, marker=b": replay-complete\n",
                                              counted=b"\nid: R"))
            for _ in range(3)
        ]
        await relayd.settle()
        relayd.assert_growth(self, base, len(stalled), "SSE replay from Redis to clients that never read")
        for reader in stalled:
            reader.resume()
            await reader.seen.addTimeout(TIMEOUT, reactor)
            self.assertEqual(reader.count, len(REPLAYED) * PER_SESSION)
            reader.transport.abortConnection()
        await relayd.stop()

    async def test_events_evicted_between_pages_are_named_by_a_marker(self) -> None:
        relay = await start_relay(self, **on_redis(), aep_buffer=2000)
        port = int(relay.url.rsplit(":", 1)[1])
        big = {"pad": "p" * 8000}  # 2000 × 8 KB: more than the kernel buffers of a client that stops reading
        for start in range(0, 2000, 500):
            await relay.post(*[event("E", seq, data=big) for seq in range(start, start + 500)])
        reader = await connect(port, Reader(http10(f"/stream?live=0&from={from_query(['E'])}"), stop_reading=True,
                                            marker=b": replay-complete\n", keep=True))
        for start in range(2000, 4000, 500):  # evicts every event the replay began with
            await relay.post(*[event("E", seq, data={"n": seq}) for seq in range(start, start + 500)])
        reader.resume()
        await reader.seen.addTimeout(TIMEOUT, reactor)
        seqs, comments = sse_ids(bytes(reader.body))
        self.assertEqual(seqs, sorted(set(seqs)))  # in order, none twice
        self.assertEqual(comments[-1], "replay-complete")
        gap = seqs.index(2000)
        self.assertEqual(seqs[gap:], list(range(2000, 4000)))
        self.assertLess(gap, 2000)  # the replay was cut short by the eviction...
        # ...and says so: the kernel's buffers may let a page be read while the evicting posts are
        # still arriving (a marker then names the earliest held at that read), but every marker
        # names a later position than the one before, and the last the earliest held at the end.
        markers = comments[:-1]
        self.assertTrue(markers)
        self.assertEqual(markers[-1], "replay-exhausted E 0:2000")
        earliest = [int(m.removeprefix("replay-exhausted E 0:")) for m in markers if m.startswith("replay-exhausted E 0:")]
        self.assertEqual(len(earliest), len(markers), markers)
        self.assertEqual(earliest, sorted(set(earliest)), markers)

    async def test_live_events_a_later_page_holds_are_sent_once(self) -> None:
        """Events that arrive while a paged replay is sent are in its later pages and held live
        as well: they are sent once, in the replay."""
        relay = await start_relay(self, **on_redis())
        port = int(relay.url.rsplit(":", 1)[1])
        big = {"pad": "p" * 8000}
        for start in range(0, 2000, 500):
            await relay.post(*[event("H", seq, data=big) for seq in range(start, start + 500)])
        reader = await connect(port, Reader(http10(f"/stream?from={from_query(['H'])}"), stop_reading=True,
                                            marker=b"id: H:0:2100\n", keep=True))
        await relay.post(*[event("H", seq) for seq in range(2000, 2100)])  # held live, and in a later page
        reader.resume()
        await relay.post(event("H", 2100))  # live once the replay is sent
        await reader.seen.addTimeout(TIMEOUT, reactor)
        seqs, _ = sse_ids(bytes(reader.body))
        self.assertEqual(seqs, list(range(2101)))
        reader.transport.abortConnection()


def on_redis() -> dict[str, Any]:
    """Relay flags: the shared test Redis, a fresh key prefix."""
    return {"redis": shared_redis().url, "redis_prefix": f"hostile-{os.urandom(4).hex()}:"}


def http10(path: str) -> bytes:
    """An SSE request whose answer is not chunked (its body is the stream as it is)."""
    return f"GET {path} HTTP/1.0\r\nHost: localhost\r\nAccept: text/event-stream\r\n\r\n".encode()


def sse_ids(body: bytes) -> tuple[list[int], list[str]]:
    """The seqs of the C{id:} lines and the comments of an SSE body, in order."""
    seqs, comments = [], []
    for line in body.split(b"\n"):
        if line.startswith(b"id: "):
            seqs.append(int(line.rsplit(b":", 1)[1]))
        elif line.startswith(b": ") and line != b": ping":
            comments.append(line[2:].decode())
    return seqs, comments


class NeverReadingReplies(TestCase):
    timeout = 120

    async def test_websocket_replies_wait_for_the_client_to_read(self) -> None:
        """Defect 7: replies (roster, pong, ...) to a client that never reads were queued without
        bound; now its requests are not read while its replies are not drained (TCP backpressure),
        and whatever is queued counts against its 8 MiB bound."""
        relayd = await Relayd.start(self)
        emitter = await raw_socket(relayd.port, role="emitter")
        sessions = [f"claimed-{i:03d}-" + "s" * 200 for i in range(100)]  # a roster reply is ~25 KB
        for seq, session in enumerate(sessions):
            emitter.send(event(session, seq))
        await ping(emitter)  # answered after the events before it: the sessions are claimed
        checker = await raw_socket(relayd.port)
        roster = checker.wait(is_text(b'"roster"'))
        checker.send({"type": "roster", "id": 0})
        self.assertEqual(len(json.loads(await roster)["entries"]), len(sessions))
        base = relayd.rss()

        requests = 2500
        clients = []
        for _ in range(2):
            client = await raw_socket(relayd.port, keep=lambda p: b'"t":"end"' in p, counted=b'"type":"roster"')
            client.transport.pauseProducing()  # never reads
            client.transport.write(b"".join(_masked(b'{"type":"roster","id":%d}' % i) for i in range(requests)))
            client.send({"type": "ping", "t": "end"})
            clients.append(client)
        await relayd.settle()
        relayd.assert_growth(self, base, len(clients), "WebSocket replies to clients that never read")

        for client in clients:
            done = client.wait(is_text(b'"t":"end"'))
            client.transport.resumeProducing()
            await done  # every request answered, in order, and the client was never cut off
            self.assertEqual(client.count, requests)
            client.transport.abortConnection()
        await relayd.stop()

    async def test_routed_commands_to_an_emitter_that_never_reads_cut_it_off(self) -> None:
        """Defect 7: routed control commands were queued to their target without bound; now they
        count against its bound and past 8 MiB it is cut off (closing, close 1013), and further
        commands to its session have no route."""
        token = "tok"
        relayd = await Relayd.start(self, "--aep-token", token)
        emitter = await raw_socket(relayd.port, role="emitter", headers={"authorization": f"Bearer {token}"},
                                   keep=lambda p: b'"closing"' in p)
        emitter.send(event("C", 0))
        await ping(emitter)
        checker = await raw_socket(relayd.port, headers={"authorization": f"Bearer {token}"})
        roster = checker.wait(is_text(b'"roster"'))
        checker.send({"type": "roster", "id": 0})
        self.assertEqual([e["session"] for e in json.loads(await roster)["entries"]], ["C"])
        emitter.transport.pauseProducing()  # never reads the commands sent to it
        base = relayd.rss()

        for batch in range(60):  # ~60 MB of commands, in POSTs of ~1 MB (each costs the relay its size)
            await relayd.post([event("C", None, "control.pause", id=f"c{batch}-{i}", data={"pad": PAD})
                               for i in range(1000)], token=token)
        await relayd.settle()
        relayd.assert_growth(self, base, 1, "routed commands to an emitter that never reads")

        roster = checker.wait(is_text(b'"roster"'))
        checker.send({"type": "roster", "id": 1})
        self.assertEqual(json.loads(await roster)["entries"], [])  # the emitter was cut off: no claim left
        emitter.transport.resumeProducing()
        await emitter.lost.addTimeout(TIMEOUT, reactor)
        assert_cut_off(self, emitter)
        await relayd.stop()


def assert_cut_off(tc: TestCase, client: RawSocket) -> None:
    """C{client}'s connection ended with a backpressure cut-off: a C{closing} frame and close 1013,
    unless relayd dropped it after its close handshake timed out (the client read too late: its
    kernel then discards what it had not read, those frames included)."""
    closing = [json.loads(p) for op, p in client.frames if op == 1 and b'"closing"' in p]
    if closing or client.close_code() is not None:
        tc.assertEqual(closing[0]["reason"], "backpressure")
        tc.assertEqual(client.close_code(), 1013)


def _masked(payload: bytes) -> bytes:
    """A masked client text frame (for writing many at once)."""
    key = os.urandom(4)
    size = len(payload)
    head = bytes([0x81, 0x80 | size]) if size < 126 else bytes([0x81, 0x80 | 126]) + struct.pack("!H", size)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


# Subscriptions ------------------------------------------------------------------------------------


class SubscriptionCaps(TestCase):
    async def test_subscriptions_per_connection_are_capped_in_band(self) -> None:
        """Defect 8: exactly the cap is accepted; one more is refused with limit-exceeded and its id;
        replacing an id at the cap is allowed; an unsubscribe frees a place."""
        relay = await start_relay(self, aep_max_subscriptions=3)
        client = await open_ws(self, relay, hello={"role": "consumer"})
        for sub_id in (1, 2, 3):
            client.send({"type": "subscribe", "id": sub_id})
            self.assertEqual(await client.recv(), {"type": "subscribed", "id": sub_id})
        client.send({"type": "subscribe", "id": 4})
        refusal = await client.recv()
        self.assertEqual((refusal["type"], refusal["code"], refusal["id"]), ("error", "limit-exceeded", 4))
        self.assertIn("3", refusal["detail"])
        client.send({"type": "subscribe", "id": 2, "filter": {"session": "x"}})  # a replacement, not a 4th
        self.assertEqual(await client.recv(), {"type": "subscribed", "id": 2})
        client.send({"type": "unsubscribe", "id": 1})
        self.assertEqual(await client.recv(), {"type": "unsubscribed", "id": 1})
        client.send({"type": "subscribe", "id": 4})
        self.assertEqual(await client.recv(), {"type": "subscribed", "id": 4})
        self.assertEqual(len(relay.core.subscribers), 3)

    async def test_subscribers_are_capped_process_wide(self) -> None:
        """Defect 8: SSE streams and WebSocket subscriptions together stop at --aep-max-subscribers:
        an SSE stream over it gets 503 limit-exceeded before any stream header, a subscribe the
        in-band error; a closed subscriber frees its place."""
        relay = await start_relay(self, aep_max_subscribers=2)
        first = await open_sse(self, relay)
        self.assertEqual(first.response.code, 200)
        client = await open_ws(self, relay, hello={"role": "consumer"})
        client.send({"type": "subscribe", "id": "a"})
        self.assertEqual(await client.recv(), {"type": "subscribed", "id": "a"})
        refused = await open_sse(self, relay)
        self.assertEqual(refused.response.code, 503)
        self.assertEqual(json.loads(refused.refusal), {"error": "limit-exceeded", "max_subscribers": 2})
        client.send({"type": "subscribe", "id": "b"})
        refusal = await client.recv()
        self.assertEqual((refusal["code"], refusal["id"]), ("limit-exceeded", "b"))
        client.send({"type": "subscribe", "id": "a", "filter": {"session": "y"}})  # replacing is not adding
        self.assertEqual(await client.recv(), {"type": "subscribed", "id": "a"})
        await first.close()
        while len(relay.core.subscribers) > 1:
            await client.roundtrip()  # the close reaches the relay on a later reactor turn
        client.send({"type": "subscribe", "id": "b"})
        self.assertEqual(await client.recv(), {"type": "subscribed", "id": "b"})

    async def test_one_connections_subscriptions_cannot_stall_the_fan_out(self) -> None:
        """Defect 8: 10 000 subscriptions on one connection made every ingested event cost 10 000
        filter checks (a 1000-event POST stalled the process for seconds); with the cap (64) the
        rest are refused and the POST's fan-out is quick."""
        relayd = await Relayd.start(self)
        client = await raw_socket(relayd.port, keep=lambda p: b'"subscribed"' not in p, counted=b'"subscribed"')
        count = 10_000
        done = client.wait(is_text(b'"t":"end"'))
        client.transport.write(b"".join(
            _masked(b'{"type":"subscribe","id":%d,"filter":{"session":"none-%d"}}' % (i, i)) for i in range(count)
        ))
        client.send({"type": "ping", "t": "end"})
        await done
        started = time.perf_counter()
        await relayd.post([event("F", seq) for seq in range(1000)])
        elapsed = time.perf_counter() - started
        print(f"\n1000-event POST with one connection at its subscription cap: {elapsed * 1000:.0f} ms")
        self.assertLess(elapsed, 1.0)
        refused = [json.loads(p) for op, p in client.frames if op == 1 and b'"limit-exceeded"' in p]
        self.assertEqual((client.count, len(refused)), (64, count - 64))  # one answer per subscribe
        response = await treq.get(f"http://127.0.0.1:{relayd.port}/healthz", pool=relayd.pool)
        self.assertEqual(json.loads(await treq.content(response))["subscribers"], 64)
        await relayd.stop()


class RepeatedFrom(TestCase):
    async def test_sse_replays_a_session_named_twice_once_from_its_earliest_position(self) -> None:
        relay = await start_relay(self)
        await relay.post(*[event("D", seq) for seq in range(5)])
        stream = await open_sse(self, relay, live="0", from_=[{"session": "D", "seq": 2}, {"session": "D"},
                                                             {"session": "D", "seq": 3}])
        messages = await stream.read_until_end()
        self.assertEqual([m.json()["seq"] for m in messages if m.data], [0, 1, 2, 3, 4])
        self.assertEqual([m.comment for m in messages if m.comment], ["replay-complete"])

    async def test_websocket_replays_a_session_named_twice_once(self) -> None:
        relay = await start_relay(self)
        await relay.post(*[event("D", seq) for seq in range(5)])
        client = await open_ws(self, relay, hello={"role": "consumer"})
        client.send({"type": "subscribe", "id": 1, "from": [{"session": "D", "seq": 1}] * 200 + [{"session": "D", "seq": 3}]})
        self.assertEqual(await client.recv(), {"type": "subscribed", "id": 1})
        self.assertEqual([m["seq"] for m in await client.roundtrip()], [2, 3, 4])


# WebSocket close handshake --------------------------------------------------------------------------


class CloseCodes(TestCase):
    """Defect 10: violations were answered with a TCP reset; now with a Close frame and the code
    aep.md names, and nothing follows relayd's Close frame (no heartbeat ping)."""

    async def _violate(self, frame: Callable[[RawSocket], None], **flags: Any) -> RawSocket:
        relay = await start_relay(self, **flags)
        port = int(relay.url.rsplit(":", 1)[1])
        client = await raw_socket(port)
        self.addCleanup(hang_up, client)
        close = client.wait(is_close)
        frame(client)
        payload = await close
        client.send_frame(payload[:2], opcode=8)  # the client's half of the closing handshake
        await client.lost.addTimeout(TIMEOUT, reactor)
        self.assertEqual(client.frames[-1][0], 8)  # nothing after the Close frame
        return client

    async def test_invalid_utf8_text_closes_with_1007(self) -> None:
        client = await self._violate(lambda c: c.send_frame(b'{"type":"ping","t":"\xff\xfe"}'))
        self.assertEqual(client.close_code(), 1007)

    async def test_message_over_the_limit_closes_with_1009(self) -> None:
        client = await self._violate(lambda c: c.send_frame(b"x" * 1025), aep_max_body=1024)
        self.assertEqual(client.close_code(), 1009)

    async def test_message_at_the_limit_is_handled(self) -> None:
        relay = await start_relay(self, aep_max_body=1024)
        client = await raw_socket(int(relay.url.rsplit(":", 1)[1]))
        self.addCleanup(hang_up, client)
        message = b'{"type":"ping","t":"%s"}' % (b"y" * (1024 - 22))
        self.assertEqual(len(message), 1024)
        pong = client.wait(is_text(b'"pong"'))
        client.send_frame(message)
        self.assertEqual(json.loads(await pong)["t"], "y" * (1024 - 22))

    async def test_reserved_bits_close_with_1002(self) -> None:
        client = await self._violate(lambda c: c.send_frame(b'{"type":"ping"}', rsv=4))
        self.assertEqual(client.close_code(), 1002)

    async def test_unmasked_frame_closes_with_1002(self) -> None:
        client = await self._violate(lambda c: c.send_frame(b'{"type":"ping"}', masked=False))
        self.assertEqual(client.close_code(), 1002)

    async def test_no_heartbeat_follows_the_close_frame(self) -> None:
        """relayd closes (binary frame: 1003) and the client never answers the Close: the heartbeat
        (every second here) must not send a ping meanwhile; relayd drops the connection after its
        close handshake timeout."""
        relay = await start_relay(self, aep_heartbeat=1)
        client = await raw_socket(int(relay.url.rsplit(":", 1)[1]))
        self.addCleanup(hang_up, client)
        ping = client.wait(is_text(b'"ping"'))
        await ping  # the heartbeat runs
        client.send_frame(b"\x00", opcode=2)
        await client.lost.addTimeout(TIMEOUT, reactor)
        opcodes = [op for op, _ in client.frames]
        self.assertEqual(client.close_code(), 1003)
        self.assertEqual(opcodes[-1], 8, f"frames after the Close: {client.frames[opcodes.index(8) + 1:]}")
