"""AEP over WebSocket (``/socket``, docs/aep.md): hello gate, subscriptions, roster, ingest, claims.

Messages:
  -> hello {versions, role, identity, capabilities}     <- hello (or error + close 1002; none within
                                                           --aep-hello-timeout: error hello-timeout + close 1002)
  -> subscribe {id, filter, from, capture}              <- subscribed, replay-exhausted?, events
  -> unsubscribe {id}                                   <- unsubscribed
  -> roster {id}                                        <- roster {id, entries} (consumer/both only)
  -> ping {t}                                           <- pong {t}
  -> <event envelope>                                   <- nothing, or error invalid-event
                                                        <- ping {t} every heartbeat, closing on backpressure

Everything sent to a client counts against its backlog bound (docs/aep.md): replies, routed commands,
replays and live events alike. While the client does not read what it was sent (the transport
paused this connection) or a replay is being sent, what it sends waits, unread, and so adds nothing.

A subscribe is a newcomer's work: the site starts a share of them per reactor turn with its new
connections' first requests (relayd.web.admission), and the rest wait for a later turn in arrival
order (L{SocketFlow.wait_for_turn}), so a storm of them never stalls the subscribers already connected.
"""

from __future__ import annotations

from typing import Any, Callable, cast

from autobahn.twisted.websocket import WebSocketServerFactory
from autobahn.websocket.types import ConnectionRequest
from twisted.internet.defer import succeed
from twisted.internet.interfaces import ITCPTransport
from twisted.logger import Logger
from twisted.python.failure import Failure

from relayd.aep import metrics
from relayd.aep.core import backlog
from relayd.aep.core.backlog import held_size
from relayd.aep.core.capture import capture_error
from relayd.aep.core.event import Event, JSONError, admit, dumps, parse_json
from relayd.aep.core.filters import Pin, compile_filter, filter_error, near_misses, pin_of
from relayd.aep.core.ingest import event_or_problem
from relayd.aep.core.relay import (
    EventRelay,
    ReplayProducer,
    ReplayReader,
    Subscriber,
    error_frame,
)
from relayd.aep.core.store import Position
from relayd.aep.query import parse_from_entries
from relayd.aep.socket_flow import SocketFlow
from relayd.aep.socket_phases import SHUT, AwaitingHello, Greeted, Phase, PhasedEmitter
from relayd.aep.wire import ws_message
from relayd.base.clock import NextTurn, Timekeeper
from relayd.base.config import show_value
from relayd.base.errors import OutcomeUnknown, StoreUnavailable
from relayd.compat.tcp import no_delay
from relayd.web.admission import Admission

ROLES = ("emitter", "consumer", "both")
CLOSE_GOING_AWAY = 1001
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_INVALID_PAYLOAD = 1007
CLOSE_TRY_AGAIN_LATER = 1013
DEFAULT_HELLO_TIMEOUT = 10.0  # --aep-hello-timeout



def subscription_key(sub_id: Any) -> Any:
    """A hashable key for a subscription id, which may be any JSON value (an object or array too).

    Equal JSON values are the same id; C{true} is not C{1} (in Python C{True == 1}), C{1} is C{1.0}.
    """
    if isinstance(sub_id, bool):
        return ("bool", sub_id)
    if isinstance(sub_id, (list, dict)):
        return ("json", dumps(sub_id))
    return sub_id


class WSSubscription(Subscriber):
    """One subscription of one connection; remembers the last position sent per session."""

    __slots__ = ("conn", "sub_id", "delivered")

    def __init__(
        self,
        match: Callable[[dict[str, Any]], bool],
        ceiling: str | None,
        conn: AEPSocket,
        sub_id: Any,
        pin: Pin | None = None,
    ):
        super().__init__(match, ceiling, pin)
        self.conn = conn
        self.sub_id = sub_id
        self.delivered: dict[str, Position] = {}

    def send(self, event: Event) -> None:
        self.conn.send_event(self, event, self.level(event))

    def held(self, event: Event) -> None:
        self.conn.hold_event(self, event, self.level(event))


