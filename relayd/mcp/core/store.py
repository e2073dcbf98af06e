"""The MCP relay's state behind interfaces: sessions, subscribers, frame queues, backlogs, correlations.

Every method returns a Deferred, so a networked implementation (Redis, a later issue) fits without
changing the tunnel relay; the in-memory one here returns already-fired Deferreds.

What lives here is the state another relay process would need to see: session records, who is
subscribed (with labels and poll bookkeeping), queued frames of pollers, the first-frame backlog and
reply correlations. What stays in the tunnel relay is what is bound to this process's connections:
the open SSE streams and the parked poll requests.

Frames in queues are stored already encoded as JSON string literals (the form a poll response carries),
so a frame is encoded once per broadcast, not once per poll; backlog frames are stored raw (a backlog
is handed to an SSE stream or a poller, which want different encodings).

About 600 lines, for a reason: the interface and its in-memory implementation are the specification
the Redis store (relayd/mcp/redis/store.py and its Lua) is tested against, so they stay one page.
"""

from __future__ import annotations

import hmac
from collections import OrderedDict, deque
from dataclasses import dataclass

from twisted.internet.defer import Deferred, succeed
from zope.interface import Interface, implementer

INBOUND = "inbound"
OUTBOUND = "outbound"
DIRECTIONS = (INBOUND, OUTBOUND)

SSE = "sse"
POLL = "poll"


@dataclass(slots=True)
class SessionRecord:
    """A registered session: its id, the SHA-256 hex of its token, when it was last touched (s), and
    the client address that registered it (C{""}: not known)."""

    id: str
    token_hash: str
    last_seen: float
    owner: str = ""


class SubscriberRecord:
    """One reader of one direction of a session, over SSE or long-poll.

    @ivar label: the C{client} label (C{None} when absent or empty).
    @ivar last_seen: when it last polled or was created (s).
    @ivar parked: how many poll requests are waiting on this subscriber right now.
    @ivar instance: the relayd process holding an SSE subscriber's connection (C{""}: this one,
        or any for a poller, whose queue lives in the store).
    @ivar queue_key: the key of its frame queue (and of its local sink or parked polls).
    """

    # Slots: an idle relay holds one of these per subscriber.
    __slots__ = ("id", "session", "direction", "kind", "label", "last_seen", "parked", "instance", "queue_key")

    def __init__(
        self,
        id: str,
        session: str,
        direction: str,
        kind: str,
        label: str | None,
        last_seen: float,
        parked: int = 0,
        instance: str = "",
    ) -> None:
        self.id = id
        self.session = session
        self.direction = direction
        self.kind = kind
        self.label = label
        self.last_seen = last_seen
        self.parked = parked
        self.instance = instance
        self.queue_key = queue_key(session, direction, id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SubscriberRecord):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in self.__slots__)

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__[:-1])
        return f"SubscriberRecord({fields})"


def queue_key(session: str, direction: str, subscriber: str) -> str:
    """The queue key of a subscriber (session ids and subscriber ids never contain C{/})."""
    return f"{session}/{direction}/{subscriber}"


@dataclass(frozen=True)
class Correlation:
    """Where the reply to a labelled request goes.

    @ivar label: the client label the reply is scoped to.
    @ivar original_id: the compact JSON of the request's own id when the relay rewrote it to avoid a
        collision (restored on the reply), else C{None}.
    """

    label: str | None
    original_id: bytes | None = None


class ISessionStore(Interface):
    """Session records."""

    def get_session(session_id: str) -> Deferred[SessionRecord | None]:
        """The session, or C{None} when it never existed or is gone."""

    def put_session(record: SessionRecord) -> Deferred[None]:
        """Create or replace a session."""

    def touch_session(session_id: str, now: float) -> Deferred[None]:
        """Slide the session's TTL: set C{last_seen} (no-op for an unknown session)."""

    def check_session(session_id: str, token_hash: str, now: float) -> Deferred[str | None]:
        """Authenticate and touch in one step: C{None} when the session exists and its token hash is
        C{token_hash} (C{last_seen} is then set to C{now}), else C{"session_gone"} or
        C{"invalid_token"} (nothing is touched)."""

    def delete_session(session_id: str) -> Deferred[bool]:
        """Delete a session; C{True} if it existed."""

    def session_stamp() -> object | None:
        """What changes whenever a session is created, replaced or deleted, read at once; C{None}
        when the store cannot tell (a shared store: another process changes sessions unseen).

        Read before a token is accepted and handed to that request's L{IPosts} step, it lets the
        step skip comparing the token again while nothing has changed (one check per request)."""

    def expired_session_ids(cutoff: float) -> Deferred[list[str]]:
        """Ids of sessions with C{last_seen < cutoff}."""

    def session_count() -> Deferred[int]:
        """How many sessions exist."""

    def session_room(owner: str | None, cap: int) -> Deferred[tuple[int, list[str]]]:
        """What one more session needs under C{cap} sessions (C{owner} given: registered from that
        client address): how many must end first (0: there is room), and the ids of up to that many
        sessions without readers, least recently seen first (fewer: not enough can end).

        An implementation may look only at a few of them: the least recently seen of all
        (C{owner=None}), the first registered from the address."""


