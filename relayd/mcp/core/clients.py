"""The standard endpoint's client sessions: the MCP core of relayd's Streamable HTTP and HTTP+SSE
transports (L{relayd.mcp.endpoint}).

A client session is, to the tunnel, one labelled C{outbound} reader of the tunnel session: its
requests go to the page through L{TunnelRelay.forward} with its label, so the tunnel's collision-free
reply routing makes ids unique among clients and brings each reply back to this client's sink with
the client's own id. How a transport's client sessions behave (whether one outlives its requests,
whether its answers ride its stream) is a L{ClientKind} the transport hands in: the core names no
protocol revision.

Here: the client sessions (L{Client}), their pending requests (L{Pending}) with timers, progress and
cancellation, the resumable event buffer, the bounds, the eviction of idle ones and the reaper
(L{Clients}). No HTTP: a transport hands each forwarded request a L{Reply} and each client stream a
L{Listener}, and writes what they are given in its own framing.
"""

from __future__ import annotations

import secrets
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any, Final, Protocol

from twisted.logger import Logger

from relayd.base.clock import Timekeeper
from relayd.base.coroutine import run
from relayd.mcp import metrics
from relayd.mcp.core import standard
from relayd.mcp.core.addresses import bound_key
from relayd.mcp.core.frames import Frame
from relayd.mcp.core.jsontext import dumps, loads_json
from relayd.mcp.core.store import ClientRecord, SubscriberRecord
from relayd.mcp.core.tokens import label_tag, relay_label
from relayd.mcp.core.tunnel import TunnelRelay

_EVICTED_CLIENTS = metrics.mcp_evictions.labels(kind="client")


@dataclass(frozen=True)
class EndpointConfig:
    """The endpoint's bounds and timings (flags in C{relayd.mcp.config})."""

    request_timeout_ms: float = 60_000
    # A request forwarded while no page reads the session gets this long for one to (re)connect
    # (a reload, a relayd restart) before it is answered with NO_PAGE instead of waiting for the
    # request timeout; the page's EventSource comes back within its 2 s retry.
    page_grace_ms: float = 1_000
    client_idle_ms: float = 1_800_000
    max_clients: int = 10_000
    clients_per_session: int = 64
    # Client sessions one client address holds on this process (0: no bound); at this bound and at
    # max_clients, idle ones (no pending request, no open stream) end first, least recently used first.
    clients_per_address: int = 1000
    pending_per_client: int = 64
    pending_per_session: int = 1000
    event_buffer_frames: int = 64
    event_buffer_bytes: int = 1024 * 1024
    # A stream whose client stops reading is cut once this many bytes wait for it (--mcp-queue-bytes).
    stream_max_bytes: int = 8 * 1024 * 1024


@dataclass(frozen=True)
class ClientKind:
    """How the client sessions of one transport behave (each transport module of
    L{relayd.mcp.endpoint} has one, and hands it to L{Clients.add}).

    @ivar lasting: C{True}: a client session outlives its requests: it is announced to the page,
        recorded for the other instances (C{--redis}), and ended by the client, by its idleness or
        by the tunnel. C{False}: it is one exchange, ended by its answer or by the client closing
        its request (its cancellation); only what the page stamped with that exchange's id
        reaches it.
    @ivar answers_on_stream: C{True}: answers and every other message ride the client session's
        one stream as they come (no request carries an answer; nothing is kept for a resumed
        stream). C{False}: an answer goes to its request's L{Reply}, the rest to the resumable
        event buffer and the session's L{Listener}.
    """

    lasting: bool
    answers_on_stream: bool


class _NoPending(dict[bytes, "Pending"]):
    """The pending requests of every client session that has none: one shared empty dict that
    refuses writes (an idle client session held an emptied dict of its own, 224 bytes, once its
    C{initialize} was answered)."""

    def __setitem__(self, key: bytes, value: Pending) -> None:
        raise TypeError("the shared empty pending table is read-only: use Client.add_pending")


_NO_PENDING: Final = _NoPending()


