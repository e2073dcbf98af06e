"""The AEP relay core: ingest, buffer admission, fan-out, subscriptions, claims, command routing.

No I/O here: transports hand in parsed L{Event}s and L{Subscriber}s and receive deliveries and error
frames through the small interfaces below.

Over 600 lines, for a reason: ingest, admission into the buffer, fan-out and command routing share
one ordering (an event is stored, then fanned out in store order, and a command reaches the one
emitter that owns its session); read together they show no event is delivered before it is
stored, twice or out of order. What could stand alone already does (filters, index, capture,
claims, backlog, the store).
"""

from __future__ import annotations

from collections import deque
from itertools import chain
from time import perf_counter
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence, cast

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from relayd.aep import metrics
from relayd.aep.core.backlog import held_size
from relayd.aep.core.capture import capture_target
from relayd.aep.core.claims import Claimant, IClaims, MemoryClaims
from relayd.aep.core.envelope import EventKind
from relayd.aep.core.event import Event
from relayd.aep.core.filters import Pin, match_all
from relayd.aep.core.index import Group, Snapshot, SubscriptionIndex
from relayd.aep.core.store import IEventLog, Position, Replay
from relayd.base.clock import BlockingClock
from relayd.compat.prometheus import adder, recorder

# Bound once: the ingest path counts per batch, never per delivery.
_INGESTED = adder(metrics.events_ingested.labels(relay="aep"))
_DELIVERED = metrics.events_delivered.labels(relay="aep")
_UNROUTABLE = metrics.events_dropped.labels(relay="aep", reason="unroutable")
_FANOUT = recorder(metrics.fanout_seconds.labels(relay="aep"))  # (observe without its checks and locks)
_STORE_ERRORS = metrics.store_errors

DISCOVERY_ENDPOINTS = {"events": "/events", "stream": "/stream", "socket": "/socket"}
CAPTURE_LEVELS = ["none", "metadata", "redacted", "full"]


class Subscriber:
    """A delivery target: one SSE stream or one WebSocket subscription.

    While it replays history its live deliveries are held, then released in arrival order, so a
    resuming consumer never misses an event that arrives mid-replay (whatever the store's latency).
    Transports bound what is held (L{held}) by the consumer's backlog bound; C{held_bytes} is
    what it holds, counted with L{held_size}. C{pin} (L{pin_of} of its filter) is where the
    subscription index keeps it; C{None} puts it on the list every event is tested against.
    """

    __slots__ = ("match", "ceiling", "pin", "_held", "held_bytes", "heard")

    def __init__(
        self, match: Callable[[dict[str, Any]], bool], ceiling: str | None, pin: Pin | None = None
    ) -> None:
        self.match = match
        self.ceiling = ceiling
        self.pin = pin
        self._held: deque[Event] | None = None
        self.held_bytes = 0
        # Fires once the other instances' events it needs are heard (L{Fanout.need}); None: they are.
        self.heard: Deferred[None] | None = None

    def level(self, event: Event) -> str | None:
        """The capture level to send C{event} at (C{None}: as stored)."""
        return capture_target(event.capture, self.ceiling) if self.ceiling is not None else None

    def wants(self, event: Event) -> bool:
        """Whether C{event} passes this subscriber's filter (the empty filter never parses it)."""
        match = self.match
        return match is match_all or match(event.ev)

    def hold(self) -> None:
        """Hold live deliveries from now on (a replay is being read and sent)."""
        self._held = deque()

    @property
    def holding(self) -> bool:
        return self._held is not None

    def release(self) -> None:
        """Send everything held, then deliver live again."""
        held, self._held = self._held, None
        self.held_bytes = 0
        for event in held or ():
            self.send(event)

    def deliver(self, event: Event) -> None:
        if self._held is not None:
            self.held(event)
        else:
            self.send(event)

    def deliver_run(self, events: Sequence[Event], memo: dict[Any, Any]) -> None:
        """Deliver C{events} in order: consecutive events of one batch, every one wanted here.

        C{memo} is shared by every subscriber the run goes to, so that a transport makes once what
        all of them send (the run's SSE frames, joined and chunked); here each is delivered alone.
        """
        for event in events:
            self.deliver(event)

    def held(self, event: Event) -> None:
        """Keep C{event} until the replay is sent (transports override this to bound it)."""
        self.keep_held(event, held_size(event, self.level(event)))

    def keep_held(self, event: Event, size: int) -> None:
        self.held_bytes += size
        self._held.append(event)  # type: ignore[union-attr]

    def pop_held(self) -> Event | None:
        """The oldest event held, or C{None}."""
        held = self._held
        if not held:
            return None
        event = held.popleft()
        self.held_bytes -= held_size(event, self.level(event))
        return event

    def forget_held(self, session: str, replayed: Sequence[Event]) -> None:
        """Drop the held live events of C{session} that C{replayed} (a page of its replay, read
        after they arrived) holds too, by C{(source, id)}: the replay sends them once, in position
        order. (One pass over what is held per page read; what is held is bounded.)"""
        held = self._held
        if not held or not replayed:
            return
        keys = {event.key for event in held if event.session == session}
        if not keys:
            return
        keys.intersection_update(event.key for event in replayed)
        if not keys:
            return
        kept: deque[Event] = deque()
        for event in held:
            if event.session == session and event.key in keys:
                self.held_bytes -= held_size(event, self.level(event))
            else:
                kept.append(event)
        held.clear()
        held.extend(kept)

    def send(self, event: Event) -> None:
        raise NotImplementedError


