"""A Sentinel follower over txredisapi: where the master is, as the sentinels say, kept current.

relayd/storage/redis.py connects its pool and its pub/sub subscriber through L{MasterEndpoint}, so
every (re)connect first asks the sentinels for the master (C{SENTINEL get-master-addr-by-name}, each
sentinel in turn until one answers). Before a connection is used its handshake calls L{SentinelFollower.check}:
the connection must go to the address the sentinels name now and C{ROLE} must answer C{master}
(bytes-safe: txredisapi's own Sentinel client compares C{b"master"} with C{"master"} under
C{charset=None} and never connects, which is why relayd does not use it).

A switch is followed at once: the follower subscribes to C{+switch-master} on every sentinel, and the
clients it serves drop their connections to the old master (L{SentinelFollower.on_switch}); the
sentinels are asked again every L{RECHECK_INTERVAL} seconds as well, since a pub/sub message can be
missed (a sentinel restarting, a connection being re-made), and at once when Redis answers as a
demoted master would (C{READONLY}, C{MASTERDOWN}...: L{SentinelFollower.recheck}).

While a failover is under way (a sentinel announced C{+try-failover}) and until the switch (or an
abort), acknowledged writes are refused (L{SentinelFollower.failing_over}): the old master keeps
accepting writes until the sentinels demote it, up to ten seconds after the promotion, and a replica
not yet moved to the new master still confirms them (C{WAIT}), so a write acknowledged then would
be lost when both resynchronise. Refused, it is a 503 the client retries on the new master.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any
from weakref import WeakKeyDictionary

import txredisapi
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import HostnameEndpoint, connectProtocol
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from relayd.base.clock import Timekeeper
from relayd.base.errors import first_error
from relayd.compat import txredisapi as fence
from relayd.compat.txredisapi import WholeReads
from relayd.storage.heartbeat import Heartbeat
from relayd.storage.tls import tls_failure

# How often the sentinels are asked where the master is, besides listening to them (seconds).
RECHECK_INTERVAL = 2.0
# The longest a failover announced by a sentinel holds acknowledged writes back when neither its
# switch nor its abort is heard (seconds); the periodic check finds a switch that was missed.
FAILOVER_HOLD = 10.0
# Sentinel pub/sub channels: a failover starting, the switch, a failover given up.
FAILOVER_STARTS = b"+try-failover"
SWITCH = b"+switch-master"
ABORTS = b"-failover-abort-*"

Address = tuple[str, int]


class NotMaster(Exception):
    """A connection that does not go to the master the sentinels name now; it is dropped and re-made."""


class NoMaster(Exception):
    """No sentinel named a master (none answered, or none knows the name)."""


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class _OneShot(txredisapi.RedisProtocol):
    """A connection to a sentinel for one question (no pool, no reconnect; AUTH is sent by the asker)."""

    lost_because: str | None = None  # why TLS closed the connection, if it did

    def __init__(self) -> None:
        super().__init__(charset=None, convertNumbers=False)

    def connectionLost(self, why: Failure) -> Any:
        self.lost_because = tls_failure(why)  # (txredisapi's error for the command says "Lost connection")
        return super().connectionLost(why)


class _Watcher(Heartbeat, WholeReads, txredisapi.SubscriberProtocol):
    """One sentinel's pub/sub: the failover events of every master, handed to the follower. A
    sentinel that hangs is dropped and reconnected as a data node's subscriber is (L{Heartbeat}):
    its watcher would otherwise miss a switch for as long as TCP keeps the connection (minutes)."""

    follower: SentinelFollower
    factory: Any  # its C{relayd_sentinel}: the sentinel's address as the URL gives it
    lost_because: str | None = None  # why TLS closed the connection, if it did

    def connectionMade(self) -> Any:
        self.whenConnected().addCallback(self._watch)
        if not fence.READY_STATE:
            return super().connectionMade()  # txredisapi's AUTH: one that fails stops this watcher for good
        return self._authenticate()

    @defer.inlineCallbacks
    def _authenticate(self) -> Any:
        """relayd's AUTH (as a data node's connection has, relayd/compat/txredisapi.py READY_STATE):
        one refused, unanswered within the timeout or cut by a lost connection drops this connection
        only, and the factory connects again. txredisapi's own would stop reconnecting to this
        sentinel for good, and a sentinel that restarted mid-AUTH would never be heard again."""
        if self.password is not None:
            try:
                reply = yield self.follower.clock.timeout(self.auth(self.password, self.username), self.follower.timeout)
                if isinstance(reply, Exception):
                    raise reply
            except Exception as e:
                # (Not logged: a wrong sentinel_password, or a sentinel away, is said once by the follower's questions.)
                self._log.debug("Sentinel watcher AUTH failed ({error}); reconnecting", error=str(e))
                if self.connected:
                    self.transport.abortConnection()
                return
        fence.mark_ready(self)

    def connectionLost(self, why: Failure) -> Any:
        self.stop_heartbeat()
        self.lost_because = tls_failure(why)  # (before txredisapi fails the subscribe)
        return super().connectionLost(why)

    def heard(self) -> None:
        listening = self._clock is not None  # (not the errors txredisapi hands itself as the connection goes)
        super().heard()
        if listening and self.follower._silent:
            self.follower._sentinel_answers(self.factory.relayd_sentinel)

    def unanswered(self, timeout: float) -> None:
        self.follower._sentinel_silent(self.factory.relayd_sentinel, timeout)

    def _watch(self, _: Any) -> None:
        self.start_heartbeat(self.follower.clock, self.follower.timeout)
        # (consumeErrors: a connection lost while subscribing, a TLS handshake refused, fails both once.)
        d = defer.gatherResults(
            [self.subscribe([SWITCH, FAILOVER_STARTS]), self.psubscribe([ABORTS])], consumeErrors=True
        )
        d.addErrback(self._watch_failed)

    def _watch_failed(self, f: Failure) -> None:
        if self.lost_because is None:  # (a TLS refusal is said once, with why, by the follower's questions)
            self.follower.watch_failed(f, self.factory.relayd_sentinel)

    def messageReceived(self, pattern: Any, channel: bytes, message: bytes) -> None:
        self.follower._event(channel, message)


@implementer(IStreamClientEndpoint)
class MasterEndpoint:
    """Connects to the master the sentinels name at the moment of connecting, and tells the follower
    which address each connection went to (L{SentinelFollower.address_of})."""

    def __init__(self, follower: SentinelFollower, endpoint: Callable[[str, int], IStreamClientEndpoint]) -> None:
        self.follower = follower
        self.endpoint = endpoint

    def connect(self, protocolFactory: Any) -> Deferred[Any]:
        def ask(address: Address) -> Deferred[Any]:
            # Fires as the connection is made, before any reply can be read: the handshake's check finds it.
            return self.endpoint(*address).connect(protocolFactory).addCallback(self.follower._made, address)

        return self.follower.discover().addCallback(ask)


class SentinelFollower:
    """The master of C{master_name} as C{sentinels} say, kept current (see the module docstring).

    @param username: the sentinels' own credentials (C{?sentinel_username=}), not the data nodes'.
    @param password: likewise (C{?sentinel_password=}).
    @param endpoint: how a sentinel is reached, by host and port: over TLS with C{rediss+sentinel://}
        (relayd/storage/redis.py); plain TCP by default.
    """

    _log = Logger()

    def __init__(
        self,
        sentinels: Sequence[Address],
        master_name: str,
        clock: Timekeeper,
        *,
        timeout: float,
        username: str | None = None,
        password: str | None = None,
        recheck_interval: float | None = None,
        endpoint: Callable[[str, int], IStreamClientEndpoint] | None = None,
    ) -> None:
        self.sentinels = list(sentinels)
        self.master_name = master_name
        self.clock = clock
        self.timeout = timeout
        self.username = username
        self.password = password
        self.recheck_interval = RECHECK_INTERVAL if recheck_interval is None else recheck_interval
        self._sentinel_endpoint = endpoint or (
            lambda host, port: HostnameEndpoint(clock.reactor, host, port, timeout=self.timeout)
        )
        # Where the connections go: the master the sentinels named last (None: not asked yet).
        self.address: Address | None = None
        self._waiting: list[Deferred[Address]] = []  # callers of the question in flight
        self._question: Deferred[Address] | None = None
        self._switch_listeners: list[Callable[[Address], None]] = []
        self._hold_until: float | None = None  # acknowledged writes held back until then (a failover)
        self._watchers: list[Any] = []
        self._addresses: WeakKeyDictionary[Any, Address] = WeakKeyDictionary()  # transport -> where it went
        self._loop: Any = None
        self._stopped = False
        self._unanswered = False  # the last question had no answer (logged once)
        self._silent: set[Address] = set()  # sentinels whose watcher's PING went unanswered (logged once)

    # -- what the clients use

    def start(self) -> None:
        """Listen to every sentinel and ask again every few seconds."""

        class Watcher(_Watcher):
            follower = self

        for host, port in self.sentinels:
            factory = txredisapi.SubscriberFactory(isLazy=True)
            factory.charset = None
            factory.convertNumbers = False
            factory.continueTrying = True
            factory.password = self.password
            factory.username = self.username
            factory.initialDelay = 0.2
            factory.maxDelay = 2
            factory.protocol = Watcher
            factory.relayd_sentinel = (host, port)
            factory.startConnecting(self._sentinel_endpoint(host, port))
            self._watchers.append(factory)
        self._loop = self.clock.looping_call(self.recheck_interval, self.recheck)

    def stop(self) -> Deferred[Any]:
        self._stopped = True
        if self._loop is not None:
            self.clock.stop_loop(self._loop)
        if self._question is not None:  # a question in flight: its connection and timeout go with it
            self._question.cancel()
        ds = [factory.disconnect() for factory in self._watchers]
        self._watchers = []
        return defer.gatherResults(ds, consumeErrors=True)

    def on_switch(self, listener: Callable[[Address], None]) -> None:
        """Call C{listener(new_address)} when the master moves (it drops its connections elsewhere)."""
        self._switch_listeners.append(listener)

    def endpoint(self, endpoint: Callable[[str, int], IStreamClientEndpoint]) -> MasterEndpoint:
        return MasterEndpoint(self, endpoint)

    @property
    def failing_over(self) -> bool:
        """A sentinel announced a failover of this master that has not switched or been given up yet."""
        if self._hold_until is None:
            return False
        if self.clock.monotonic() >= self._hold_until:
            self._hold_until = None
            return False
        return True

    @defer.inlineCallbacks
    def check(self, protocol: Any) -> Any:
        """Before C{protocol} (a handshaking connection) is used: C{ROLE} says it is a master, and
        it goes to the master the sentinels name now (asked after C{ROLE}: L{MasterEndpoint} records
        the address as the connection is made, within C{connectionMade}); else L{NotMaster}."""
        role = yield protocol.execute_command("ROLE")
        if not isinstance(role, list) or not role or role[0] != b"master":
            self.recheck()
            found = _text(role[0]) if isinstance(role, list) and role else _text(role)
            raise NotMaster(f"{self._shown(self.address_of(protocol))} is a {found}, not the master")
        if self.address_of(protocol) != self.address:  # the master moved while this connected
            raise NotMaster(f"the master moved to {self._shown(self.address)}")

    def watch_failed(self, f: Failure, sentinel: Address) -> None:
        """Subscribing to a sentinel failed (it went meanwhile): its next connection subscribes again.
        (Not said again for a sentinel already said to be silent: its every reconnection fails so.)"""
        f = first_error(f)
        if sentinel in self._silent:
            return
        self._log.info("Sentinel subscribe interrupted ({error}); resubscribing on reconnect", error=f.getErrorMessage())

    def _sentinel_silent(self, sentinel: Address, timeout: float) -> None:
        """A watcher's PING went unanswered: its connection is dropped and made again (said once
        while that sentinel stays silent, not at every reconnection to it)."""
        if sentinel not in self._silent:
            self._silent.add(sentinel)
            self._log.warn("Sentinel {sentinel} did not answer a PING within {timeout} s; reconnecting its watcher",
                           sentinel=self._shown(sentinel), timeout=timeout)  # fmt: skip

    def _sentinel_answers(self, sentinel: Address) -> None:
        if sentinel in self._silent:
            self._silent.discard(sentinel)
            self._log.info("Sentinel {sentinel} answers again", sentinel=self._shown(sentinel))

    def address_of(self, protocol: Any) -> Address | None:
        """The master address C{protocol}'s connection was made to (by its transport)."""
        return self._addresses.get(protocol.transport)

    def _made(self, protocol: Any, address: Address) -> Any:
        self._addresses[protocol.transport] = address
        return protocol

    def recheck(self) -> None:
        """Ask the sentinels again now (a periodic check, or Redis answered as a replica would)."""
        if self._stopped or self._waiting:
            return
        self.discover().addErrback(lambda f: self._log.debug("sentinels not reached: {error}", error=f.getErrorMessage()))

    def discover(self) -> Deferred[Address]:
        """The master's address, asked of each sentinel in turn (one question in flight at a time:
        a caller meanwhile gets the answer of the one asked)."""
        if self._stopped:
            return defer.fail(defer.CancelledError("the Sentinel follower is stopped"))
        d: Deferred[Address] = Deferred()
        self._waiting.append(d)
        if len(self._waiting) == 1:
            self._question = Deferred.fromCoroutine(self._ask_each())
            self._question.addBoth(self._answered)
        return d

    def _answered(self, result: Address | Failure) -> None:
        self._question = None
        waiting, self._waiting = self._waiting, []
        if not isinstance(result, Failure):
            if self._unanswered:
                self._unanswered = False
                self._log.info("the sentinels name Redis master {name} again", name=self.master_name)
            self._found(result)
        elif not self._stopped and not self._unanswered and result.check(NoMaster):
            self._unanswered = True  # once per outage, not once per connection attempt
            self._log.warn("{error}; asking again", error=result.getErrorMessage())
        for d in waiting:
            if d.called:  # cancelled by its caller (a connection attempt given up)
                continue
            if isinstance(result, Failure):
                d.errback(result)
            else:
                d.callback(result)

    # -- inside

    async def _ask_each(self) -> Address:
        errors = []
        for host, port in self.sentinels:
            try:
                return await self._ask(host, port)
            except Exception as e:
                if self._stopped:  # (the answer lost as the follower stopped): no other sentinel is asked
                    raise defer.CancelledError("the Sentinel follower is stopped") from None
                errors.append(f"{host}:{port}: {e}")
        raise NoMaster(f"no sentinel named master {self.master_name!r} ({'; '.join(errors)})")

    async def _ask(self, host: str, port: int) -> Address:
        endpoint = self._sentinel_endpoint(host, port)
        protocol: _OneShot = await self.clock.timeout(connectProtocol(endpoint, _OneShot()), self.timeout)
        try:
            return await self._question_to(protocol)
        except txredisapi.ConnectionError:
            if protocol.lost_because is not None:
                raise txredisapi.ConnectionError(protocol.lost_because) from None
            raise

    async def _question_to(self, protocol: _OneShot) -> Address:
        try:
            if self.password is not None:
                args = (self.username, self.password) if self.username else (self.password,)
                reply = await self.clock.timeout(protocol.execute_command("AUTH", *args), self.timeout)
                if isinstance(reply, Exception):
                    raise reply
            reply = await self.clock.timeout(
                protocol.execute_command("SENTINEL", "get-master-addr-by-name", self.master_name), self.timeout
            )
        finally:
            protocol.transport.loseConnection()
        if isinstance(reply, Exception):
            raise reply
        if not reply:
            raise NoMaster(f"does not know a master named {self.master_name!r}")
        return _text(reply[0]), int(reply[1])

    def _found(self, address: Address) -> None:
        before, self.address = self.address, address
        if before is not None and before != address:
            self._log.warn(
                "Redis master {name} moved from {old} to {new} (Sentinel); reconnecting there",
                name=self.master_name, old=self._shown(before), new=self._shown(address),
            )  # fmt: skip
            self._hold_until = None
            for listener in list(self._switch_listeners):
                listener(address)

    def _event(self, channel: bytes, message: bytes) -> None:
        words = message.split()
        if channel == SWITCH:
            # "<name> <old ip> <old port> <new ip> <new port>"
            if len(words) == 5 and _text(words[0]) == self.master_name:
                self._found((_text(words[3]), int(words[4])))
                self._hold_until = None
            return
        if self.master_name.encode() not in words:
            return
        if channel == FAILOVER_STARTS:
            self._log.info("Sentinel fails Redis master {name} over; acknowledged writes wait for the switch",
                           name=self.master_name)  # fmt: skip
            self._hold_until = self.clock.monotonic() + FAILOVER_HOLD
        else:  # an abort: the master stays where it is
            self._hold_until = None
            self.recheck()

    @staticmethod
    def _shown(address: Address | None) -> str:
        return "?" if address is None else f"{address[0]}:{address[1]}"