class Pending:
    """One forwarded request awaiting the page's answer, and the transport's L{Reply} to its client."""

    __slots__ = ("client", "key", "raw_id", "reply", "timer", "forwarded", "progress", "settled", "looking")

    def __init__(self, client: Client, key: bytes, reply: Reply | None) -> None:
        self.client = client
        self.key = key
        self.raw_id = key
        self.reply = reply  # None: answered on the client's own stream (answers_on_stream), or already answered
        self.timer: Any = None
        self.forwarded: Any = None
        self.progress: bytes | None = None
        self.settled = False
        self.looking = False  # waiting out the grace for a page (wait_for_page)

    def settle(self) -> None:
        """Count this request out of its session's pending total (once)."""
        if not self.settled:
            self.settled = True
            self.client.clients.release(self.client.session)

    def send(self, raw: bytes) -> bool:
        """A message about this request (progress, the page's request): on its stream if it may have one."""
        reply = self.reply
        return reply is not None and reply.send(raw)

    def answer(self, raw: bytes) -> None:
        """The response ends the exchange: the stream's last event, or the JSON body."""
        self.settle()
        self.client.clients.clock.cancel(self.timer)
        self.timer = None
        reply, self.reply = self.reply, None
        if self.client.kind.answers_on_stream:
            self.client.push(raw)
        elif reply is not None:
            reply.answer(raw)

    def expire(
        self, code: int = standard.REQUEST_TIMEOUT, message: str = "the page did not answer in time", reason: str = "timeout"
    ) -> None:
        """The page did not answer in time: a JSON-RPC error, and the page is told to stop (C{reason})."""
        self.timer = None
        client = self.client
        if client.take_pending(self.key) is None:
            return
        client.forget_progress(self)
        self.answer(standard.error_for(self.raw_id, code, message))
        client.cancel_at_page(self, reason)

    def page_left(self) -> None:
        """A page reader of the session went away while this was pending: look for a page after
        the grace (the rest of the time-out still stands if one comes back)."""
        if self.looking:
            return  # (already looking: its time-out's rest is kept)
        clock = self.client.clients.clock
        timer = self.timer
        rest = None if timer is None or not timer.active() else max(0.0, timer.getTime() - clock.seconds())
        self.wait_for_page(rest)

    def wait_for_page(self, timeout: float | None) -> None:
        """Forwarded while no page read the session: look again after the grace, then answer
        L{standard.NO_PAGE} if there is still none, else wait out the rest of C{timeout} (C{None}: no
        time-out, a listen stream)."""
        clock = self.client.clients.clock
        grace = self.client.clients.config.page_grace_ms / 1000
        clock.cancel(self.timer)
        rest = None if timeout is None else max(0.0, timeout - grace)
        self.looking = True
        self.timer = clock.call_later(grace, self._look_for_page, rest)

    def _look_for_page(self, rest: float | None) -> None:
        self.timer = None
        self.looking = False
        client = self.client
        if client.pending.get(self.key) is not self:
            return  # answered meanwhile (the page came back and answered)
        clients = client.clients

        def looked(hosted: bool) -> None:
            if client.pending.get(self.key) is not self:
                return
            if not hosted:
                # (The request waits in the session's backlog: a page that comes back gets it, then
                # this cancellation, and must not act on it.)
                self.expire(standard.NO_PAGE, standard.NO_PAGE_MESSAGE, "no page was reading the session")
            elif rest is not None:
                self.timer = clients.clock.call_later(rest, self.expire)

        def failed(failure: Any) -> None:
            # The store did not answer: keep waiting for the page's answer (the time-out still ends it).
            if rest is not None and client.pending.get(self.key) is self:
                self.timer = clients.clock.call_later(rest, self.expire)
            clients.tunnel.log_failure(failure, "looking for an MCP session's page failed")

        clients.tunnel.hosted(client.session).addCallbacks(looked, failed)

    def abandoned(self, _: object = None) -> None:
        """The client closed the POST before the answer (for a one-exchange session, that is its
        cancellation)."""
        client = self.client
        if self.reply is None or client.pending.get(self.key) is not self:
            return
        self.reply = None
        if not client.kind.lasting:
            client.take_pending(self.key)
            self.settle()
            client.clients.clock.cancel(self.timer)
            client.cancel_at_page(self, "client closed the request")
            client.close()


class Reply(Protocol):
    """The transport's side of one forwarded request: where what the page says about it goes."""

    def send(self, raw: bytes) -> bool:
        """A message about the request before its answer (progress, the page's own request); C{False}
        when it can have none (the client takes one JSON answer, or has gone)."""

    def answer(self, raw: bytes) -> None:
        """The response, which ends the exchange (nothing when the client has gone)."""


class Listener(Protocol):
    """A client session's stream outside any request (the transport's: an SSE stream)."""

    @property
    def closed(self) -> bool:
        """Whether it has ended."""

    def message(self, raw: bytes, event_id: bytes | None) -> None:
        """One JSON-RPC message, with its resumable event id (C{None}: not resumable)."""

    def close(self) -> None:
        """End it."""