# One item of a replay: an event to send, or a C{(session, earliest held position)} gap marker.
ReplayItem = Event | tuple[str, Position]

REPLAY_PAGE = 512  # events one replay reads at a time from a store that copies them (Redis)


class ReplayReader:
    """The history one subscriber asked for, read from the store a page at a time as it is sent.

    Each session is read once, in the order first named, from the earliest position it was named
    with (L{unique_sessions}); a page is read only when the transport has sent the previous one,
    so a replay holds one page in memory (with the in-memory log: a reference per event of one
    session), whatever the history's size and however slowly its client reads. Each page yields
    its C{replay-exhausted} marker (not for C{from=all}), then the events the filter takes.
    """

    def __init__(
        self, log: IEventLog, sub: Subscriber, entries: Sequence[tuple[str, Position]], from_all: bool
    ) -> None:
        self._log = log
        self._sub = sub
        self._entries = iter(unique_sessions(entries))
        self._from_all = from_all
        self._session = ""
        self._after: Position = (0, -1)
        self._cursor: Any = None
        self._items: Iterator[ReplayItem] = iter(())
        self.named = bool(entries)
        self.exhausted = False

    def take(self) -> ReplayItem | None:
        """The next item of the page read last; C{None} once it is all taken (then L{load})."""
        return next(self._items, None)

    def load(self) -> bool | Deferred[bool]:
        """Read the next page: C{True} when one was read (it may hold nothing the filter takes),
        C{False} at the end of the replay; a C{Deferred} of that while the store answers (the
        in-memory log answers at once; an unreachable store fails it)."""
        heard = self._sub.heard
        if heard is not None:
            # The first page is read once the other instances' live events are heard: one stored
            # after the read is then delivered live (held meanwhile), none falls between the two.
            self._sub.heard = None
            return heard.addCallback(lambda _: self.load())
        if self._cursor is None:
            entry = next(self._entries, None)
            if entry is None:
                return False
            self._session, self._after = entry
        session, log = self._session, self._log
        if log.paged:
            replay = log.replay(session, self._after, REPLAY_PAGE, self._cursor)
        else:
            replay = log.replay(session, self._after)  # references to events it holds anyway: all at once
        d = replay.addCallback(self._read, session)
        answered: list[Any] = []

        def answer(result: Any) -> Any:
            answered.append(result)
            return result

        d.addBoth(answer)
        if not answered:
            return d
        d.addErrback(lambda failure: None)  # raised here instead
        if isinstance(answered[0], Failure):
            answered[0].raiseException()
        return True

    def _read(self, replay: Replay, session: str) -> bool:
        sub = self._sub
        self._cursor = replay.cursor
        sub.forget_held(session, replay.events)
        wanted: Iterator[Event] = filter(sub.wants, replay.events)  # lazily: a page may be the whole history
        items: Iterator[ReplayItem] = wanted
        if replay.exhausted is not None and not self._from_all:
            self.exhausted = True
            items = chain([(session, replay.exhausted)], items)
        self._items = items
        return True

    def count(self) -> None:
        """The C{replays} metric, once the replay is all sent."""
        if self.named:
            metrics.replays.labels(relay="aep", outcome="exhausted" if self.exhausted else "complete").inc()