class ISubscriberStore(Interface):
    """Subscriber records, per session and direction."""

    def add_subscriber(record: SubscriberRecord) -> Deferred[None]:
        """Add a subscriber (replacing one with the same session, direction and id)."""

    def get_subscriber(session_id: str, direction: str, subscriber_id: str) -> Deferred[SubscriberRecord | None]:
        """One subscriber, or C{None}."""

    def find_subscriber(session_id: str, subscriber_id: str) -> Deferred[list[SubscriberRecord]]:
        """Subscribers with this id in any direction of the session."""

    def subscribers(session_id: str, direction: str) -> Deferred[list[SubscriberRecord]]:
        """The subscribers of one direction, in arrival order."""

    def all_subscribers(session_id: str) -> Deferred[tuple[list[SubscriberRecord], list[SubscriberRecord]]]:
        """The inbound and the outbound subscribers, each in arrival order."""

    def update_subscriber(
        session_id: str, direction: str, subscriber_id: str, last_seen: float | None, parked_delta: int
    ) -> Deferred[None]:
        """Set C{last_seen} (unless C{None}) and add C{parked_delta} to C{parked}; no-op when gone."""

    def remove_subscriber(session_id: str, direction: str, subscriber_id: str) -> Deferred[SubscriberRecord | None]:
        """Remove a subscriber and its queue; the removed record, or C{None} if it was not there."""

    def idle_pollers(cutoff: float) -> Deferred[list[SubscriberRecord]]:
        """Poll subscribers with no parked request and C{last_seen < cutoff}."""

    def drop_session_state(session_id: str) -> Deferred[list[SubscriberRecord]]:
        """Remove every subscriber, queue, backlog and correlation of a session; the removed subscribers."""


class IFrameQueues(Interface):
    """Bounded per-subscriber FIFO queues of encoded frames."""

    def push(key: str, item: bytes, max_items: int, max_bytes: int) -> Deferred[int]:
        """Append C{item}; drop the oldest items beyond the bounds. Fires with how many were dropped."""

    def take(key: str) -> Deferred[tuple[list[bytes], int]]:
        """Remove and return everything queued, and how many items were dropped since the last take."""

    def put_back(key: str, items: list[bytes]) -> Deferred[None]:
        """Put C{items} back at the head of the queue, in order (a poll whose client went away)."""

    def size(key: str) -> Deferred[int]:
        """How many items are queued."""

    def buffered_bytes() -> Deferred[int]:
        """Bytes of frames held in every queue and first-frame backlog together (the tunnel relay keeps
        this under C{max_buffered_bytes} before it adds more)."""


class IBacklogs(Interface):
    """Frames posted while a direction had no subscriber (docs/decisions.md MCP-1)."""

    def append_backlog(session_id: str, direction: str, frame: bytes, cap: int) -> Deferred[None]:
        """Append a raw frame, dropping the oldest beyond C{cap}."""

    def take_backlog(session_id: str, direction: str) -> Deferred[list[bytes]]:
        """Atomically remove and return the whole backlog."""


class ICorrelations(Interface):
    """Which labelled client a pending request's reply belongs to."""

    def record_correlation(session_id: str, key: bytes, correlation: Correlation, cap: int) -> Deferred[None]:
        """Record a pending request under its id key, evicting the oldest beyond C{cap}."""

    def claim_correlation(session_id: str, key: bytes, correlation: Correlation, cap: int) -> Deferred[bool]:
        """L{record_correlation} only when no request with this id key is pending, in one step (two
        instances never both take one id); whether it was recorded."""

    def correlation_pending(session_id: str, key: bytes) -> Deferred[bool]:
        """Whether a request with this id key is pending."""

    def consume_correlation(session_id: str, key: bytes) -> Deferred[Correlation | None]:
        """Remove and return the correlation of an id key (a reply is routed once)."""


