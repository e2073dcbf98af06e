"""The MCP tunnel relay core: sessions, subscribers, fan-out, backlog, reply routing, long-poll, reaper.

No I/O happens here. The HTTP layer hands in request facts (ids, tokens, bodies or parsed frames)
and, for an in-process reader, a L{Sink} to hand frames to; the L{TunnelRelay} answers with results
or L{Refused} reasons (the wire strings of docs/mcp.md), and keeps its state in an L{IMcpStore}.

Semantics follow the Node relay 0.46.0 with relayd's decisions MCP-1 to MCP-10 (docs/decisions.md):
a 64-frame first-frame backlog, newline-safe SSE framing, collision-free reply routing, sessions kept
alive by open subscribers, bounded queues with C{notifications/frames_dropped}, a session cap.

What a frame is lives in L{relayd.mcp.core.frames}, session ids and tokens in
L{relayd.mcp.core.tokens}, a poll's park window and parked state in L{relayd.mcp.core.polls}, a
reader's sink in L{relayd.mcp.core.streams}. Over 600 lines, for a reason: each operation here is a
store round trip or a few whose refusals, fan-out and reply routing are read together to see that
no frame is lost or delivered twice.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from relayd.base.clock import Timekeeper
from relayd.base.coroutine import run
from relayd.base.errors import StoreUnavailable
from relayd.compat.prometheus import adder
from relayd.mcp import metrics
from relayd.mcp.core.bus import IMcpBus, InstanceGone, LocalBus
from relayd.mcp.core.frames import FRAMES_DROPPED, PEER_JOINED, PEER_LEFT, Frame, notification, parse_frame
from relayd.mcp.core.jsontext import dumps, loads_json
from relayd.mcp.core.polls import SUBSCRIBER_ID, ParkedPoll, PollResult
from relayd.mcp.core.store import (
    INBOUND,
    OUTBOUND,
    POLL,
    SSE,
    ClientRecord,
    Correlation,
    IMcpStore,
    InboxStart,
    OutboxStart,
    SessionRecord,
    SubscriberRecord,
)
from relayd.mcp.core.streams import Sink, StreamHandle
from relayd.mcp.core.tokens import SESSION_ID, TOKEN_MAX, TOKEN_MIN, token_hash, utf16_length

# Frames accepted, counted once per POST (bound once: nothing is looked up per frame; on the
# reactor's thread, so without prometheus_client's lock: relayd.compat.prometheus).
_INBOUND = adder(metrics.mcp_frames.labels(direction="inbound"))
_OUTBOUND = adder(metrics.mcp_frames.labels(direction="outbound"))
_EVICTED_SESSIONS = metrics.mcp_evictions.labels(kind="session")


def _labelled(subscribers: list[SubscriberRecord]) -> bool:
    """Whether any of C{subscribers} reads under a label (a loop: asked once per reply)."""
    for sub in subscribers:
        if sub.label is not None:
            return True
    return False


class Refused(Exception):
    """A request the relay refuses; C{reason} is the wire error string (C{session_gone}, ...)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Pass:
    """A request's token for its session (L{TunnelRelay.token_pass}): the token's hash and the
    store's L{IMcpStore.session_stamp}, read before L{TunnelRelay.check} is asked with it. Once the
    check has accepted it, the request's own store step (its frame's post) neither hashes the token
    again nor, while no session has changed since, compares it again: one token check per request.
    A pass whose check has not accepted it stands for nothing."""

    __slots__ = ("session", "digest", "stamp")

    def __init__(self, session: str, digest: str, stamp: object | None) -> None:
        self.session = session
        self.digest = digest
        self.stamp = stamp


def _credentials(checked: Pass | None, session_id: str, token: str) -> tuple[str, object | None]:
    """The token's hash and the stamp to post C{session_id}'s frame with (a pass stands only for
    its own session)."""
    if checked is not None and checked.session == session_id:
        return checked.digest, checked.stamp
    return token_hash(token), None


