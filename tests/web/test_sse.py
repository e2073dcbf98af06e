"""Unit tests of the SSE plumbing (relayd/web/streams/sse.py) over an in-memory transport and a fake clock."""

from __future__ import annotations

from typing import Any

from twisted.internet import task
from twisted.internet.address import IPv4Address
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site

from relayd.base.clock import Timekeeper
from relayd.web.streams.sse import BEAT_SLICE, SSEHub, SSEStream, http_chunk, sse_comment, sse_event

HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class RecordingTransport(StringTransport):
    """Remembers each write call, so coalescing can be counted."""

    def __init__(self) -> None:
        super().__init__(peerAddress=IPv4Address("TCP", "127.0.0.1", 50000))
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        super().write(data)

    def writeSequence(self, data: Any) -> None:
        self.write(b"".join(data))


class StreamResource(Resource):
    isLeaf = True

    def __init__(self, hub: SSEHub, max_buffer: int) -> None:
        super().__init__()
        self.hub = hub
        self.max_buffer = max_buffer
        self.streams: list[SSEStream] = []
        self.closed: list[SSEStream] = []

    def render_GET(self, request: Any) -> int:
        stream = SSEStream(request, self.hub, max_buffer=self.max_buffer)
        stream.on_close = lambda: self.closed.append(stream)
        stream.start(HEADERS)
        self.streams.append(stream)
        return NOT_DONE_YET


class Harness:
    """A site serving SSE streams over in-memory transports, with a fake clock for everything."""

    def __init__(self, max_buffer: int = 1000, heartbeat: float = 25.0, max_lagging: int = 10**9) -> None:
        self.clock = task.Clock()
        self.hub = SSEHub(Timekeeper(self.clock), heartbeat, sse_comment("ping"), max_lagging=max_lagging)
        self.resource = StreamResource(self.hub, max_buffer)
        self.site = Site(self.resource, reactor=self.clock)

    def open(self, version: bytes = b"HTTP/1.0") -> tuple[SSEStream, RecordingTransport, Any]:
        transport = RecordingTransport()
        protocol = self.site.buildProtocol(transport.getPeer())
        protocol.makeConnection(transport)
        protocol.dataReceived(b"GET /stream " + version + b"\r\nHost: x\r\n\r\n")
        return self.resource.streams[-1], transport, protocol

    def turn(self) -> None:
        """End the current reactor turn (the hub's zero-delay flush runs)."""
        self.clock.advance(0)


def body_of(transport: RecordingTransport) -> bytes:
    return transport.value().split(b"\r\n\r\n", 1)[1]


class Framing(SynchronousTestCase):
    def test_event_lines_in_order(self) -> None:
        self.assertEqual(sse_event(b'{"a":1}', b"tool.completed", b"s:0:3"), b'event: tool.completed\ndata: {"a":1}\nid: s:0:3\n\n')

    def test_event_without_name_or_id(self) -> None:
        self.assertEqual(sse_event(b"{}"), b"data: {}\n\n")
        self.assertEqual(sse_event(b"{}", event=b"agent.heartbeat"), b"event: agent.heartbeat\ndata: {}\n\n")

    def test_comments(self) -> None:
        self.assertEqual(sse_comment("ping"), b": ping\n\n")
        self.assertEqual(sse_comment(b"replay-exhausted s 0:5"), b": replay-exhausted s 0:5\n\n")
        self.assertEqual(sse_comment("caf\u00e9"), ": caf\u00e9\n\n".encode())


class Headers(SynchronousTestCase):
    def test_status_and_headers_are_sent_at_once(self) -> None:
        harness = Harness()
        stream, transport, _ = harness.open()
        head = transport.value()
        self.assertTrue(head.startswith(b"HTTP/1.0 200 OK\r\n"), head)
        self.assertIn(b"content-type: text/event-stream", head.lower())
        self.assertIn(b"cache-control: no-cache", head.lower())
        self.assertTrue(head.endswith(b"\r\n\r\n"))  # nothing else: no event has been written
        self.assertIn(stream, harness.hub.streams)

    def test_http_11_stream_is_chunked(self) -> None:
        harness = Harness()
        stream, transport, _ = harness.open(b"HTTP/1.1")
        stream.write(b": hello\n\n")
        harness.turn()
        self.assertIn(b"transfer-encoding: chunked", transport.value().lower())
        self.assertTrue(transport.value().endswith(b"9\r\n: hello\n\n\r\n"))