# Bytes of replay one consumer is handed per reactor turn, and only while it keeps up.
REPLAY_CHUNK = 64 * 1024
_REPLAYED = metrics.replayed_events.labels(relay="aep")


class ReplayProducer:
    """One subscriber's replay, sent a chunk at a time as its client reads: the history from its
    L{ReplayReader}, then the live events held meanwhile; then the subscriber takes live events.

    Called once per turn by its transport while the client keeps up; answers C{True} while there
    is more, a C{Deferred} while the store reads the next page, C{False} once it is all sent (or
    the client is gone). Transports say how to send a marker and an event, and when to stop.
    """

    __slots__ = ("sub", "reader", "history_sent")

    def __init__(self, sub: Subscriber, reader: ReplayReader) -> None:
        self.sub = sub
        self.reader = reader
        self.history_sent = False

    def __call__(self) -> bool | Deferred[Any]:
        sub, reader = self.sub, self.reader
        budget = REPLAY_CHUNK
        if not self.history_sent:
            sent = 0
            try:
                while True:
                    item = reader.take()
                    if item is None:
                        loaded = reader.load()
                        if loaded is False:
                            break
                        if loaded is not True:
                            return loaded.addErrback(self.failed)  # the store answers later
                        continue
                    if type(item) is tuple:
                        session, (epoch, seq) = item
                        budget -= self.send_marker(session, epoch, seq)
                    else:
                        budget -= self.send_event(item)  # type: ignore[arg-type]
                        sent += 1
                    if budget <= 0 or self.stalled():
                        return self.alive()
            except Exception:
                self.failed(Failure())
                return False
            finally:
                if sent:
                    _REPLAYED.inc(sent)
            self.history_sent = True
            reader.count()
        while budget > 0 and not self.stalled():
            event = sub.pop_held()
            if event is None:
                break
            budget -= self.send_event(event)
        else:
            return self.alive()
        sub.release()  # nothing is held: live events go straight to the client from now on
        self.finished()
        return False

    def send_marker(self, session: str, epoch: int, seq: int) -> int:
        """Send a C{replay-exhausted} marker; the bytes it costs."""
        raise NotImplementedError

    def send_event(self, event: Event) -> int:
        """Send an event at the subscriber's capture level; the bytes it costs."""
        raise NotImplementedError

    def stalled(self) -> bool:
        """Whether to stop for this turn before the chunk is used up (the client lags or left)."""
        return False

    def alive(self) -> bool:
        """Whether there is still a client to send the rest to."""
        return True

    def finished(self) -> None:
        """Everything was sent."""

    def failed(self, failure: Failure) -> None:
        """The store failed after the replay began."""
        raise NotImplementedError


def unique_sessions(entries: Sequence[tuple[str, Position]]) -> list[tuple[str, Position]]:
    """Resume entries with each session once, from the earliest position it was named with.

    A session named again adds nothing but a second copy of its history, which only costs the
    relay (a 3 KB query could ask for the same 10 000 events hundreds of times).
    """
    earliest: dict[str, Position] = {}
    for session, position in entries:
        known = earliest.get(session)
        if known is None or position < known:
            earliest[session] = position
    return list(earliest.items())