@dataclass(frozen=True, slots=True)  # one per client session in the in-memory store: no __dict__
class ClientRecord:
    """A standard-endpoint client session, as every instance finds it by its id.

    @ivar session: the tunnel session it is bound to.
    @ivar label: its client label (its requests' reply routing, on every instance).
    @ivar answers_on_stream: its answers ride its one stream, which lives on one instance (its
        transport's L{relayd.mcp.core.clients.ClientKind}).
    """

    session: str
    label: str
    answers_on_stream: bool = False


class IClientSessions(Interface):
    """Standard-endpoint client sessions, so that any instance can serve a client's requests."""

    def put_client(client_id: str, record: ClientRecord, idle_ms: float) -> Deferred[None]:
        """Record a client session that expires after C{idle_ms} without L{touch_clients}."""

    def get_client(client_id: str) -> Deferred[ClientRecord | None]:
        """The client session, or C{None} (never created, ended, or expired)."""

    def touch_clients(client_ids: list[str], idle_ms: float) -> Deferred[list[bool]]:
        """Slide each one's expiry; whether each still exists."""

    def delete_client(client_id: str) -> Deferred[bool]:
        """End a client session; C{True} if it existed."""


@dataclass(slots=True)
class InboxStart:
    """What a frame posted to C{inbox} needs from the store before it is delivered.

    @ivar reason: C{None} when the session and token are good, else the refusal (nothing else read).
    @ivar taken: the request's id was already pending.
    @ivar recorded: its correlation was recorded (labelled poster, id not taken).
    @ivar subscribers: the readers of the frame's direction.
    """

    reason: str | None
    taken: bool = False
    recorded: bool = False
    subscribers: list[SubscriberRecord] | None = None


@dataclass(slots=True)
class OutboxStart:
    """What a frame posted to C{outbox} needs: the refusal, or the reply's correlation (consumed)
    and both directions' readers."""

    reason: str | None
    correlation: Correlation | None = None
    inbound: list[SubscriberRecord] | None = None
    outbound: list[SubscriberRecord] | None = None


class IPosts(Interface):
    """A posted frame's store work in one call (one Redis round trip, docs/performance.md)."""

    def start_inbox(
        session_id: str,
        token_hash: str,
        now: float,
        direction: str,
        key: bytes | None,
        correlation: Correlation | None,
        cap: int,
        stamp: object | None = None,
    ) -> Deferred[InboxStart]:
        """L{ISessionStore.check_session} (only the session's existence and touch while C{stamp},
        the L{ISessionStore.session_stamp} read before this request's token was accepted, holds);
        when it passes and C{key} is given,
        L{ICorrelations.correlation_pending}, then, when not pending and C{correlation} is given,
        L{ICorrelations.record_correlation}; then the subscribers of C{direction}."""

    def start_outbox(
        session_id: str, token_hash: str, now: float, key: bytes | None, stamp: object | None = None
    ) -> Deferred[OutboxStart]:
        """L{ISessionStore.check_session} (C{stamp} as in L{start_inbox}); when it passes,
        L{ICorrelations.consume_correlation} of C{key} (if given) and L{ISubscriberStore.all_subscribers}."""


class IMcpStore(ISessionStore, ISubscriberStore, IFrameQueues, IBacklogs, ICorrelations, IClientSessions, IPosts):
    """Everything the MCP tunnel relay keeps outside its own process's connections."""


class _Queue:
    __slots__ = ("items", "bytes", "dropped")

    def __init__(self) -> None:
        self.items: deque[bytes] = deque()
        self.bytes = 0
        self.dropped = 0