class Coalescing(SynchronousTestCase):
    def test_writes_in_one_turn_become_one_transport_write(self) -> None:
        harness = Harness()
        stream, transport, _ = harness.open()
        before = len(transport.writes)
        for i in range(5):
            self.assertTrue(stream.write(sse_event(b"%d" % i)))
        self.assertEqual(len(transport.writes), before)  # nothing written yet in this turn
        harness.turn()
        self.assertEqual(len(transport.writes), before + 1)
        self.assertEqual(transport.writes[-1], b"".join(sse_event(b"%d" % i) for i in range(5)))
        harness.turn()
        self.assertEqual(len(transport.writes), before + 1)  # nothing left over

    def test_a_lone_write_per_turn_sends_its_chunk_as_given_and_leaves_nothing_queued(self) -> None:
        # (A fan-out of one event per turn: the chunk made once for every stream is sent as it is,
        # and the stream's queue, kept from turn to turn, starts each turn empty.)
        harness = Harness()
        stream, transport, _ = harness.open(b"HTTP/1.1")
        before = len(transport.writes)
        for i in range(3):
            frame = sse_event(b"%d" % i)
            encoded = http_chunk(frame)
            self.assertTrue(stream.write(frame, encoded))
            harness.turn()
            self.assertEqual(len(transport.writes), before + i + 1)
            self.assertIs(transport.writes[-1], encoded)
        stream.write(b"data: a\n\n", http_chunk(b"data: a\n\n"))
        stream.write(b"data: b\n\n", http_chunk(b"data: b\n\n"))
        harness.turn()  # two in one turn: joined, chunked once together
        self.assertEqual(transport.writes[-1], http_chunk(b"data: a\n\ndata: b\n\n"))
        harness.turn()
        self.assertEqual(len(transport.writes), before + 4)

    def test_one_flush_call_for_all_streams(self) -> None:
        harness = Harness()
        opened = [harness.open() for _ in range(3)]
        loop_calls = len(harness.clock.getDelayedCalls())
        for stream, _, _ in opened:
            stream.write(b"data: x\n\n")
            stream.write(b"data: y\n\n")
        self.assertEqual(len(harness.clock.getDelayedCalls()), loop_calls + 1)
        harness.turn()
        for _, transport, _ in opened:
            self.assertTrue(body_of(transport).endswith(b"data: x\n\ndata: y\n\n"))


class Produce(SynchronousTestCase):
    """A source's chunks: the first in the turn the stream starts (with its headers), the rest on later turns."""

    def source(self, stream: SSEStream, chunks: list[bytes]) -> Any:
        def pull() -> bool:
            stream.write(chunks.pop(0))
            return bool(chunks)

        return pull

    def test_first_chunk_is_written_in_the_turn_the_stream_starts(self) -> None:
        harness = Harness()
        stream, transport, _ = harness.open()
        stream.produce(self.source(stream, [b"one", b"two", b"three"]))
        self.assertEqual(body_of(transport), b"one")  # no turn yet: beside the headers
        harness.turn()  # (task.Clock runs the turns the pulls ask for as one)
        self.assertEqual(body_of(transport), b"onetwothree")

    def test_a_source_that_ends_its_stream_at_once(self) -> None:
        harness = Harness()
        stream, transport, _ = harness.open()

        def pull() -> bool:
            stream.close(b"all")
            return False

        stream.produce(pull)
        self.assertTrue(stream.closed)
        self.assertEqual(body_of(transport), b"all")
        self.assertEqual(harness.resource.closed, [stream])
        harness.turn()
        self.assertEqual(body_of(transport), b"all")