class Client:
    """One MCP client session on one tunnel session, and the tunnel's L{Sink} for its label."""

    __slots__ = (
        "clients", "id", "session", "token", "label", "record", "kind", "pending",
        "progress", "stream", "events", "events_bytes", "next_event", "delivered", "last_used", "ended", "origin",
        "address", "answer_headers",
    )

    def __init__(
        self,
        clients: Clients,
        session: str,
        token: str,
        kind: ClientKind,
        attach: ClientRecord | None = None,
        client_id: str | None = None,
        address: str = "",
    ) -> None:
        self.clients = clients
        self.address = address  # what the per-address bound counts it under (relayd.mcp.core.addresses)
        self.id = client_id or secrets.token_urlsafe(24)  # 192 random bits
        self.session = session
        self.token = token
        self.label = attach.label if attach is not None else relay_label()
        # Created here (it announced presence and owns the shared record), or attached to a client
        # session another instance created (--redis: the client's requests may land anywhere).
        self.origin = attach is None
        self.record: SubscriberRecord | None = None
        self.kind = kind
        self.pending: dict[bytes, Pending] = _NO_PENDING  # its own dict while a request is pending
        # Made when first needed: an idle client session holds neither (memory per idle client).
        self.progress: dict[bytes, Pending] | None = None
        self.stream: Listener | None = None
        self.events: deque[tuple[int, bytes]] | None = None
        self.events_bytes = 0
        self.next_event = 1
        self.delivered = 0
        self.last_used = clients.clock.seconds()
        self.ended = False
        # What its transport answers its requests with, made by the transport once (it names the
        # client session: the same for each of its requests).
        self.answer_headers: Any = None

    def add_pending(self, key: bytes, pending: Pending) -> None:
        """Remember a forwarded request until its answer (a dict of its own from the first one)."""
        if self.pending is _NO_PENDING:
            self.pending = {}
        self.pending[key] = pending

    def take_pending(self, key: bytes) -> Pending | None:
        """Forget a pending request; the last one gone, the session's dict goes with it."""
        pending = self.pending.pop(key, None)
        if pending is not None and not self.pending:
            self.pending = _NO_PENDING
        return pending

    def idle(self) -> bool:
        """Nothing in flight and no stream open: ending it now loses the client nothing it waits for."""
        stream = self.stream
        return not (self.pending or not self.kind.lasting or self.ended or (stream is not None and not stream.closed))

    # the tunnel's sink -------------------------------------------------------------------------

    def deliver(self, frame: Frame) -> bool:
        """A page frame on this client's label (a reply to it, or something for every client)."""
        try:
            message = frame.message  # (parsed when the page posted it, unless it came over the bus)
        except ValueError:
            return True
        if isinstance(message, list):
            for item in message:
                if isinstance(item, dict):
                    self._route(item, None, None)
        elif isinstance(message, dict):
            self._route(message, frame.line, frame)
        return True

    def _route(self, item: dict[str, Any], raw: bytes | None, frame: Frame | None) -> None:
        """One message of a page frame (C{raw}, C{frame}: the frame's line and the frame, when the
        message is the whole frame)."""
        method = item.get("method")
        if not isinstance(method, str):
            # (A whole frame's key was written when the page posted it, or is written here once.)
            key = frame.id_key if frame is not None and "id" in item else dumps(item.get("id"))
            pending = self.take_pending(key)
            if pending is not None:
                self.forget_progress(pending)
                pending.answer(raw if raw is not None else dumps(item))
                if not self.kind.lasting:
                    self.close()
            return
        if method == "notifications/progress":
            params = item.get("params")
            split = standard.split_token(params.get("progressToken") if isinstance(params, dict) else None)
            if split is not None:
                tag, original = split
                if tag != label_tag(self.label):
                    return  # another client's progress
                restored = dumps(standard.restore_progress(item, original))
                pending = self.progress.get(dumps(original)) if self.progress else None
                if pending is not None and pending.send(restored):
                    return
                self.push(restored)
                return
        if not self.kind.lasting:
            # One exchange: only what the page stamped with this exchange's (forwarded) id rides on
            # its stream (a listen stream's acknowledgement and events), with the client's own id.
            stamped = standard.subscription_id(item)
            if stamped is not None:
                for pending in self.pending.values():
                    if pending.forwarded is not None and dumps(pending.forwarded) == dumps(stamped):
                        pending.send(dumps(standard.with_subscription_id(item, loads_json(pending.raw_id))))
            return
        self.push(raw if raw is not None else dumps(item))

    def end(self) -> None:
        """The tunnel session ended (or the relay is draining): answer what is pending, end streams."""
        self.record = None  # the tunnel has forgotten it already
        self._finish("the tunnel session ended")
        if self.origin and self.kind.lasting:
            tunnel = self.clients.tunnel
            tunnel.delete_client(self.id).addErrback(tunnel.log_failure, "ending an MCP client session failed")

    # client side -------------------------------------------------------------------------------

    def push(self, raw: bytes) -> None:
        """A message for the client outside any pending request: on its stream as it comes
        (C{answers_on_stream}), else through the resumable event buffer."""
        if self.kind.answers_on_stream:
            if self.stream is not None:
                self.stream.message(raw, None)
            return
        n = self.next_event
        self.next_event += 1
        config = self.clients.config
        events = self.events
        if events is None:
            events = self.events = deque()
        events.append((n, raw))
        self.events_bytes += len(raw)
        while len(events) > config.event_buffer_frames or self.events_bytes > config.event_buffer_bytes:
            self.events_bytes -= len(events.popleft()[1])
        if self.stream is not None and not self.stream.closed:
            self.stream.message(raw, self.clients.event_id(n))
            self.delivered = n

    def replay(self, after: int | None) -> None:
        """Write buffered events after C{after} (C{Last-Event-ID}), or those never delivered."""
        start = self.delivered if after is None else after
        stream = self.stream
        assert stream is not None
        for n, raw in self.events or ():
            if n > start:
                stream.message(raw, self.clients.event_id(n))
                self.delivered = max(self.delivered, n)

    def forget_progress(self, pending: Pending) -> None:
        if pending.progress is not None and self.progress:
            self.progress.pop(pending.progress, None)
            if not self.progress:
                self.progress = None  # (an emptied dict keeps its table: made again when needed)

    def cancel_at_page(self, pending: Pending, reason: str) -> None:
        """Tell the page to stop working on a forwarded request (C{notifications/cancelled})."""
        if pending.forwarded is None:
            return
        body = dumps(
            {
                "jsonrpc": "2.0",
                "method": "notifications/cancelled",
                "params": {"requestId": pending.forwarded, "reason": reason},
            }
        )
        self.clients.tunnel.inbox(self.session, self.token, body, self.label).addErrback(lambda _: None)

    def close(self, shared: bool = True) -> None:
        """The client ended (it said so, it was idle, its stream closed, its one exchange is done).

        C{shared=False}: only this instance's attachment ends (the client session goes on elsewhere).
        """
        record, self.record = self.record, None
        self._finish("the client session ended")
        tunnel = self.clients.tunnel
        if record is not None:
            announce = self.origin and self.kind.lasting
            tunnel.close_stream(record, announce=announce).addErrback(
                tunnel.log_failure, "closing an MCP client session failed"
            )
        if shared and self.origin and self.kind.lasting:
            tunnel.delete_client(self.id).addErrback(tunnel.log_failure, "ending an MCP client session failed")

    def _finish(self, message: str) -> None:
        if self.ended:
            return
        self.ended = True
        self.clients.forget(self)
        pending, self.pending = self.pending, _NO_PENDING
        self.progress = None
        for p in pending.values():
            p.answer(standard.error_for(p.raw_id, standard.SESSION_ENDED, message))
        stream, self.stream = self.stream, None
        if stream is not None:
            stream.close()