@dataclass(frozen=True)
class TunnelConfig:
    """Limits and timings (defaults: docs/mcp.md and docs/decisions.md MCP-1, MCP-9)."""

    ttl_ms: float = 14_400_000
    reap_interval_ms: float = 60_000
    poll_idle_ms: float = 60_000
    max_sessions: int = 10_000
    # Sessions one client address may have registered (0: no bound); --mcp-max-sessions-per-address.
    sessions_per_address: int = 1000
    queue_max_frames: int = 1000
    queue_max_bytes: int = 8 * 1024 * 1024
    backlog_frames: int = 64
    correlations_per_session: int = 1000
    # Bytes of frames held for readers that are not there yet or not polling (every queue and
    # first-frame backlog of the store together); a post that would need more is refused.
    max_buffered_bytes: int = 64 * 1024 * 1024
    # Readers (SSE streams and poll subscribers, both directions) one session may have at once: a
    # poll without `subscriber=` makes a new one, kept until it has been idle for a minute or two.
    max_subscribers: int = 1024


class TunnelRelay:
    """The MCP tunnel relay core: every tunnel session, its readers and its frames.

    Every public operation returns a Deferred; refusals errback with L{Refused}.
    """

    _log = Logger()

    def __init__(
        self, store: IMcpStore, clock: Timekeeper, config: TunnelConfig | None = None, bus: IMcpBus | None = None
    ) -> None:
        self.store = store
        self.clock = clock
        # The wall clock, in seconds (the clock's own, bound once: read four times per round trip).
        self._now: Callable[[], float] = clock.seconds
        self.config = config or TunnelConfig()
        self.bus: IMcpBus = bus or LocalBus()
        self.instance: str = self.bus.instance
        self._remote = bool(self.bus.remote)
        # The store's check answered in the call (the memory store's), for L{check_at_once}; None:
        # the store's answer is a Deferred (a shared store's round trip).
        self._check_now: Callable[[str, str, float], str | None] | None = getattr(store, "check_session_now", None)
        # Likewise its first step of a frame's post (to_page, from_page), awaited otherwise.
        self._start_inbox_now: Callable[..., InboxStart] | None = getattr(store, "start_inbox_now", None)
        self._start_outbox_now: Callable[..., OutboxStart] | None = getattr(store, "start_outbox_now", None)
        # What is bound to this process: open SSE streams and parked polls, by queue key.
        self._sinks: dict[str, Sink] = {}
        self._waiters: dict[str, set[ParkedPoll]] = {}
        self._fresh_ids = count(1)
        # What makes this process's rewritten ids its own (docs/decisions.md MCP-6).
        self._id_tag = self.instance or secrets.token_hex(6)
        self._orphans: list[SubscriberRecord] = []
        self._reaper: Any = None
        self.draining = False
        # Told the session id when one of this process's page readers (inbound) goes away: the
        # standard endpoint's pending requests look for a page then (Clients.page_left).
        self.page_listeners: list[Callable[[str], None]] = []
        self.bus.start(self)

    # lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the reaper (one shared looping call; C{reap_interval_ms=0} disables it)."""
        if self.config.reap_interval_ms > 0 and self._reaper is None:
            self._reaper = self.clock.looping_call(self.config.reap_interval_ms / 1000, self._reap_tick)

    def stop(self) -> None:
        """Stop the reaper."""
        if self._reaper is not None:
            self.clock.stop_loop(self._reaper)
            self._reaper = None

    def drain(self) -> None:
        """Shutdown: end every local SSE stream and answer every parked poll (sessions stay)."""
        self.draining = True
        self._release_local()

    @property
    def shared(self) -> bool:
        """Whether other processes share the store (Redis): a store step is then a round trip."""
        return self._remote

    def open_streams(self) -> int:
        """Local SSE streams still open."""
        return len(self._sinks)

    def parked_polls(self) -> int:
        """Local poll requests parked right now."""
        return sum(len(w) for w in self._waiters.values())

    # public operations -------------------------------------------------------------------------

    def register(self, session_id: str, token: str, owner: str = "") -> Deferred[None]:
        """Create a session, or refresh it when the token matches (idempotent); C{owner}: the client
        address registering it (C{""}: none to bound)."""
        return run(self._register(session_id, token, owner))

    def check(self, session_id: str, token: str, passed: Pass | None = None) -> Deferred[str | None]:
        """C{None} for a live session and good token (sliding the TTL), else the reason; C{passed}:
        the request's L{token_pass} (its hash is used), to hand to its post once accepted."""
        if not session_id or not token:
            return succeed("invalid_token")
        digest = token_hash(token) if passed is None else passed.digest
        # The store's own step (one round trip), without a coroutine around it: asked once per request.
        try:
            return self.store.check_session(session_id, digest, self._now())
        except Exception:
            return fail()

    def check_at_once(self, session_id: str, token: str, passed: Pass | None = None) -> str | Deferred[str | None] | None:
        """L{check}'s answer itself when the store answers at once (memory: asked once per request,
        no Deferred made and fired for it), else L{check}'s Deferred."""
        check_now = self._check_now
        if check_now is None or not session_id or not token:
            return self.check(session_id, token, passed)
        digest = token_hash(token) if passed is None else passed.digest
        try:
            return check_now(session_id, digest, self._now())
        except Exception:
            return fail()

    def token_pass(self, session_id: str, token: str) -> Pass:
        """The L{Pass} of a request's token, to ask L{check} with (the stamp is read before the check:
        a session changed after it shows as another stamp); once accepted, hand it to the request's
        L{forward_to_page} or L{outbox} (C{checked=}), which then do not check the token again."""
        return Pass(session_id, token_hash(token), self.store.session_stamp())

    def validate(self, session_id: str, token: str) -> Deferred[bool]:
        """Whether C{check} succeeds."""
        return self.check(session_id, token).addCallback(lambda reason: reason is None)

    def inbox(
        self, session_id: str, token: str, body: bytes, label: str | None = None, checked: Pass | None = None
    ) -> Deferred[None]:
        """An agent's frame for the page (fans out on C{inbound}); C{checked}: this request's
        L{Pass}, when L{check} has accepted its token already."""
        return self.forward(session_id, token, body, label, checked).addCallback(lambda _: None)

    def forward(
        self, session_id: str, token: str, body: bytes, label: str | None = None, checked: Pass | None = None
    ) -> Deferred[Frame]:
        """L{inbox}, firing with the frame as the page received it (its id rewritten on a collision)."""
        return self.forward_frame(session_id, token, parse_frame(body), label, checked)

    def forward_frame(
        self, session_id: str, token: str, frame: Frame | None, label: str | None = None, checked: Pass | None = None
    ) -> Deferred[Frame]:
        """L{forward} of a frame its caller has parsed already (C{None}: not a valid frame)."""
        return self.forward_to_page(session_id, token, frame, label, checked).addCallback(lambda sent: sent[0])

    def forward_to_page(
        self, session_id: str, token: str, frame: Frame | None, label: str | None = None, checked: Pass | None = None
    ) -> Deferred[tuple[Frame, bool]]:
        """L{forward_frame}, firing with the frame and whether a page was reading the session
        (C{False}: nobody reads C{inbound}, the frame waits in the first-frame backlog)."""
        return run(self.to_page(session_id, token, frame, label, checked))

    def hosted(self, session_id: str) -> Deferred[bool]:
        """Whether a page reads the session's C{inbound} direction (an SSE stream or a poller)."""
        return self.store.subscribers(session_id, INBOUND).addCallback(bool)

    def outbox(self, session_id: str, token: str, body: bytes, checked: Pass | None = None) -> Deferred[None]:
        """The page's frame for the agents (fans out on C{outbound}, replies scoped by label);
        C{checked} as in L{inbox}."""
        return run(self.from_page(session_id, token, body, checked))

    def open_stream(
        self,
        session_id: str,
        token: str,
        direction: str,
        label: str | None,
        sink: Sink,
        announce: bool = True,
        checked: bool = False,
    ) -> Deferred[StreamHandle]:
        """Subscribe an SSE stream (C{announce=False}: no presence, for one-exchange readers;
        C{checked}: the caller has had this request's token accepted by L{check} already)."""
        return run(self._open_stream(session_id, token, direction, label, sink, announce, checked))

    def close_stream(self, record: SubscriberRecord, announce: bool = True) -> Deferred[None]:
        """An SSE stream ended (client went away or overflowed): remove it, tell the page."""
        return run(self._close_stream(record, announce))

    def poll(
        self,
        session_id: str,
        token: str,
        direction: str,
        wait_ms: int,
        subscriber: str | None = None,
        label: str | None = None,
    ) -> Deferred[PollResult]:
        """One long-poll. Cancelling the Deferred (client went away) while parked takes nothing."""
        p = ParkedPoll(self, wait_ms / 1000)
        begin = run(self._poll_begin(p, session_id, token, direction, wait_ms, subscriber, label))
        begin.addCallbacks(p.begun, p.failed)
        return p.deferred

    def put_back(self, result: PollResult) -> Deferred[None]:
        """Frames taken by a poll whose client went away go back to the head of its queue."""
        return run(self._put_back(result))

    def unregister(self, session_id: str, token: str) -> Deferred[bool]:
        """End a session; fires C{True} when it was already gone."""
        return run(self._unregister(session_id, token))

    # the standard endpoint's client sessions, shared between instances -----------------------

    def get_client(self, client_id: str) -> Deferred[ClientRecord | None]:
        """The shared record of an endpoint client session, or C{None} (ended, expired, never made)."""
        return self.store.get_client(client_id)

    def put_client(self, client_id: str, record: ClientRecord, idle_ms: float) -> Deferred[None]:
        """Record a new endpoint client session for every instance (kept C{idle_ms} after its last use)."""
        return self.store.put_client(client_id, record, idle_ms)

    def delete_client(self, client_id: str) -> Deferred[bool]:
        """End an endpoint client session for every instance; C{True} if it existed."""
        return self.store.delete_client(client_id)

    def touch_clients(self, client_ids: list[str], idle_ms: float) -> Deferred[list[bool]]:
        """Keep endpoint client sessions alive; whether each still exists."""
        return self.store.touch_clients(client_ids, idle_ms)

    def drop_session(self, session_id: str) -> Deferred[None]:
        """End a session without auth (operator action and tests)."""
        return run(self._end_session(session_id))

    def reap(self) -> Deferred[None]:
        """One reaper pass: expire idle sessions, then prune idle pollers."""
        return run(self._reap())

    # what a parked poll calls back on (PollKeeper) ---------------------------------------------

    def unpark(self, poll: ParkedPoll) -> None:
        """Stop a poll's timer and forget it as a waiter on its queue."""
        if poll.timer is not None:
            self.clock.cancel(poll.timer)
            poll.timer = None
        record = poll.record
        if record is None:
            return
        waiters = self._waiters.get(record.queue_key)
        if waiters is not None:
            waiters.discard(poll)
            if not waiters:
                del self._waiters[record.queue_key]

    def poll_abandoned(self, poll: ParkedPoll) -> None:
        """A poll that takes nothing (its client went away): only its parked count goes."""
        record = poll.record
        if record is not None:
            self.store.update_subscriber(record.session, record.direction, record.id, self._now(), -1).addErrback(
                self.log_failure, "MCP poll bookkeeping failed"
            )

    def take_frames(self, poll: ParkedPoll) -> Deferred[PollResult]:
        """A poll's answer: its queued frames, taken (and its parked count dropped)."""
        return run(self._take_frames(poll))

    def return_frames(self, result: PollResult) -> None:
        """L{put_back}, logging a failure (the client that took the frames is gone)."""
        self.put_back(result).addErrback(self.log_failure, "MCP put-back failed")

    # what other processes tell this one (IMcpBus listener) -------------------------------------

    def bus_deliver(self, keys: list[str], event: bytes) -> None:
        sinks = self._sinks
        frame = Frame.from_sse(event)  # (one for every reader here: parsed, if at all, once)
        for key in keys:
            sink = sinks.get(key)
            if sink is not None:
                sink.deliver(frame)

    def bus_wake(self, keys: list[str]) -> None:
        for key in keys:
            self._wake(key)

    def bus_end(self, session_id: str) -> None:
        self._end_local(session_id)

    def bus_reset(self) -> None:
        # Clients reconnect (SSE) or poll again, and re-subscribe through the bus that is back.
        self._release_local()

    def _release_local(self) -> None:
        """End every local SSE stream and answer every parked poll."""
        for sink in list(self._sinks.values()):
            sink.end()
        self._sinks.clear()
        for key in list(self._waiters):
            self._wake(key)

    # internals ---------------------------------------------------------------------------------

    def log_failure(self, failure: Failure, what: str) -> None:
        """Log a failure nobody is waiting for (a store outage as one line, anything else with its traceback)."""
        if failure.check(StoreUnavailable):
            self._log.warn("{what}: {error}", what=what, error=failure.getErrorMessage())
        else:
            self._log.failure(what, failure)

    def _reap_tick(self) -> None:
        self.reap().addErrback(self.log_failure, "MCP reaper pass failed")

    async def _register(self, session_id: str, token: str, owner: str) -> None:
        if not SESSION_ID.fullmatch(session_id):
            raise Refused("invalid_session_id")
        if not TOKEN_MIN <= utf16_length(token) <= TOKEN_MAX:
            raise Refused("invalid_token")
        digest = token_hash(token)
        now = self._now()
        record = await self.store.get_session(session_id)
        if record is not None:
            if not hmac.compare_digest(record.token_hash, digest):
                raise Refused("session_taken")
            await self.store.touch_session(session_id, now)
            return
        if owner and self.config.sessions_per_address:
            await self._room_for_a_session(owner, self.config.sessions_per_address)
        await self._room_for_a_session(None, self.config.max_sessions)
        await self.store.put_session(SessionRecord(session_id, digest, now, owner))

    async def _room_for_a_session(self, owner: str | None, cap: int) -> None:
        """Under C{cap} sessions (C{owner}'s, or all): end the least recently seen sessions without
        readers that stand in the way, or refuse when too few of them can end."""
        excess, unread = await self.store.session_room(owner, cap)
        if excess > len(unread):
            raise Refused("too_many_sessions")
        for session_id in unread:
            await self._end_session(session_id)
        if unread:
            _EVICTED_SESSIONS.inc(len(unread))
            self._log.info(
                "ended {count} idle MCP session(s) without readers to make room under {bound}",
                count=len(unread),
                bound=f"the per-address bound ({cap}) of {owner}" if owner else f"the session bound ({cap})",
            )

    async def _check(self, session_id: str, token: str) -> str | None:
        if not session_id or not token:
            return "invalid_token"
        # One store round trip: look up, compare and slide the TTL together.
        return await self.store.check_session(session_id, token_hash(token), self._now())

    async def to_page(
        self, session_id: str, token: str, frame: Frame | None, label: str | None, checked: Pass | None
    ) -> tuple[Frame, bool]:
        """L{forward_to_page}'s coroutine, for a coroutine to await: no Deferred is made for it (the
        memory store answers at once)."""
        if not session_id or not token:
            raise Refused("invalid_token_or_frame")
        key: bytes | None = None
        bad_id = False
        if frame is not None and frame.is_request:
            try:
                key = frame.id_key
            except ValueError:
                bad_id = True  # an id too deep to write
        # One store round trip: authenticate and touch, correlate, read the readers.
        correlation = None if label is None or key is None else Correlation(label, None)
        digest, stamp = _credentials(checked, session_id, token)
        start_now = self._start_inbox_now
        cap = self.config.correlations_per_session
        if start_now is not None:
            start = start_now(session_id, digest, self._now(), INBOUND, key, correlation, cap, stamp)
        else:
            start = await self.store.start_inbox(session_id, digest, self._now(), INBOUND, key, correlation, cap, stamp)
        if start.reason == "session_gone":
            raise Refused(start.reason)
        if start.reason is not None or frame is None or bad_id:
            raise Refused("invalid_token_or_frame")
        subscribers = start.subscribers
        recorded = False
        if key is not None:
            if start.taken:
                try:
                    frame = await self._correlate(session_id, frame, label)
                except ValueError:
                    raise Refused("invalid_token_or_frame") from None  # a frame too deep to write
                subscribers = None  # read again: the correlation took a round trip of its own
            recorded = label is not None
        try:
            read = await self._fan_out(session_id, INBOUND, frame, subscribers=subscribers)
        except Refused:
            if recorded:
                # Not delivered: nothing will answer this request, so do not keep its reply route.
                await self.store.consume_correlation(session_id, frame.id_key)
            raise
        _INBOUND()  # (counted here, not by a callback on the post's Deferred)
        return frame, read

    async def _correlate(self, session_id: str, frame: Frame, label: str | None) -> Frame:
        """A request whose id another pending request holds (docs/decisions.md MCP-6): a fresh id,
        claimed for a labelled poster with the original to restore on the reply.

        Fresh ids carry this process's tag, so instances sharing a store never make the same one;
        the claim is one store step, so a client that posted that id itself meanwhile keeps it."""
        key = frame.id_key
        store = self.store
        correlation = None if label is None else Correlation(label, key)
        while True:
            fresh = f"relayd-{self._id_tag}-{next(self._fresh_ids)}"
            fresh_key = dumps(fresh)
            if correlation is None:
                free = not await store.correlation_pending(session_id, fresh_key)
            else:
                free = await store.claim_correlation(
                    session_id, fresh_key, correlation, self.config.correlations_per_session
                )
            if free:
                return frame.with_id(fresh)

    async def from_page(self, session_id: str, token: str, body: bytes, checked: Pass | None) -> None:
        """L{outbox}'s coroutine, for L{relayd.base.coroutine.run_now} (the memory store answers at
        once: no Deferred)."""
        if not session_id or not token:
            raise Refused("invalid_token_or_frame")
        frame = parse_frame(body)
        key: bytes | None = None
        bad_id = False
        if frame is not None and frame.is_response:
            try:
                key = frame.id_key
            except ValueError:
                bad_id = True  # an id too deep to write
        # One store round trip: authenticate and touch, consume the reply's correlation, read the readers.
        digest, stamp = _credentials(checked, session_id, token)
        start_now = self._start_outbox_now
        if start_now is not None:
            start = start_now(session_id, digest, self._now(), key, stamp)
        else:
            start = await self.store.start_outbox(session_id, digest, self._now(), key, stamp)
        if start.reason == "session_gone":
            raise Refused(start.reason)
        if start.reason is not None or frame is None or bad_id:
            raise Refused("invalid_token_or_frame")
        assert start.inbound is not None and start.outbound is not None
        if key is not None:
            correlation = start.correlation
            try:
                if await self._route_reply(session_id, frame, correlation, start.inbound, start.outbound):
                    _OUTBOUND()
                    return
            except Refused:
                if correlation is not None:
                    # Nothing was delivered: the page's retry must find its asker again.
                    await self.store.record_correlation(
                        session_id, key, correlation, self.config.correlations_per_session
                    )
                raise
        await self._fan_out(session_id, OUTBOUND, frame, subscribers=start.outbound)
        _OUTBOUND()

    async def _route_reply(
        self,
        session_id: str,
        frame: Frame,
        correlation: Correlation | None,
        inbound: list[SubscriberRecord],
        outbound: list[SubscriberRecord],
    ) -> bool:
        """Deliver a reply to its asker (docs/decisions.md MCP-6); C{False} when it goes to every reader instead."""
        if correlation is not None and correlation.original_id is not None:
            try:
                frame = frame.with_id(loads_json(correlation.original_id))
            except ValueError:
                raise Refused("invalid_token_or_frame") from None  # a reply too deep to rewrite
        labelled = _labelled(outbound) or _labelled(inbound)
        if labelled:
            # Scoped: only the asker's subscribers; an uncorrelated or replayed reply reaches nobody.
            if correlation is not None:
                await self._deliver([s for s in outbound if s.label == correlation.label], frame)
            return True
        if outbound:
            await self._deliver(outbound, frame)
            return True
        return False

    async def _fan_out(
        self,
        session_id: str,
        direction: str,
        frame: Frame,
        posted: bool = True,
        subscribers: list[SubscriberRecord] | None = None,
    ) -> bool:
        """Deliver to every subscriber of a direction (C{subscribers}: already read with the post);
        a posted frame nobody reads yet is backlogged. Whether anybody read the direction."""
        if subscribers is None:
            subscribers = await self.store.subscribers(session_id, direction)
        if subscribers:
            await self._deliver(subscribers, frame, posted)
            return True
        if posted:
            # docs/decisions.md MCP-1: hold it for the first subscriber instead of dropping it.
            await self._admit(len(frame.raw))
            await self.store.append_backlog(session_id, direction, frame.raw, self.config.backlog_frames)
        return False

    async def _admit(self, needed: int) -> None:
        """Refuse (before any of it is stored) a frame that would take the buffered total over the bound."""
        if needed and await self.store.buffered_bytes() + needed > self.config.max_buffered_bytes:
            raise Refused("buffer_full")

    async def _deliver(self, subscribers: list[SubscriberRecord], frame: Frame, posted: bool = True) -> None:
        """Hand a frame to subscribers: local streams, other instances' streams, poll queues.

        A posted frame is admitted against the buffered bound first (all or nothing); the relay's
        own presence notifications are not (small, and they must not fail a subscribe).
        """
        config = self.config
        if posted:
            pollers = 0
            for sub in subscribers:  # (a loop, not sum() over a generator: once per posted frame)
                if sub.kind != SSE:
                    pollers += 1
            if pollers:
                await self._admit(pollers * len(frame.json_string))
        sinks = self._sinks
        remote: dict[str, list[str]] | None = None
        woken: list[str] | None = None
        for sub in subscribers:
            key = sub.queue_key
            if sub.kind == SSE:
                if sub.instance == self.instance:
                    sink = sinks.get(key)
                    if sink is not None:
                        sink.deliver(frame)  # (its SSE encoding is made once, shared by every stream)
                else:
                    if remote is None:
                        remote = {}
                    remote.setdefault(sub.instance, []).append(key)
            else:
                await self.store.push(key, frame.json_string, config.queue_max_frames, config.queue_max_bytes)
                self._wake(key)
                if woken is None:
                    woken = []
                woken.append(key)
        if self._remote:
            if woken:
                await self.bus.wake(woken)
            if remote:
                gone = None
                for instance, keys in remote.items():
                    try:
                        await self.bus.deliver(instance, keys, frame.sse)
                    except InstanceGone as e:
                        gone = e
                        await self._forget_streams([s for s in subscribers if s.instance == instance])
                if gone is not None:
                    # Not acknowledged: the client retries, and the retry no longer counts on them.
                    raise gone

    async def _forget_streams(self, records: list[SubscriberRecord]) -> None:
        """Remove the records of streams whose instance no longer listens (it died or lost Redis)."""
        for record in records:
            removed = await self.store.remove_subscriber(record.session, record.direction, record.id)
            if removed is not None and record.direction == OUTBOUND:
                await self._announce(record.session, PEER_LEFT, record.id)

    async def _announce(self, session_id: str, method: str, subscriber_id: str) -> None:
        if self.draining:
            return
        params = b'{"subscriberId":"%s","ts":%d}' % (subscriber_id.encode(), int(self._now() * 1000))
        await self._fan_out(session_id, INBOUND, notification(method, params), posted=False)

    async def _open_stream(
        self,
        session_id: str,
        token: str,
        direction: str,
        label: str | None,
        sink: Sink,
        announce: bool = True,
        checked: bool = False,
    ) -> StreamHandle:
        if not checked:
            reason = await self._check(session_id, token)
            if reason is not None:
                raise Refused(reason)
        await self._room_for_a_reader(session_id)
        record = SubscriberRecord(secrets.token_hex(8), session_id, direction, SSE, label, self._now(), 0, self.instance)
        self._sinks[record.queue_key] = sink
        await self.store.add_subscriber(record)
        if direction == OUTBOUND and announce:
            await self._announce(session_id, PEER_JOINED, record.id)
        backlog = await self.store.take_backlog(session_id, direction)
        return StreamHandle(record, [Frame(raw) for raw in backlog])

    async def _close_stream(self, record: SubscriberRecord, announce: bool = True) -> None:
        self._sinks.pop(record.queue_key, None)
        try:
            removed = await self.store.remove_subscriber(record.session, record.direction, record.id)
        except StoreUnavailable:
            # The stream is gone but its record is not: remove it once the store answers again.
            self._orphans.append(record)
            raise
        if removed is not None and record.direction == OUTBOUND and announce:
            await self._announce(record.session, PEER_LEFT, record.id)
        if removed is not None and record.direction == INBOUND:
            self._page_left(record.session)

    def _page_left(self, session_id: str) -> None:
        if not self.draining:  # (draining answers every pending request anyway)
            for listener in self.page_listeners:
                listener(session_id)

    async def _poll_begin(
        self,
        p: ParkedPoll,
        session_id: str,
        token: str,
        direction: str,
        wait_ms: int,
        subscriber: str | None,
        label: str | None,
    ) -> bool:
        """Auth, subscriber, parked count; whether to answer at once (C{False}: park)."""
        reason = await self._check(session_id, token)
        if reason is not None:
            raise Refused(reason)
        record, p.created = await self._poll_subscriber(session_id, direction, subscriber, label)
        p.record = record
        await self.store.update_subscriber(session_id, direction, record.id, self._now(), 1)
        if wait_ms <= 0:
            return True
        # Listen before looking: a frame pushed by another process between the look and the park
        # would otherwise wake nobody.
        self._waiters.setdefault(record.queue_key, set()).add(p)
        return bool(await self.store.size(record.queue_key))

    async def _take_frames(self, p: ParkedPoll) -> PollResult:
        record = p.record
        assert record is not None
        store = self.store
        try:
            frames, dropped = await store.take(record.queue_key)
        finally:
            await store.update_subscriber(record.session, record.direction, record.id, self._now(), -1)
        if dropped:
            # docs/decisions.md MCP-9: the poller learns how many of its oldest frames the bound cost it.
            note = notification(FRAMES_DROPPED, b'{"count":%d}' % dropped)
            frames.insert(0, note.json_string)
        return PollResult(record.id, frames, p.created, record.direction, record.session)

    async def _room_for_a_reader(self, session_id: str) -> None:
        """Refuse a new reader beyond C{max_subscribers} for the session (both directions)."""
        inbound, outbound = await self.store.all_subscribers(session_id)
        if len(inbound) + len(outbound) >= self.config.max_subscribers:
            raise Refused("too_many_subscribers")

    async def _poll_subscriber(
        self, session_id: str, direction: str, wanted: str | None, label: str | None
    ) -> tuple[SubscriberRecord, bool]:
        store = self.store
        new_id = None
        if wanted is not None and SUBSCRIBER_ID.fullmatch(wanted):
            existing = await store.get_subscriber(session_id, direction, wanted)
            if existing is not None and existing.kind == POLL:
                return existing, False
            same_id = await store.find_subscriber(session_id, wanted)
            if not any(r.kind == SSE for r in same_id):
                new_id = wanted  # adopt (e.g. after an idle prune); never split an SSE queue (P13)
        await self._room_for_a_reader(session_id)
        record = SubscriberRecord(new_id or secrets.token_hex(8), session_id, direction, POLL, label, self._now())
        await store.add_subscriber(record)
        if direction == OUTBOUND:
            await self._announce(session_id, PEER_JOINED, record.id)
        backlog = await store.take_backlog(session_id, direction)
        if backlog:
            await store.put_back(record.queue_key, [Frame(raw).json_string for raw in backlog])
        return record, True

    def _wake(self, key: str) -> None:
        waiters = self._waiters.pop(key, None)
        if waiters:
            for p in list(waiters):
                p.wake()

    async def _put_back(self, result: PollResult) -> None:
        if not result.frames:
            return
        record = await self.store.get_subscriber(result.session, result.direction, result.subscriber)
        if record is not None:
            await self.store.put_back(record.queue_key, result.frames)
            self._wake(record.queue_key)
            if self._remote:
                await self.bus.wake([record.queue_key])

    async def _unregister(self, session_id: str, token: str) -> bool:
        if not token:
            raise Refused("invalid_token")
        record = await self.store.get_session(session_id)
        if record is None:
            return True
        if not hmac.compare_digest(record.token_hash, token_hash(token)):
            raise Refused("invalid_token")
        await self._end_session(session_id)
        return False

    async def _end_session(self, session_id: str) -> None:
        """Delete a session and end its subscribers everywhere (no C{peer_left}: the session is over)."""
        store = self.store
        await store.delete_session(session_id)
        # Parked polls answer with what is queued so far, so wake them before the queues go.
        for direction in (INBOUND, OUTBOUND):
            for sub in await store.subscribers(session_id, direction):
                if sub.kind == POLL:
                    self._wake(sub.queue_key)
        if self._remote:
            await self.bus.end_session(session_id)
        for sub in await store.drop_session_state(session_id):
            sink = self._sinks.pop(sub.queue_key, None)
            if sink is not None:
                sink.end()
        self._end_local(session_id)

    def _end_local(self, session_id: str) -> None:
        """End this process's streams and parked polls of a session (it ended, here or elsewhere)."""
        prefix = session_id + "/"
        for key in [k for k in self._waiters if k.startswith(prefix)]:
            self._wake(key)
        for key in [k for k in self._sinks if k.startswith(prefix)]:
            sink = self._sinks.pop(key, None)
            if sink is not None:
                sink.end()

    def _active_sessions(self) -> set[str]:
        keys = list(self._sinks) + [k for k, w in self._waiters.items() if w]
        return {k.split("/", 1)[0] for k in keys}

    async def _reap(self) -> None:
        now = self._now()
        store = self.store
        orphans, self._orphans = self._orphans, []
        for record in orphans:
            await self._close_stream(record)
        # docs/decisions.md MCP-7: an open SSE stream or a parked poll keeps its session alive.
        for session_id in self._active_sessions():
            await store.touch_session(session_id, now)
        for session_id in await store.expired_session_ids(now - self.config.ttl_ms / 1000):
            await self._end_session(session_id)
        for sub in await store.idle_pollers(now - self.config.poll_idle_ms / 1000):
            removed = await store.remove_subscriber(sub.session, sub.direction, sub.id)
            if removed is not None and sub.direction == OUTBOUND:
                await self._announce(sub.session, PEER_LEFT, sub.id)
            if removed is not None and sub.direction == INBOUND:
                self._page_left(sub.session)