class Emitter:
    """What command routing needs from a WebSocket connection (read-only: what its hello said and
    the sessions it claims, which the claims registry appends to)."""

    @property
    def role(self) -> str:
        return "both"

    @property
    def hello_done(self) -> bool:
        return False

    @property
    def identity(self) -> Mapping[str, Any]:
        return MappingProxyType({})

    @property
    def capabilities(self) -> Mapping[str, Any]:
        return MappingProxyType({})

    @property
    def claims(self) -> list[str]:
        raise NotImplementedError

    def send_frame(self, frame: dict[str, Any]) -> None:
        raise NotImplementedError

    def send_command(self, event: Event) -> None:
        raise NotImplementedError


def error_frame(code: str, detail: str | None = None, **extra: Any) -> dict[str, Any]:
    """An in-band error frame; connection-scoped, never history."""
    frame: dict[str, Any] = {"type": "error"}
    frame.update(extra)
    frame["code"] = code
    if detail is not None:
        frame["detail"] = detail
    return frame


class Fanout(Protocol):
    """Live fan-out to the other instances of a relay (relayd/aep/redis/fanout.py's C{RedisFanout}).

    The relay says which sessions its subscriptions need (L{need}, L{release}: one release per need),
    so that a fan-out split by session (a Redis Cluster's shard channels) listens only to those.
    """

    def publish(self, events: Sequence[Event]) -> Deferred[Any]:
        """Hand C{events} (already delivered here) to the other instances."""

    def need(self, sessions: tuple[str, ...] | None) -> Deferred[None] | None:
        """A local subscription needs the other instances' events of C{sessions} (C{None}: of every
        session, a subscription that pins none). C{None} when they are heard already, else a
        C{Deferred} that fires once they are (its replay waits for it: L{ReplayReader.load})."""

    def release(self, sessions: tuple[str, ...] | None) -> None:
        """A subscription that needed C{sessions} is gone."""


def sessions_needed(pin: Pin | None) -> tuple[str, ...] | None:
    """The sessions a subscription can match events of (C{None}: any): those its filter pins."""
    return pin.values if pin is not None and pin.attr == "session" else None


# Makes the fan-out, given the relay's delivery of the other instances' events (EventRelay.fan_out_remote).
FanoutFactory = Callable[[Callable[[Sequence[Event]], None]], Fanout]