class WSReplay(ReplayProducer):
    """One subscription's replay, queued a chunk at a time as the client reads (the connection
    calls it while it is not paused)."""

    __slots__ = ("conn",)

    def __init__(self, conn: AEPSocket, sub: WSSubscription, reader: ReplayReader) -> None:
        super().__init__(sub, reader)
        self.conn = conn

    def send_marker(self, session: str, epoch: int, seq: int) -> int:
        frame = {"type": "replay-exhausted", "sub": self.sub.sub_id, "session": session,  # type: ignore[attr-defined]
                 "earliest": {"epoch": epoch, "seq": seq}}
        message = self.conn.factory.prepareMessage(dumps(frame))
        self.conn._enqueue(message, None, None)
        return len(message.payloadHybi)

    def send_event(self, event: Event) -> int:
        # The capture ceiling applies to replay too (docs/decisions.md AEP-1).
        message = ws_message(event, self.sub.level(event), self.conn.factory)
        self.conn._enqueue(message, self.sub, event)
        return len(message.payloadHybi)

    def stalled(self) -> bool:
        return self.conn.paused or not self.conn._open

    def alive(self) -> bool:
        return self.conn._open

    def finished(self) -> None:
        self.conn.replay_sent()

    def failed(self, failure: Failure) -> None:
        self.conn._replay_failed(failure, self.sub)  # type: ignore[arg-type]