@implementer(IMcpStore)
class MemoryStore:
    """The in-process implementation: dicts and deques, every Deferred already fired."""

    def __init__(self) -> None:
        self.sessions: dict[str, SessionRecord] = {}
        # client address -> the ids of the sessions it registered (what --mcp-max-sessions-per-address counts)
        self.owned: dict[str, set[str]] = {}
        # session -> direction -> subscriber id -> record (dicts keep arrival order)
        self.subs: dict[str, dict[str, dict[str, SubscriberRecord]]] = {}
        self.queues: dict[str, _Queue] = {}
        self.backlogs: dict[tuple[str, str], deque[bytes]] = {}
        self.correlations: dict[str, OrderedDict[bytes, Correlation]] = {}
        # One process: expiry is the endpoint's own idle reaping, which deletes them.
        self.clients: dict[str, ClientRecord] = {}
        self.max_queue_items_seen = 0
        # Bytes of frames in every queue and backlog: what this process holds for absent readers.
        self.buffered = 0
        # Counts every session created, replaced or deleted (session_stamp).
        self.session_changes = 0

    # client sessions

    def put_client(self, client_id: str, record: ClientRecord, idle_ms: float) -> Deferred[None]:
        self.clients[client_id] = record
        return succeed(None)

    def get_client(self, client_id: str) -> Deferred[ClientRecord | None]:
        return succeed(self.clients.get(client_id))

    def touch_clients(self, client_ids: list[str], idle_ms: float) -> Deferred[list[bool]]:
        return succeed([c in self.clients for c in client_ids])

    def delete_client(self, client_id: str) -> Deferred[bool]:
        return succeed(self.clients.pop(client_id, None) is not None)

    # sessions

    def get_session(self, session_id: str) -> Deferred[SessionRecord | None]:
        return succeed(self.sessions.get(session_id))

    def put_session(self, record: SessionRecord) -> Deferred[None]:
        self._disown(self.sessions.get(record.id))
        self.sessions[record.id] = record
        self.session_changes += 1
        if record.owner:
            self.owned.setdefault(record.owner, set()).add(record.id)
        return succeed(None)

    def _disown(self, record: SessionRecord | None) -> None:
        if record is not None and record.owner:
            owned = self.owned.get(record.owner)
            if owned is not None:
                owned.discard(record.id)
                if not owned:
                    del self.owned[record.owner]

    def touch_session(self, session_id: str, now: float) -> Deferred[None]:
        record = self.sessions.get(session_id)
        if record is not None:
            record.last_seen = now
        return succeed(None)

    def check_session(self, session_id: str, token_hash: str, now: float) -> Deferred[str | None]:
        return succeed(self._check(session_id, token_hash, now))

    def check_session_now(self, session_id: str, token_hash: str, now: float) -> str | None:
        """L{check_session}'s answer itself (this store answers at once): no Deferred per request."""
        return self._check(session_id, token_hash, now)

    def _check(self, session_id: str, token_hash: str, now: float, stamp: object | None = None) -> str | None:
        """Authenticate and touch; the token is not compared again while no session has changed
        since this request's token was accepted (C{stamp}: L{session_stamp} then)."""
        record = self.sessions.get(session_id)
        if record is None:
            return "session_gone"
        if (stamp is None or stamp != self.session_changes) and not hmac.compare_digest(record.token_hash, token_hash):
            return "invalid_token"
        record.last_seen = now
        return None

    def delete_session(self, session_id: str) -> Deferred[bool]:
        record = self.sessions.pop(session_id, None)
        self._disown(record)
        if record is not None:
            self.session_changes += 1
        return succeed(record is not None)

    def session_stamp(self) -> object | None:
        return self.session_changes

    def expired_session_ids(self, cutoff: float) -> Deferred[list[str]]:
        return succeed([s.id for s in self.sessions.values() if s.last_seen < cutoff])

    def session_count(self) -> Deferred[int]:
        return succeed(len(self.sessions))

    def session_room(self, owner: str | None, cap: int) -> Deferred[tuple[int, list[str]]]:
        ids = self.sessions.keys() if owner is None else self.owned.get(owner, set())
        excess = len(ids) - cap + 1
        if excess <= 0:
            return succeed((0, []))
        # A scan of every session, only while a bound is reached.
        unread = sorted((self.sessions[i] for i in ids if i not in self.subs), key=lambda r: r.last_seen)
        return succeed((excess, [r.id for r in unread[:excess]]))

    # subscribers

    def add_subscriber(self, record: SubscriberRecord) -> Deferred[None]:
        by_dir = self.subs.setdefault(record.session, {})
        by_dir.setdefault(record.direction, {})[record.id] = record
        return succeed(None)

    def _get(self, session_id: str, direction: str, subscriber_id: str) -> SubscriberRecord | None:
        return self.subs.get(session_id, {}).get(direction, {}).get(subscriber_id)

    def get_subscriber(self, session_id: str, direction: str, subscriber_id: str) -> Deferred[SubscriberRecord | None]:
        return succeed(self._get(session_id, direction, subscriber_id))

    def find_subscriber(self, session_id: str, subscriber_id: str) -> Deferred[list[SubscriberRecord]]:
        by_dir = self.subs.get(session_id, {})
        return succeed([d[subscriber_id] for d in by_dir.values() if subscriber_id in d])

    def subscribers(self, session_id: str, direction: str) -> Deferred[list[SubscriberRecord]]:
        return succeed(list(self.subs.get(session_id, {}).get(direction, {}).values()))

    def all_subscribers(self, session_id: str) -> Deferred[tuple[list[SubscriberRecord], list[SubscriberRecord]]]:
        by_dir = self.subs.get(session_id)
        if by_dir is None:
            return succeed(([], []))
        return succeed((list(by_dir.get(INBOUND, {}).values()), list(by_dir.get(OUTBOUND, {}).values())))

    def update_subscriber(
        self, session_id: str, direction: str, subscriber_id: str, last_seen: float | None, parked_delta: int
    ) -> Deferred[None]:
        record = self._get(session_id, direction, subscriber_id)
        if record is not None:
            if last_seen is not None:
                record.last_seen = last_seen
            record.parked += parked_delta
        return succeed(None)

    def remove_subscriber(self, session_id: str, direction: str, subscriber_id: str) -> Deferred[SubscriberRecord | None]:
        by_dir = self.subs.get(session_id)
        record = None
        if by_dir is not None:
            record = by_dir.get(direction, {}).pop(subscriber_id, None)
            if not any(by_dir.values()):
                del self.subs[session_id]
        q = self.queues.pop(queue_key(session_id, direction, subscriber_id), None)
        if q is not None:
            self.buffered -= q.bytes
        return succeed(record)

    def idle_pollers(self, cutoff: float) -> Deferred[list[SubscriberRecord]]:
        return succeed(
            [
                r
                for by_dir in self.subs.values()
                for d in by_dir.values()
                for r in d.values()
                if r.kind == POLL and r.parked == 0 and r.last_seen < cutoff
            ]
        )

    def drop_session_state(self, session_id: str) -> Deferred[list[SubscriberRecord]]:
        by_dir = self.subs.pop(session_id, {})
        removed = [r for d in by_dir.values() for r in d.values()]
        for r in removed:
            q = self.queues.pop(r.queue_key, None)
            if q is not None:
                self.buffered -= q.bytes
        for direction in DIRECTIONS:
            backlog = self.backlogs.pop((session_id, direction), None)
            if backlog:
                self.buffered -= sum(len(f) for f in backlog)
        self.correlations.pop(session_id, None)
        return succeed(removed)

    # queues

    def push(self, key: str, item: bytes, max_items: int, max_bytes: int) -> Deferred[int]:
        q = self.queues.get(key)
        if q is None:
            q = self.queues[key] = _Queue()
        q.items.append(item)
        q.bytes += len(item)
        self.buffered += len(item)
        dropped = 0
        # Always keep the newest item, even if it alone exceeds the byte bound (frames are capped anyway).
        while len(q.items) > 1 and (len(q.items) > max_items or q.bytes > max_bytes):
            size = len(q.items.popleft())
            q.bytes -= size
            self.buffered -= size
            dropped += 1
        q.dropped += dropped
        if len(q.items) > self.max_queue_items_seen:
            self.max_queue_items_seen = len(q.items)
        return succeed(dropped)

    def take(self, key: str) -> Deferred[tuple[list[bytes], int]]:
        q = self.queues.get(key)
        if q is None:
            return succeed(([], 0))
        items, dropped = list(q.items), q.dropped
        q.items.clear()
        self.buffered -= q.bytes
        q.bytes = 0
        q.dropped = 0
        return succeed((items, dropped))

    def put_back(self, key: str, items: list[bytes]) -> Deferred[None]:
        if items:
            q = self.queues.get(key)
            if q is None:
                q = self.queues[key] = _Queue()
            q.items.extendleft(reversed(items))
            size = sum(len(i) for i in items)
            q.bytes += size
            self.buffered += size
        return succeed(None)

    def size(self, key: str) -> Deferred[int]:
        q = self.queues.get(key)
        return succeed(0 if q is None else len(q.items))

    def buffered_bytes(self) -> Deferred[int]:
        return succeed(self.buffered)

    # backlogs

    def append_backlog(self, session_id: str, direction: str, frame: bytes, cap: int) -> Deferred[None]:
        backlog = self.backlogs.get((session_id, direction))
        if backlog is None:
            backlog = self.backlogs[(session_id, direction)] = deque(maxlen=cap)
        if backlog.maxlen and len(backlog) == backlog.maxlen:
            self.buffered -= len(backlog[0])  # the deque drops its oldest
        backlog.append(frame)
        self.buffered += len(frame)
        return succeed(None)

    def take_backlog(self, session_id: str, direction: str) -> Deferred[list[bytes]]:
        backlog = self.backlogs.pop((session_id, direction), None)
        if not backlog:
            return succeed([])
        self.buffered -= sum(len(f) for f in backlog)
        return succeed(list(backlog))

    # correlations

    def record_correlation(self, session_id: str, key: bytes, correlation: Correlation, cap: int) -> Deferred[None]:
        self._record_correlation(session_id, key, correlation, cap)
        return succeed(None)

    def _record_correlation(self, session_id: str, key: bytes, correlation: Correlation, cap: int) -> None:
        pending = self.correlations.get(session_id)
        if pending is None:
            pending = self.correlations[session_id] = OrderedDict()
        pending.pop(key, None)
        pending[key] = correlation
        while len(pending) > cap:
            pending.popitem(last=False)

    def claim_correlation(self, session_id: str, key: bytes, correlation: Correlation, cap: int) -> Deferred[bool]:
        if key in self.correlations.get(session_id, ()):
            return succeed(False)
        self._record_correlation(session_id, key, correlation, cap)
        return succeed(True)

    def correlation_pending(self, session_id: str, key: bytes) -> Deferred[bool]:
        return succeed(key in self.correlations.get(session_id, ()))

    def consume_correlation(self, session_id: str, key: bytes) -> Deferred[Correlation | None]:
        pending = self.correlations.get(session_id)
        return succeed(None if pending is None else pending.pop(key, None))

    # posts

    def start_inbox(
        self,
        session_id: str,
        token_hash: str,
        now: float,
        direction: str,
        key: bytes | None,
        correlation: Correlation | None,
        cap: int,
        stamp: object | None = None,
    ) -> Deferred[InboxStart]:
        return succeed(self.start_inbox_now(session_id, token_hash, now, direction, key, correlation, cap, stamp))

    def start_inbox_now(
        self,
        session_id: str,
        token_hash: str,
        now: float,
        direction: str,
        key: bytes | None,
        correlation: Correlation | None,
        cap: int,
        stamp: object | None = None,
    ) -> InboxStart:
        """L{start_inbox}'s answer itself (this store answers at once): no Deferred per frame."""
        reason = self._check(session_id, token_hash, now, stamp)
        if reason is not None:
            return InboxStart(reason)
        taken = recorded = False
        if key is not None:
            taken = key in self.correlations.get(session_id, ())
            if not taken and correlation is not None:
                self._record_correlation(session_id, key, correlation, cap)
                recorded = True
        subscribers = list(self.subs.get(session_id, {}).get(direction, {}).values())
        return InboxStart(None, taken, recorded, subscribers)

    def start_outbox(
        self, session_id: str, token_hash: str, now: float, key: bytes | None, stamp: object | None = None
    ) -> Deferred[OutboxStart]:
        return succeed(self.start_outbox_now(session_id, token_hash, now, key, stamp))

    def start_outbox_now(
        self, session_id: str, token_hash: str, now: float, key: bytes | None, stamp: object | None = None
    ) -> OutboxStart:
        """L{start_outbox}'s answer itself (this store answers at once): no Deferred per frame."""
        reason = self._check(session_id, token_hash, now, stamp)
        if reason is not None:
            return OutboxStart(reason)
        correlation = None
        if key is not None:
            pending = self.correlations.get(session_id)
            correlation = None if pending is None else pending.pop(key, None)
        by_dir = self.subs.get(session_id, {})
        inbound = list(by_dir.get(INBOUND, {}).values())
        outbound = list(by_dir.get(OUTBOUND, {}).values())
        return OutboxStart(None, correlation, inbound, outbound)