class Backpressure(SynchronousTestCase):
    def test_stream_is_the_push_producer_of_its_response(self) -> None:
        harness = Harness()
        stream, transport, _ = harness.open()
        # The transport pauses its producer (the channel), which pauses the request's: the stream.
        transport.producer.pauseProducing()
        self.assertTrue(stream.paused)
        transport.producer.resumeProducing()
        self.assertFalse(stream.paused)

    def test_paused_stream_queues_then_resumes(self) -> None:
        harness = Harness(max_buffer=1000)
        stream, transport, _ = harness.open()
        stream.pauseProducing()
        sent = len(transport.value())
        stream.write(b"data: 1\n\n")
        stream.write(b"data: 2\n\n")
        harness.turn()
        self.assertEqual(len(transport.value()), sent)  # held while the client does not read
        self.assertEqual(stream.backlog, 18)
        stream.resumeProducing()
        self.assertEqual(stream.backlog, 0)
        harness.turn()
        self.assertTrue(transport.value().endswith(b"data: 1\n\ndata: 2\n\n"))

    def test_backlog_counts_only_while_paused(self) -> None:
        harness = Harness(max_buffer=10)
        stream, transport, _ = harness.open()
        self.assertTrue(stream.write(b"x" * 100))  # a large write is not a slow client
        self.assertEqual(stream.backlog, 0)
        harness.turn()
        self.assertFalse(stream.closed)
        self.assertTrue(transport.value().endswith(b"x" * 100))

    def test_overflow_while_paused_aborts_the_stream(self) -> None:
        harness = Harness(max_buffer=100)
        stream, transport, _ = harness.open()
        stream.pauseProducing()
        self.assertTrue(stream.write(b"a" * 60))
        self.assertTrue(stream.write(b"b" * 40))  # exactly at the bound: still queued
        self.assertFalse(stream.write(b"c"))  # over it: aborted
        self.assertTrue(stream.closed)
        self.assertTrue(transport.disconnecting)
        self.assertEqual(harness.resource.closed, [stream])
        self.assertNotIn(stream, harness.hub.streams)
        self.assertFalse(stream.write(b"more"))
        harness.turn()
        self.assertNotIn(b"aaa", transport.value())  # the queue was dropped, not sent

    def test_lagging_streams_together_are_bounded_by_the_hub(self) -> None:
        harness = Harness(max_buffer=100, max_lagging=150)
        (one, _, _), (two, _, _), (reader, _, _) = harness.open(), harness.open(), harness.open()
        one.pauseProducing()
        two.pauseProducing()
        self.assertTrue(reader.write(b"r" * 500))  # a stream whose client reads never counts
        self.assertTrue(one.write(b"a" * 100))
        self.assertTrue(two.write(b"b" * 50))  # exactly at the hub's bound: still queued
        self.assertEqual(harness.hub.lagging, 150)
        self.assertFalse(two.write(b"c"))  # over it: the stream that wrote is cut off
        self.assertTrue(two.closed)
        self.assertFalse(one.closed)
        self.assertEqual(harness.hub.lagging, 100)  # what the cut stream held is released
        one.resumeProducing()
        harness.turn()
        self.assertEqual(harness.hub.lagging, 0)  # sent: nothing lags any more
        self.assertTrue(one.write(b"d" * 100))

    def test_stop_producing_ends_the_stream(self) -> None:
        harness = Harness()
        stream, _, _ = harness.open()
        stream.stopProducing()
        self.assertTrue(stream.closed)
        self.assertEqual(harness.resource.closed, [stream])
        self.assertEqual(harness.hub.streams, set())


class Heartbeat(SynchronousTestCase):
    def test_one_shared_heartbeat_for_every_stream(self) -> None:
        harness = Harness(heartbeat=25)
        before = len(harness.clock.getDelayedCalls())
        opened = [harness.open() for _ in range(4)]
        self.assertEqual(len(harness.clock.getDelayedCalls()), before)  # no timer per stream
        harness.clock.advance(24)
        harness.turn()
        for _, transport, _ in opened:
            self.assertEqual(body_of(transport), b"")
        harness.clock.advance(1)
        harness.turn()
        for _, transport, _ in opened:
            self.assertEqual(body_of(transport), b": ping\n\n")
        harness.clock.advance(25)
        harness.turn()
        for _, transport, _ in opened:
            self.assertEqual(body_of(transport), b": ping\n\n: ping\n\n")

    def test_closed_streams_get_no_heartbeat_and_stop_ends_it(self) -> None:
        harness = Harness(heartbeat=25)
        gone, gone_transport, _ = harness.open()
        _stays, stays_transport, _ = harness.open()
        gone.stopProducing()
        harness.clock.advance(25)
        harness.turn()
        self.assertEqual(body_of(gone_transport), b"")
        self.assertEqual(body_of(stays_transport), b": ping\n\n")
        harness.hub.stop()
        harness.clock.advance(100)
        harness.turn()
        self.assertEqual(body_of(stays_transport), b": ping\n\n")
        self.assertEqual(harness.clock.getDelayedCalls(), [])