class EventRelay:
    """The AEP core: who subscribes to what, replay, command routing to the claimant, fan-out."""

    _log = Logger()

    def __init__(
        self,
        log: IEventLog,
        *,
        token: str | None,
        buffer: int,
        max_from: int,
        seconds: Callable[[], float] | None = None,
        claims: IClaims | None = None,
        fanout: FanoutFactory | None = None,
        max_subscribers: int = 10_000,
    ) -> None:
        self.log = log
        self.claims: IClaims = claims if claims is not None else MemoryClaims()
        # Live fan-out to other instances (Redis); None when this process is the whole relay. It is
        # made here, handed what delivers the other instances' events to this relay's subscribers.
        self.fanout: Fanout | None = fanout(self.fan_out_remote) if fanout is not None else None
        self.token = token
        self.buffer = buffer
        self.max_from = max_from
        # What subscribers cost in memory (fan-out costs what can match: L{SubscriptionIndex}).
        self.max_subscribers = max_subscribers
        # For the uptime: the wing's clock.monotonic (a relay built alone, in a test, the system's).
        self._seconds = seconds if seconds is not None else BlockingClock().monotonic
        self._started = self._seconds()
        self.subscribers: dict[object, Subscriber] = {}
        self.index = SubscriptionIndex()
        self.connections: dict[object, Emitter] = {}
        self.discovery = {
            "aep": ["0.1"],
            "role": "collector",
            "endpoints": dict(DISCOVERY_ENDPOINTS),
            "capabilities": {
                "filters": ["attr-match"],
                "replay": {"buffer": buffer, "all": True},
                "capture": list(CAPTURE_LEVELS),
                "control": {"accepts": []},
                "roster": {},
                "experimental": {},
            },
        }

    # Ingest ------------------------------------------------------------------------------------

    def ingest(self, events: Sequence[Event], sender: Emitter | None = None) -> Deferred[None]:
        """Buffer the sequenced events, then fan out / route every event in arrival order."""
        sequenced = [e for e in events if e.kind is EventKind.SEQUENCED]
        if sender is not None:
            for event in sequenced:
                self.claim(sender, event.session)  # type: ignore[arg-type]
        # A batch of stored events only: the Redis log publishes it to the other instances in the
        # same round trip as the write (docs/performance.md), instead of a PUBLISH after it.
        published = bool(sequenced) and self.fanout is not None and len(sequenced) == len(events) and getattr(
            self.log, "publishes", False
        )
        d: Deferred[Any]
        if published:
            d = self.log.append(sequenced, publish=True)  # type: ignore[call-arg]
        else:
            d = self.log.append(sequenced) if sequenced else succeed(None)

        # (A batch of sequenced events only holds no command to route.)
        commands = len(sequenced) != len(events)

        def stored(_: object) -> None:
            self._dispatch_stored(events, sender, published, commands)

        return d.addCallback(stored)

    def ingest_now(self, events: Sequence[Event]) -> bool:
        """L{ingest} of a batch no emitter connection sent (an HTTP POST), done within this call when
        the log stores within it (its C{append_now}: the in-memory log), so that its caller answers
        at once, without a Deferred and its callbacks: C{True} once stored and fanned out, as
        L{ingest} would have; C{False}, with nothing done, for any other log (then L{ingest})."""
        append_now = getattr(self.log, "append_now", None)
        if append_now is None:
            return False
        if len(events) == 1:
            # One event per POST, the usual client's: stored as it came (no list of the sequenced).
            commands = events[0].kind is not EventKind.SEQUENCED
            if not commands:
                append_now(events)
        else:
            sequenced = [e for e in events if e.kind is EventKind.SEQUENCED]
            if sequenced:
                append_now(sequenced)
            commands = len(sequenced) != len(events)
        # (The in-memory log publishes nothing itself: a fan-out to other instances, if any, goes
        # from the dispatch, as from L{ingest}'s.)
        self._dispatch_stored(events, None, False, commands)
        return True

    def _dispatch_stored(
        self, events: Sequence[Event], sender: Emitter | None, published: bool = False, commands: bool = True
    ) -> None:
        """L{_dispatch} once the store has the events: a failure there is logged, never reported to
        the emitter as a refusal (its events were accepted and will be replayed)."""
        try:
            self._dispatch(events, sender, published, commands)
        except Exception:
            self._log.failure("aep fan-out failed after the events were stored")

    def _dispatch(
        self, events: Sequence[Event], sender: Emitter | None, published: bool = False, commands: bool = True
    ) -> None:
        """Fan out and route C{events} in arrival order (C{commands}: whether any may be a command)."""
        started = perf_counter()
        delivered = 0
        index = self.index
        if index.empty:
            # Nobody to offer an event to (no snapshot built): only the commands have somewhere to
            # go (a batch costs no fan-out call per event then).
            if commands:
                for event in events:
                    if event.kind is EventKind.COMMAND:
                        self.route_command(event, sender)
        else:
            # One snapshot per batch, not per event: a subscriber that closes meanwhile refuses writes.
            delivered = self._fan_out_runs(events, index.snapshot(), sender)
        _FANOUT(perf_counter() - started)
        _INGESTED(len(events))
        if delivered:
            _DELIVERED.inc(delivered)
        if self.fanout is not None and not published:
            self._publish([e for e in events if e.kind is not EventKind.COMMAND])

    def _publish(self, events: Sequence[Event]) -> None:
        """Hand events to the other instances' subscribers (they are already ours)."""
        if events and self.fanout is not None:
            self.fanout.publish(events).addErrback(self._store_error, "publish")

    def _store_error(self, failure: Failure, operation: str) -> None:
        _STORE_ERRORS.labels(relay="aep", operation=operation).inc()
        self._log.warn("aep store: {operation} failed: {reason}", operation=operation, reason=failure.getErrorMessage())

    def fan_out_remote(self, events: Sequence[Event]) -> None:
        """Deliver events another instance accepted (one message of the bus), in order."""
        delivered = self._fan_out_runs(events, self.index.snapshot(), None, route=False)
        if delivered:
            _DELIVERED.inc(delivered)

    def _fan_out_runs(
        self, events: Sequence[Event], subscribers: Snapshot, sender: Emitter | None, route: bool = True
    ) -> int:
        """Fan out C{events} in order, routing the commands among them (offering them to the
        subscribers, unless C{route}: another instance routed them, these are its audit copies);
        returns the deliveries.

        Consecutive events offered to the same subscribers (a batch of one session, the usual
        POST) go to each of them as one run (L{Subscriber.deliver_run}): an SSE stream then gets
        one write per batch, framed once for all of them, instead of one per event.
        """
        delivered = 0
        run: list[Event] = []
        run_groups: list[Group] = []
        for event in events:
            if event.kind is EventKind.COMMAND:
                if run:
                    delivered += self._deliver_run(run, run_groups)
                    run = []
                if route:
                    self.route_command(event, sender)
                else:
                    delivered += self._offer(event, subscribers.groups(event))
                continue
            # Even a duplicate is fanned out live: a byte-identical re-ack must traverse.
            groups = subscribers.groups(event)
            if run and groups == run_groups:  # (each group is made once per batch: mostly an identity test)
                run.append(event)
                continue
            if run:
                delivered += self._deliver_run(run, run_groups)
            run, run_groups = [event], groups
        if run:
            delivered += self._deliver_run(run, run_groups)
        return delivered

    def _deliver_run(self, run: list[Event], groups: list[Group]) -> int:
        """Deliver C{run}, whose events all have C{groups} as candidates; returns the deliveries."""
        if len(run) == 1:
            return self._offer(run[0], groups)
        memo: dict[Any, Any] = {}
        count = len(run)
        matched = 0
        for group, check in groups:
            for sub in group:
                match = sub.match
                if not check or match is match_all:
                    sub.deliver_run(run, memo)
                    matched += count
                    continue
                for event in run:
                    if match(event.ev):
                        sub.deliver(event)
                        matched += 1
        return matched

    def fan_out(self, event: Event, subscribers: Snapshot | None = None) -> int:
        """Deliver C{event} to every subscriber whose filter matches; returns how many matched.

        Only the subscribers the index files under the event's own values (and those whose
        filter pins nothing) are asked; one filed under its whole filter is not asked at all.
        """
        return self._offer(event, (self.index.snapshot() if subscribers is None else subscribers).groups(event))

    def _offer(self, event: Event, groups: list[Group]) -> int:
        matched = 0
        ev = None
        for group, check in groups:
            if not check:
                for sub in group:
                    sub.deliver(event)
                matched += len(group)
                continue
            for sub in group:
                match = sub.match
                if match is not match_all:  # (inlined L{Subscriber.wants}: this loop runs per delivery)
                    if ev is None:
                        ev = event.ev
                    if not match(ev):
                        continue
                sub.deliver(event)
                matched += 1
        return matched

    # Command routing (AEP-0004) ----------------------------------------------------------------

    def route_command(self, event: Event, sender: Emitter | None) -> Deferred[None]:
        """Forward a command to the one emitter that owns its session, or refuse toward the sender."""
        cause = event.key[1]
        if not self.token:
            self._refuse(
                sender,
                "unauthorized",
                cause,
                "control requires an authenticated binding (AEP-0004 §4.1); "
                "this relay runs without AEP_TOKEN",
            )
            return succeed(None)
        # A command is valid only with a session naming its target (envelope.classify).
        d: Deferred[Any] = self.claims.claimants(cast(str, event.session))
        d.addCallback(self._route, event, sender)
        d.addErrback(self._route_failed, event, sender)
        return d

    def _route(self, targets: list[Claimant], event: Event, sender: Emitter | None) -> Deferred[None] | None:
        session, cause = event.session, event.key[1]
        if not targets:
            self._refuse(sender, "no-route", cause, f"no connected emitter owns session {session}")
            return None
        if len(targets) > 1:
            self._refuse(sender, "ambiguous", cause, f"{len(targets)} connected emitters claim session {session}")
            return None
        target = targets[0]
        accepts = target.accepts
        d: Deferred[None] | None = None
        if accepts is not None and event.type not in accepts:
            self._refuse(sender, "unsupported", cause, f"target does not accept {event.type}")
        else:
            d = self.claims.deliver(target, event)
        audited = self.fan_out(event)  # audit: subscribers see routed (and refused-unsupported) commands
        if audited:
            _DELIVERED.inc(audited)
        if self.fanout is not None:
            self._publish([event])
        return d

    def _route_failed(self, failure: Failure, event: Event, sender: Emitter | None) -> None:
        self._store_error(failure, "route")
        self._refuse(sender, "unavailable", event.key[1], f"command routing unavailable: {failure.getErrorMessage()}")

    def _refuse(self, sender: Emitter | None, code: str, cause: Any, detail: str) -> None:
        _UNROUTABLE.inc()
        if sender is not None:
            sender.send_frame(error_frame(code, detail, cause=cause))

    # Connections and claims --------------------------------------------------------------------

    def connect(self, key: object, conn: Emitter) -> None:
        self.connections[key] = conn
        self.claims.connect(conn)

    def disconnect(self, key: object) -> None:
        conn = self.connections.pop(key, None)
        if conn is not None:
            self.claims.disconnect(conn).addErrback(self._store_error, "release")

    def claim(self, conn: Emitter, session: str) -> None:
        """C{conn} claims C{session} until it closes (a sequenced event it sent names the session)."""
        if session not in conn.claims:
            self.claims.claim(conn, session).addErrback(self._store_error, "claim")

    def roster(self) -> Deferred[list[dict[str, Any]]]:
        """One entry per (hello-done non-consumer connection, claimed session), in that order."""
        return self.claims.roster()

    # Subscriptions and replay ------------------------------------------------------------------

    def subscribe(self, key: object, sub: Subscriber) -> bool:
        """Register a subscriber (replacing one under the same key); C{False}, and nothing
        registered, when that would exceed C{max_subscribers}."""
        replaced = self.subscribers.pop(key, None)
        if replaced is None and len(self.subscribers) >= self.max_subscribers:
            return False
        self.subscribers[key] = sub
        self.index.add(key, sub, sub.pin)
        if self.fanout is not None:
            sub.heard = self.fanout.need(sessions_needed(sub.pin))
            if replaced is not None:
                self.fanout.release(sessions_needed(replaced.pin))
        return True

    def unsubscribe(self, key: object) -> bool:
        self.index.remove(key)
        gone = self.subscribers.pop(key, None)
        if gone is None:
            return False
        if self.fanout is not None:
            self.fanout.release(sessions_needed(gone.pin))
        return True

    def expand_all(self) -> Deferred[list[tuple[str, Position]]]:
        """C{from=all}: every held session, least recently written first, from the start."""
        return self.log.sessions().addCallback(lambda sessions: [(s, (0, -1)) for s in sessions])

    def reader(
        self, sub: Subscriber, entries: Sequence[tuple[str, Position]], from_all: bool
    ) -> ReplayReader:
        """The replay of C{entries} for C{sub}, to be read as it is sent (L{ReplayReader})."""
        return ReplayReader(self.log, sub, entries, from_all)

    # Health ------------------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        return {
            "sessions": self.log.session_count(),
            "subscribers": len(self.subscribers),
            "connections": len(self.connections),
            "uptime_s": round(self._seconds() - self._started),
        }