def _count_out(counts: dict[str, int], key: str) -> None:
    left = counts.get(key, 1) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


class Clients:
    """Every client session of the standard endpoint on this process: their counts and bounds, the
    idle ones' eviction, their event ids and the reaper that ends idle ones."""

    _log = Logger()

    def __init__(self, tunnel: TunnelRelay, clock: Timekeeper, config: EndpointConfig | None = None) -> None:
        self.tunnel = tunnel
        self.clock = clock
        self.config = config or EndpointConfig()
        self.clients: dict[str, Client] = {}
        self.per_session: dict[str, int] = {}
        # Client sessions per client address (--mcp-max-clients-per-address).
        self.per_address: dict[str, int] = {}
        self.pending_per_session: dict[str, int] = {}
        self._reaper: Any = None
        # Event ids are "<tag>-<n>": a Last-Event-ID from another instance's numbering is not ours.
        self.tag = secrets.token_hex(3).encode("ascii")
        self._last_reap = clock.seconds()
        tunnel.page_listeners.append(self.page_left)

    def event_id(self, n: int) -> bytes:
        return self.tag + b"-%d" % n

    def parse_event_id(self, value: str | None) -> int | None:
        """The number of one of this process's event ids, else C{None}."""
        if value is None:
            return None
        tag, _, n = value.partition("-")
        if tag.encode("ascii", "replace") != self.tag or not n.isdigit() or len(n) > 18:
            return None
        return int(n)

    def start(self) -> None:
        """Expire idle client sessions (checked a few times per idle period)."""
        if self._reaper is None:
            interval = max(1.0, self.config.client_idle_ms / 4000)
            self._reaper = self.clock.looping_call(interval, self.reap)

    def stop(self) -> None:
        if self._reaper is not None:
            self.clock.stop_loop(self._reaper)
            self._reaper = None

    def reap(self) -> None:
        """End client sessions idle past C{client_idle_ms} (an open GET stream or pending request is use)."""
        run(self._reap()).addErrback(self.tunnel.log_failure, "MCP client session reaping failed")

    async def _reap(self) -> None:
        now = self.clock.seconds()
        cutoff = now - self.config.client_idle_ms / 1000
        since, self._last_reap = self._last_reap, now
        tunnel = self.tunnel
        shared = tunnel.shared
        idle_ms = self.config.client_idle_ms
        active: list[Client] = []
        for client in list(self.clients.values()):
            if not client.kind.lasting or client.ended:
                continue
            streaming = client.stream is not None and not client.stream.closed
            if client.pending or streaming or client.last_used >= cutoff:
                if client.pending or streaming or client.last_used >= since:
                    active.append(client)
            elif not client.origin:
                client.close(shared=False)  # an idle attachment; the client session lives on elsewhere
            elif not shared or await tunnel.get_client(client.id) is None:
                client.close()  # idle here, and not kept alive by another instance either
        if active:
            # Used since the last pass: keep the shared record alive; one ended elsewhere (a DELETE
            # on another instance) ends here too.
            alive = await tunnel.touch_clients([c.id for c in active], idle_ms)
            for client, exists in zip(active, alive, strict=True):
                if not exists:
                    client.close(shared=False)

    def page_left(self, session: str) -> None:
        """A page reader of C{session} on this process went away: its pending requests answer
        L{standard.NO_PAGE} after the grace unless a page reads the session again by then."""
        if not self.pending_per_session.get(session):
            return  # (the scan below only for a session with requests in flight)
        for client in list(self.clients.values()):
            if client.session == session:
                for pending in list(client.pending.values()):
                    pending.page_left()

    def release(self, session: str) -> None:
        """One pending request of C{session} is settled."""
        left = self.pending_per_session.get(session, 1) - 1
        if left > 0:
            self.pending_per_session[session] = left
        else:
            self.pending_per_session.pop(session, None)

    def forget(self, client: Client) -> None:
        if self.clients.pop(client.id, None) is not None:
            _count_out(self.per_session, client.session)
            if client.address:
                _count_out(self.per_address, client.address)

    def add(self, session: str, token: str, address: str, kind: ClientKind, **attach: Any) -> Client | None:
        """A new client session of C{session}, of the transport's C{kind} (or this process's
        attachment to one, C{attach=}), for a client at C{address} (its L{bound_key}); C{None} when
        a bound refuses it."""
        config = self.config
        address = bound_key(address)
        if self.per_session.get(session, 0) >= config.clients_per_session or not self._room_for_a_client(address):
            return None
        if address:
            address = sys.intern(address)  # one string per address, however many client sessions
            self.per_address[address] = self.per_address.get(address, 0) + 1
        client = Client(self, session, token, kind, address=address, **attach)
        self.clients[client.id] = client
        self.per_session[session] = self.per_session.get(session, 0) + 1
        return client

    def _room_for_a_client(self, address: str) -> bool:
        """Under the per-address and the per-process bound: end the least recently used idle client
        sessions that stand in the way; C{False} when too few of them are idle."""
        config = self.config
        bounds: list[tuple[int, int, str | None]] = [(config.max_clients, len(self.clients), None)]
        if address and config.clients_per_address:
            bounds.insert(0, (config.clients_per_address, self.per_address.get(address, 0), address))
        for cap, count, of_address in bounds:
            excess = count - cap + 1
            if excess <= 0:
                continue
            # A scan of every client session, only while a bound is reached.
            idle = [c for c in self.clients.values() if c.idle() and (of_address is None or c.address == of_address)]
            if len(idle) < excess:
                return False
            idle.sort(key=lambda c: c.last_used)
            for client in idle[:excess]:
                client.close()
            _EVICTED_CLIENTS.inc(excess)
            self._log.info(
                "ended {count} idle MCP client session(s) to make room under {bound}",
                count=excess,
                bound=f"the per-address bound ({cap}) of {of_address}" if of_address else f"the client bound ({cap})",
            )
        return True

    def open_clients(self) -> int:
        """Client sessions held by this process (of every transport)."""
        return len(self.clients)


__all__ = ["Client", "ClientKind", "Clients", "EndpointConfig", "Listener", "Pending", "Reply"]