class HeartbeatSlices(SynchronousTestCase):
    """A heartbeat round reaches BEAT_SLICE streams per reactor turn, not every stream at once."""

    def test_one_slice_per_turn_exactly_at_the_slice_and_one_over(self) -> None:
        harness = Harness(heartbeat=25)
        opened = [harness.open() for _ in range(BEAT_SLICE + 1)]
        beaten = lambda: sum(1 for _, transport, _ in opened if body_of(transport) == b": ping\n\n")  # noqa: E731
        harness.hub.beat()  # a round starts (as the heartbeat loop calls it): the first slice, this turn
        harness.hub.flush()
        self.assertEqual(beaten(), BEAT_SLICE)
        harness.turn()  # the next turn: the one stream left
        self.assertEqual(beaten(), BEAT_SLICE + 1)
        harness.turn()
        self.assertEqual(beaten(), BEAT_SLICE + 1)  # each stream once per round

    def test_streams_closed_during_a_round_are_skipped_and_stop_ends_the_round(self) -> None:
        harness = Harness(heartbeat=25)
        opened = [harness.open() for _ in range(2 * BEAT_SLICE + 1)]
        harness.hub.beat()
        harness.hub.flush()
        waiting = [(stream, transport) for stream, transport, _ in opened if body_of(transport) == b""]
        self.assertEqual(len(waiting), BEAT_SLICE + 1)  # two slices to go
        late, late_transport = waiting[0]
        late.stopProducing()  # gone before its slice
        harness.turn()  # the second slice
        self.assertEqual(body_of(late_transport), b"")
        self.assertEqual(sum(1 for _, t in waiting if body_of(t) == b": ping\n\n"), BEAT_SLICE)
        harness.hub.stop()  # a round in progress ends with the hub
        self.assertEqual(harness.clock.getDelayedCalls(), [])


class Drain(SynchronousTestCase):
    def test_drain_sends_the_final_comment_and_ends_every_stream(self) -> None:
        harness = Harness()
        opened = [harness.open() for _ in range(2)]
        opened[0][0].write(b"data: pending\n\n")  # queued, not yet flushed: goes out before the final
        harness.hub.drain(sse_comment("shutting-down"))
        self.assertTrue(body_of(opened[0][1]).endswith(b"data: pending\n\n: shutting-down\n\n"))
        for stream, transport, _ in opened:
            self.assertTrue(stream.closed)
            self.assertTrue(body_of(transport).endswith(b": shutting-down\n\n"))
            self.assertTrue(stream.request.finished)
            self.assertTrue(transport.disconnecting)  # HTTP/1.0: the response ends the connection
        self.assertEqual(harness.hub.streams, set())
        self.assertEqual(len(harness.resource.closed), 2)

    def test_drain_of_a_paused_stream_still_sends_everything(self) -> None:
        harness = Harness(max_buffer=1000)
        stream, transport, _ = harness.open(b"HTTP/1.1")
        stream.pauseProducing()
        stream.write(b"data: held\n\n")
        harness.hub.drain(sse_comment("shutting-down"))
        self.assertIn(b"data: held\n\n: shutting-down\n\n", transport.value())
        self.assertTrue(transport.value().endswith(b"0\r\n\r\n"))  # the chunked response ended

    def test_client_going_away_closes_the_stream(self) -> None:
        harness = Harness()
        stream, _, protocol = harness.open()
        protocol.connectionLost(Failure(ConnectionError("gone")))
        self.assertTrue(stream.closed)
        self.assertEqual(harness.resource.closed, [stream])
        self.assertFalse(stream.write(b"data: late\n\n"))
        stream.close(b": bye\n\n")  # closing a gone stream is harmless
        self.assertEqual(harness.resource.closed, [stream])