class AEPSocket(SocketFlow, PhasedEmitter):  # type: ignore[misc]  # autobahn's own bases disagree on two attributes
    """One ``/socket`` connection: the hello gate and the message handlers (its flow: L{SocketFlow}).

    Its state is one L{Phase} (L{relayd.aep.socket_phases}): L{SHUT}, L{AwaitingHello} from the
    upgrade, L{Greeted} from the hello, L{SHUT} again once closed; what exists only in a phase lives
    in its object, and the handlers after the hello are handed the L{Greeted} one.
    """

    _log = Logger()  # autobahn owns self.log
    factory: AEPSocketFactory

    def __init__(self) -> None:
        super().__init__()
        self.phase: Phase = SHUT

    # Lifecycle -------------------------------------------------------------------------------

    def onConnect(self, request: ConnectionRequest) -> str | None:
        # No AEP subprotocol exists; accept the first one offered so browsers that send one connect.
        return request.protocols[0] if request.protocols else None

    def onOpen(self) -> None:
        self.start_flow()
        self.factory.connections[self] = None
        no_delay(self.transport)
        self.factory.relay.connect(self, self)
        self.phase = AwaitingHello(self.factory.clock.deadline(self.factory.hello_timeout, self._hello_late))

    def _hello_late(self) -> None:
        phase = self.phase
        if type(phase) is not AwaitingHello:
            return
        phase.deadline = None
        if self.state == self.STATE_OPEN:
            self.send_frame(error_frame("hello-timeout", f"no hello within {show_value(self.factory.hello_timeout)} s"))
            self.close_with(CLOSE_PROTOCOL_ERROR, "hello timeout")

    def onClose(self, wasClean: bool, code: int | None, reason: str | None) -> None:
        # autobahn leaves its close handshake timer running when it drops the connection on a
        # second violation during the handshake: a closed connection keeps no timer.
        if self.state == self.STATE_CLOSED and self.closeHandshakeTimeoutCall is not None:
            self.closeHandshakeTimeoutCall.cancel()
            self.closeHandshakeTimeoutCall = None
        phase = self.phase
        if phase is SHUT:
            return
        if type(phase) is AwaitingHello:
            self.factory.clock.cancel(phase.deadline)
        self.ingest_events()  # what arrived before the close still counts
        self.stop_flow()
        self.factory.connections.pop(self, None)
        relay = self.factory.relay
        if type(phase) is Greeted:
            for key in phase.subscriptions:
                relay.unsubscribe((self, key))
        relay.disconnect(self)  # (it reads the claims: the phase goes after it)
        self.phase = SHUT

    # Sending ---------------------------------------------------------------------------------

    def send_frame(self, frame: dict[str, Any]) -> None:
        """Send a protocol frame (never skipped for a slow client, but counted in its backlog)."""
        self._enqueue(self.factory.prepareMessage(dumps(frame)), None, None)

    def send_command(self, event: Event) -> None:
        """A routed command, forwarded byte-identically as a bare envelope."""
        self._enqueue(ws_message(event, None, self.factory), None, None)

    def send_event(self, sub: WSSubscription, event: Event, level: str | None) -> None:
        if self.paused and backlog.sheds(event, self._queued_bytes):
            return
        self._enqueue(ws_message(event, level, self.factory), sub, event)

    def hold_event(self, sub: WSSubscription, event: Event, level: str | None) -> None:
        """Hold a live event of C{sub} while its replay is sent, within the backlog bounds (what is
        held has not been sent either)."""
        if not self._open:
            return
        size = held_size(event, level)
        verdict = backlog.hold(event, self._queued_bytes + sub.held_bytes + size)
        if verdict == "keep":
            sub.keep_held(event, size)
        elif verdict == "cut-off":
            self._backpressure_close()

    def _backpressure_close(self) -> None:
        phase = self.phase
        subscriptions = phase.subscriptions.values() if type(phase) is Greeted else ()
        delivered = [
            {"sub": sub.sub_id, "session": session, "epoch": pos[0], "seq": pos[1]}
            for sub in subscriptions
            for session, pos in sub.delivered.items()
        ]
        discarded = sum(1 for _, sub, event in self._queue if event is not None)
        discarded += sum(len(sub._held or ()) for sub in subscriptions)
        if discarded:
            backlog.CUT_OFF.inc(discarded)
        self._queue = []
        self._queued_bytes = 0
        self.sendMessage(dumps({"type": "closing", "reason": "backpressure", "delivered": delivered}))
        self.close_with(CLOSE_TRY_AGAIN_LATER, "backpressure")
        self.onClose(False, CLOSE_TRY_AGAIN_LATER, "backpressure")

    # Receiving -------------------------------------------------------------------------------

    def _on_message(self, payload: bytes, isBinary: bool) -> None:
        if isBinary:
            self.ingest_events()  # whatever answers a message, the events before it come first
            self.send_frame(error_frame("binary-unsupported"))
            self.close_with(CLOSE_UNSUPPORTED_DATA, "binary unsupported")
            return
        phase = self.phase
        if type(phase) is Greeted:
            event = admit(payload)  # the usual frame: a plainly valid event (no control frame passes)
            if event is not None:
                self._add_event(phase, event)
                return
        try:
            msg = parse_json(payload)
        except JSONError as e:
            self.ingest_events()
            if not _is_utf8(payload):
                # RFC 6455 8.1: a text message that is not UTF-8 fails the connection; the Close
                # frame's reason is the detail an HTTP ingest of the same bytes names.
                self._not_text = True
                if self.state == self.STATE_OPEN:
                    self.close_with(CLOSE_INVALID_PAYLOAD, str(e))
                return
            self.send_frame(error_frame("bad-json", str(e)))
            return
        if not isinstance(msg, dict):
            self.ingest_events()
            self.send_frame(error_frame("bad-json", "a message is one JSON object"))
            return
        kind = msg.get("type")
        if type(phase) is AwaitingHello:
            if kind != "hello":
                self.send_frame(error_frame("hello-required"))
                self.close_with(CLOSE_PROTOCOL_ERROR, "hello required")
                return
            self.on_hello(phase, msg)
            return
        if type(phase) is not Greeted:
            return  # (shut: nothing is read)
        if isinstance(kind, str) and "." in kind:
            self.on_event(phase, msg, payload)
            return
        self.ingest_events()  # events sent before this frame come first
        handler = _FRAME_HANDLERS.get(kind) if isinstance(kind, str) else None
        if handler is not None:
            # Frames are few: parse them exactly (resume positions, echoed ids and ping times).
            msg = parse_json(payload, exact=True)
            handler(self, phase, msg)
        # Unknown frames (and a second hello) are ignored (AEP-0003 §2).

    def on_hello(self, phase: AwaitingHello, msg: dict[str, Any]) -> None:
        versions = msg.get("versions")
        if not isinstance(versions, list) or "0.1" not in versions:
            self.send_frame(error_frame("version-unsupported", versions=["0.1"]))
            self.close_with(CLOSE_PROTOCOL_ERROR, "version unsupported")
            return
        role = msg.get("role", "both")
        identity = msg.get("identity", {})
        capabilities = msg.get("capabilities", {})
        if role not in ROLES:
            problem = "role must be one of emitter, consumer, both"
        elif not isinstance(identity, dict) or not isinstance(capabilities, dict):
            problem = "identity and capabilities must be objects"
        elif role != "consumer" and "agent" in identity and not isinstance(identity["agent"], str):
            problem = "identity.agent must be a string"
        else:
            problem = None
        if problem is not None:
            self.send_frame(error_frame("bad-hello", problem))
            self.close_with(CLOSE_PROTOCOL_ERROR, "bad hello")
            return
        self.factory.clock.cancel(phase.deadline)
        self.phase = Greeted(role, identity, capabilities)
        relay = self.factory.relay
        self.send_frame(
            {
                "type": "hello",
                "versions": ["0.1"],
                "role": "both",
                "identity": {"agent": "aep-relay"},
                "capabilities": relay.discovery["capabilities"],
            }
        )

    def on_event(self, phase: Greeted, msg: dict[str, Any], payload: bytes) -> None:
        verdict = event_or_problem(msg, payload)  # (the verdict an HTTP batch's line gets)
        if type(verdict) is str:
            self.ingest_events()  # the events before this one are refused or routed first
            metrics.ingest_refused.labels(relay="aep", reason="invalid-event").inc()
            self.send_frame(error_frame("invalid-event", verdict, cause=msg.get("id")))
            return
        # The events of one read are ingested together at the end of the reactor turn (one store
        # write, one publish); a frame that follows them in the same read waits for them.
        self._add_event(phase, verdict)  # type: ignore[arg-type]

    def _add_event(self, phase: Greeted, event: Event) -> None:
        events = phase.events
        events.append(event)
        if len(events) == 1:
            self.factory.schedule_events(self)

    def ingest_events(self) -> None:
        """Hand the events received this turn to the relay, in order."""
        phase = self.phase
        if type(phase) is not Greeted or not phase.events:
            return
        events, phase.events = phase.events, []
        self.factory.relay.ingest(events, self).addErrback(self._store_failed, [e.key[1] for e in events])

    def _store_failed(self, failure: Any, causes: list[Any]) -> None:
        metrics.store_errors.labels(relay="aep", operation="append").inc()
        if failure.check(OutcomeUnknown):  # the events may be stored: a resend of the same ids is safe
            code, detail = "outcome-unknown", "event store did not answer in time; the event may have been stored"
        else:
            code, detail = "unavailable", "event store unavailable"
        for cause in causes:
            self.send_frame(error_frame(code, detail, cause=cause))

    def on_subscribe(self, phase: Greeted, msg: dict[str, Any]) -> None:
        admission = self.factory.admission
        if admission is None or admission.starts_now():
            self.start_subscription(phase, msg)
        else:
            self.wait_for_turn(admission, lambda: self.start_subscription(phase, msg))

    def start_subscription(self, phase: Greeted, msg: dict[str, Any]) -> None:
        """Check the subscribe C{msg}, then subscribe: its filter, its place among the relay's
        subscribers, its C{subscribed} and its replay (or the error that refuses it)."""
        sub_id = msg.get("id")
        relay = self.factory.relay
        flt = msg.get("filter")
        flt = {} if flt is None else flt
        problem = filter_error(flt)
        if problem is not None:
            self.send_frame(error_frame("invalid-filter", problem, id=sub_id))
            return
        ceiling = msg.get("capture")
        if ceiling is not None:
            problem = capture_error(ceiling)
            if problem is not None:
                self.send_frame(error_frame("invalid-filter", problem, id=sub_id))
                return
        from_value = msg.get("from", [])
        from_all = from_value == "all"
        entries: list[tuple[str, Position]] = []
        if not from_all:
            if not isinstance(from_value, list):
                self.send_frame(
                    error_frame(
                        "invalid-filter",
                        'from must be an array of resume positions or the string "all"',
                        id=sub_id,
                    )
                )
                return
            if len(from_value) > relay.max_from:
                self.send_frame(
                    error_frame(
                        "limit-exceeded",
                        f"from exceeds AEP_MAX_FROM={relay.max_from} resume positions",
                        id=sub_id,
                    )
                )
                return
            try:
                entries = parse_from_entries(from_value)
            except ValueError as e:
                self.send_frame(error_frame("invalid-filter", str(e), id=sub_id))
                return
        key = subscription_key(sub_id)
        limit = self.factory.max_subscriptions
        subscriptions = phase.subscriptions
        if key not in subscriptions and len(subscriptions) >= limit:
            detail = f"subscriptions on one connection exceed AEP_MAX_SUBSCRIPTIONS={limit}"
            self.send_frame(error_frame("limit-exceeded", detail, id=sub_id))
            return
        sub = WSSubscription(compile_filter(flt), ceiling, self, sub_id, pin_of(flt))
        sub.hold()
        if not relay.subscribe((self, key), sub):
            detail = f"subscribers exceed AEP_MAX_SUBSCRIBERS={relay.max_subscribers}"
            self.send_frame(error_frame("limit-exceeded", detail, id=sub_id))
            return
        subscriptions[key] = sub  # a reused id replaces the older subscription
        subscribed: dict[str, Any] = {"type": "subscribed", "id": sub_id}
        warnings = near_misses(flt)  # (what the SSE stream says in comments)
        if warnings:
            subscribed["warnings"] = warnings
        # Until the replay and what the subscription held meanwhile are queued, what the client
        # sends waits (messages are answered in order), whatever the store's latency.
        self._replaying = True
        heard, sub.heard = sub.heard, None
        if heard is None:
            self._confirm_subscription(sub, subscribed, entries, from_all)
        else:  # "subscribed" promises the other instances' events from now on: once Redis hears them here
            heard.addCallback(lambda _: self._confirm_subscription(sub, subscribed, entries, from_all))

    def _confirm_subscription(
        self, sub: WSSubscription, subscribed: dict[str, Any], entries: list[tuple[str, Position]], from_all: bool
    ) -> None:
        """Say C{subscribed}, then send the replay."""
        if not self._open:
            return
        self.send_frame(subscribed)
        d = self.factory.relay.expand_all() if from_all else succeed(entries)
        d.addCallbacks(
            lambda named: self._start_replay(sub, named, from_all), self._replay_failed, errbackArgs=(sub,)
        )

    def _replay_failed(self, failure: Any, sub: WSSubscription) -> None:
        """The history could not be read: the subscription is withdrawn and the client told so."""
        if failure.check(StoreUnavailable):
            self._log.warn("replay refused: {reason}", reason=failure.getErrorMessage())
        else:
            self._log.failure("replay failed", failure)
        metrics.store_errors.labels(relay="aep", operation="replay").inc()
        metrics.replays.labels(relay="aep", outcome="failed").inc()
        self._replay.stop()
        key = subscription_key(sub.sub_id)
        phase = self.phase
        if type(phase) is Greeted and phase.subscriptions.get(key) is sub:
            del phase.subscriptions[key]
            self.factory.relay.unsubscribe((self, key))
        self.send_frame(error_frame("unavailable", "event history unavailable", id=sub.sub_id))
        self.replay_sent()

    def _start_replay(self, sub: WSSubscription, entries: list[tuple[str, Position]], from_all: bool) -> None:
        """Send the replay as the client reads (L{WSReplay}), from the next flush on."""
        if not self._open:
            return
        self._replay.start(WSReplay(self, sub, self.factory.relay.reader(sub, entries, from_all)))

    def on_unsubscribe(self, phase: Greeted, msg: dict[str, Any]) -> None:
        sub_id = msg.get("id")
        key = subscription_key(sub_id)
        if phase.subscriptions.pop(key, None) is not None:
            self.factory.relay.unsubscribe((self, key))
        self.send_frame({"type": "unsubscribed", "id": sub_id})

    def on_roster(self, phase: Greeted, msg: dict[str, Any]) -> None:
        if phase.role == "emitter":
            self.send_frame(
                error_frame("unauthorized", "roster is answered on consumer/both connections", id=msg.get("id"))
            )
            return
        roster_id = msg.get("id")
        d = self.factory.relay.roster()
        d.addCallback(lambda entries: self.send_frame({"type": "roster", "id": roster_id, "entries": entries}))
        d.addErrback(
            lambda f: self.send_frame(error_frame("unavailable", f"roster unavailable: {f.getErrorMessage()}", id=roster_id))
        )

    def on_ping(self, phase: Greeted, msg: dict[str, Any]) -> None:
        self.send_frame({"type": "pong", "t": msg.get("t")})

    def listing(self) -> dict[str, Any] | None:
        """This connection in C{GET /connections} (C{None} before its hello)."""
        phase = self.phase
        if type(phase) is not Greeted:
            return None
        control = phase.capabilities.get("control")
        accepts = control.get("accepts") if isinstance(control, dict) else None
        return {
            "role": phase.role,
            "identity": phase.identity,
            "accepts": accepts,
            "sessions": list(phase.claims),
            "subscriptions": len(phase.subscriptions),
        }


_FRAME_HANDLERS: dict[str, Callable[[AEPSocket, Greeted, dict[str, Any]], None]] = {
    "subscribe": AEPSocket.on_subscribe,
    "unsubscribe": AEPSocket.on_unsubscribe,
    "roster": AEPSocket.on_roster,
    "ping": AEPSocket.on_ping,
}


class AEPSocketFactory(WebSocketServerFactory):
    """The ``/socket`` factory: its connections, one shared ping loop, drain."""

    protocol = AEPSocket  # type: ignore[assignment]  # autobahn types it as a generic protocol factory

    def __init__(
        self,
        relay: EventRelay,
        clock: Timekeeper,
        *,
        heartbeat: float,
        max_message: int,
        max_subscriptions: int = 64,
        hello_timeout: float = DEFAULT_HELLO_TIMEOUT,
    ) -> None:
        super().__init__()
        self.relay = relay
        self.clock = clock
        self.hello_timeout = hello_timeout
        self.max_subscriptions = max_subscriptions
        self.connections: dict[AEPSocket, None] = {}
        self.admission: Admission | None = None
        """The site's count of newcomers started per reactor turn, which subscriptions' starts join
        (relayd.web.admission; set once the site exists); C{None}: every subscribe starts at once."""
        self.setProtocolOptions(
            maxMessagePayloadSize=max_message,
            maxFramePayloadSize=max_message,
            # A violation (invalid UTF-8, too big, a protocol error) is answered with a Close frame
            # and its code (1007, 1009, 1002), as docs/aep.md says, not with a dropped connection.
            failByDrop=False,
            # Text messages are checked for UTF-8 whole, by the JSON reader, so that the 1007 Close
            # names the fault as an HTTP ingest does (autobahn's own check has its own words).
            utf8validateIncoming=False,
            autoPingInterval=0,  # AEP has its own JSON ping, sent by one shared loop below
            openHandshakeTimeout=10,
            # A backpressure close waits behind what the client has not read yet: give it time.
            closeHandshakeTimeout=5,
        )
        self._loop = clock.looping_call(heartbeat, self.ping_all)
        self._dirty: list[SocketFlow] = []
        self._flush_turn = NextTurn(clock, self.flush)
        self._with_events: list[AEPSocket] = []
        self._events_turn = NextTurn(clock, self.ingest_events)

    def schedule_events(self, conn: AEPSocket) -> None:
        """Ingest C{conn}'s events at the end of this reactor turn, with every other connection's."""
        self._with_events.append(conn)
        if self._events_turn.scheduled is None:  # (the hot path: no call once it is)
            self._events_turn.request()

    def ingest_events(self) -> None:
        pending, self._with_events = self._with_events, []
        for conn in pending:
            conn.ingest_events()

    def schedule(self, conn: SocketFlow) -> None:
        """Flush C{conn} at the end of this reactor turn, with every other connection written to."""
        self._dirty.append(conn)
        if self._flush_turn.scheduled is None:  # (the hot path: no call once it is)
            self._flush_turn.request()

    def flush(self) -> None:
        dirty, self._dirty = self._dirty, []
        for conn in dirty:
            conn.flush_queue()

    def ping_all(self) -> None:
        if not self.connections:
            return
        message = self.prepareMessage(dumps({"type": "ping", "t": int(self.clock.seconds() * 1000)}))
        for conn in list(self.connections):
            conn._enqueue(message, None, None)  # (not once its closing handshake started)

    def listing(self) -> list[dict[str, Any]]:
        return [listed for listed in map(AEPSocket.listing, self.connections) if listed is not None]

    def drain(self) -> None:
        """Close every connection with 1001 (going away)."""
        self.clock.stop_loop(self._loop)
        for conn in list(self.connections):
            conn.close_with(CLOSE_GOING_AWAY, "shutting down")

    def abort(self) -> None:
        for conn in list(self.connections):
            if conn.transport is not None:
                cast(ITCPTransport, conn.transport).abortConnection()


def _is_utf8(payload: bytes) -> bool:
    if payload.isascii():
        return True
    try:
        payload.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
