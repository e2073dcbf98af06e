"""A Redis Cluster client over txredisapi (C{--redis redis+cluster://host:port[,host:port...]}).

txredisapi has no Cluster support: this routes each command to the master that owns its key's slot
(relayd/storage/buckets.py), with one L{Redis} pool per master (database 0; C{SELECT} is never sent).

- The slot map (C{CLUSTER SLOTS}) is read once a seed node answers, and again on C{MOVED}, on
  C{CLUSTERDOWN}/C{TRYAGAIN} and when a master cannot be reached (at most every L{REFRESH_AT_MOST}
  seconds). A C{MOVED} also updates its slot at once, and the command is sent again to the new
  owner; an C{ASK} (a slot being migrated) sends C{ASKING} and the command to the importing node, on
  one connection. More than L{MAX_REDIRECTS} redirections (a storm of them) answer
  L{StoreUnavailable}, as do a cluster that is down and an unreachable master: 503
  C{store-unavailable}, never a 500.
- Commands sent together (L{ClusterRedis.execute_many}: an AEP batch's per-bucket appends, the reads
  over the 64 buckets) go to each master as one group on one of its connections (one write; the
  replies matched in order), and each is redirected on its own.
- The keyspace version and bounds (relayd/storage/redis.py) are checked once the map is known,
  each key routed to its own slot (the marker check is one C{EXISTS} per key), instead of on every
  pool connection.
- The AEP fan-out, the one pub/sub of every accepted event, is sharded (C{SPUBLISH} from the append
  script on its bucket's shard channel, heard on that slot's master): L{ClusterRedis.shard_bus} is
  the process's L{ShardedBus} (relayd/storage/sharded.py), one subscriber connection per master,
  which places its channels by the slot map (L{ClusterRedis.on_map}) and follows their slots.
- The other pub/sub (commands to one instance, MCP instance channels, broker receipts: low volume)
  stays classic (a cluster forwards every C{PUBLISH} to every node), on any node that can be
  reached: each bus connects to the first of L{ClusterRedis.bus_order} (the seeds as given, then the
  other known masters by address) that accepts, so it moves on when its node goes; and keyless
  commands (C{PUBLISH}) go to the first of that order whose pool is up. A C{PUBLISH}'s count of
  receivers counts only the subscribers of the node it was sent to (Redis documents it so), and the
  MCP bus reads "0 receivers" as "that instance is gone": every instance must publish where the
  others subscribe, so every instance chooses by the same order (give them the same seed list) and a
  bus moves back to an earlier node once it is up again (L{ClusterRedis._node_up}).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence
from weakref import WeakKeyDictionary

import txredisapi
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from relayd.base.clock import Timekeeper
from relayd.base.errors import StoreRefused, StoreUnavailable
from relayd.compat import txredisapi as fence
from relayd.storage.buckets import SLOTS, key_slot
from relayd.storage.redis import (
    DEFAULT_TIMEOUT,
    KEYSPACE_VERSION,
    UNVERSIONED_MARKERS,
    VERSION_KEY,
    KeyspaceMismatch,
    KeyspaceVersionError,
    Redis,
    RedisURL,
    _endpoint,
    first_error,
    parse_redis_url,
)
from relayd.storage.sharded import ShardedBus

MAX_REDIRECTS = 5
REFRESH_AT_MOST = 0.25  # seconds between two reads of the slot map
RETRY = 0.5  # seconds before the first read of the map (or the keyspace check) is tried again

# Refusals after which the slot map may have changed (a failover, a reshard, a cluster down).
_TOPOLOGY = ("CLUSTERDOWN", "TRYAGAIN", "READONLY", "MASTERDOWN", "LOADING")

Address = tuple[str, int]


class _Node(Redis):
    """One master's pool: checks no keyspace of its own, and tells the cluster when it is up."""

    checks_keyspace = False
    what = "a Redis Cluster node"  # ("connected to Redis at" says the whole cluster is usable)
    cluster: ClusterRedis

    def _pool_connection(self, change: int) -> None:
        super()._pool_connection(change)
        if change > 0:
            self.cluster._node_up(self)

    def execute_asking(self, store: str, *command: Any, durable: bool = False) -> Deferred[Any]:
        """C{ASKING}, then the command, on one connection (a slot being imported by this node), and
        for an acknowledged write C{WAIT} after it, as L{Redis.execute} does."""
        waits = durable and bool(self.wait_replicas)

        def send(connection: Any) -> Deferred[Any]:
            connection.execute_command(b"ASKING").addErrback(lambda f: None)
            if waits:
                return self._confirmed(connection, command)
            return connection.execute_command(*command)

        return self._guard(
            store, command[0], lambda: self._factory.getConnection(peek=True).addCallback(send), waits=waits
        )


@implementer(IStreamClientEndpoint)
class _AnyNode:
    """Connects a bus to the first node of L{ClusterRedis.bus_order} that accepts (each node in
    turn, at every connect and reconnect), and tells the cluster which node each connection went to."""

    def __init__(self, cluster: ClusterRedis) -> None:
        self.cluster = cluster

    def connect(self, protocolFactory: Any) -> Deferred[Any]:
        cluster = self.cluster
        order = cluster.bus_order()
        cancelled = False

        def attempt(index: int) -> Deferred[Any]:
            address = order[index]
            endpoint = _endpoint(cluster.url, address[0], address[1], cluster.timeout, cluster.clock)
            d: Deferred[Any] = endpoint.connect(protocolFactory)

            def made(protocol: Any) -> Any:
                cluster._bus_nodes[protocol.transport] = address  # (the protocol may be a proxy of the bus's)
                return protocol

            def next_node(f: Failure) -> Any:
                if cancelled:
                    raise defer.CancelledError()
                if index + 1 == len(order):
                    return f  # every node refused: the bus's factory tries again later
                return attempt(index + 1)

            return d.addCallbacks(made, next_node)

        connecting = attempt(0)

        def cancel(_: Deferred[Any]) -> None:
            # The bus stopped while connecting: no other node is tried, or its connection would be
            # made behind the bus's stopped ClientService (automat's NoTransition when it is lost).
            # Known here, not from the failure: a HostnameEndpoint cancelled while it resolves the
            # name fails with DNSLookupError.
            nonlocal cancelled
            cancelled = True
            connecting.cancel()

        connected: Deferred[Any] = Deferred(cancel)
        connecting.chainDeferred(connected)
        return connected


def _shown(address: Address) -> str:
    return f"{address[0]}:{address[1]}"


def _routing_key(command: tuple[Any, ...]) -> bytes | None:
    """The key a command is routed by: a script's first key, a command's first argument, or none."""
    name = command[0]
    name = name.upper() if isinstance(name, bytes) else name.upper().encode()
    if name in (b"EVALSHA", b"EVAL"):
        return _bytes(command[3]) if int(command[2]) > 0 else None
    if name in (b"PUBLISH", b"TIME", b"INFO", b"PING", b"CLUSTER", b"COMMAND"):
        return None
    return _bytes(command[1]) if len(command) > 1 else None


def _bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


class ClusterRedis(Redis):
    """The process's Redis client on a Redis Cluster: the same calls as L{Redis}, routed by slot."""

    _log = Logger()
    # No Sentinel (each master's pool is a L{Redis}, which does what a write's options ask, C{WAIT}
    # included).
    follower: Any = None
    # The AEP fan-out is published on shard channels (C{SPUBLISH}), each heard on its slot's master
    # (L{shard_bus}), rather than on one classic channel the cluster forwards to every node; on a
    # txredisapi whose replies relayd cannot take (relayd/compat/txredisapi.py), classic.
    sharded_pubsub = fence.OWN_REPLIES

    def __init__(
        self,
        url: str | RedisURL,
        clock: Timekeeper,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        poolsize: int = 4,
        prefix: str = "relayd:",
        **node_options: Any,
    ) -> None:
        # (Not Redis.__init__: no pool of its own, one per master, made with C{node_options}.)
        # An acknowledged write waits for a replica of its master by default (C{WAIT 1}), as with
        # Sentinel: a cluster replicates asynchronously, and a write on a master that dies before
        # replicating it is lost when its replica is promoted.
        wait_replicas = node_options.get("wait_replicas")
        self.wait_replicas: int = 1 if wait_replicas is None else wait_replicas
        self._node_options = {**node_options, "wait_replicas": self.wait_replicas}
        self.url = url if isinstance(url, RedisURL) else parse_redis_url(url)
        if not self.url.cluster:
            raise ValueError("a Redis Cluster client needs a redis+cluster:// URL")
        self.clock = clock
        self.timeout = timeout
        self.poolsize = poolsize
        self.prefix = prefix.encode("utf-8")
        self.version_key = (prefix + VERSION_KEY).encode()
        self.bounds_key = (prefix + "bounds").encode()
        self.bounds: dict[bytes, bytes] = {}
        self.refusal: str | None = None
        self.refused: Deferred[str] = Deferred()
        self._buses: list[Any] = []
        self._redis_clock_offset = 0.0
        self.script_flags = False
        self._refused_commands: set[Any] = set()
        self._usable_connections = 0
        self._closing = False
        self._nodes: dict[Address, _Node] = {}
        self._slots: list[Address | None] = [None] * SLOTS
        self._masters: set[Address] = set()
        self._mapped = False  # the slot map was read
        self._checked = False  # and the keyspace checked: commands are sent
        self._refreshing: Deferred[None] | None = None
        self._last_refresh = -REFRESH_AT_MOST
        self._later: Any = None
        self._map_listeners: list[Callable[[], None]] = []
        self._shard_bus: ShardedBus | None = None
        # The node each bus connection went to, by its transport (L{_AnyNode}).
        self._bus_nodes: WeakKeyDictionary[Any, Address] = WeakKeyDictionary()
        # Nodes that left a bus's PING unanswered (L{subscriber_silent}): last in L{bus_order} until
        # their pool connects again (L{_node_up}).
        self._silent: set[Address] = set()
        for seed in self.url.seeds:
            self._node(seed)

    # nodes and the slot map

    def _node(self, address: Address) -> _Node:
        node = self._nodes.get(address)
        if node is None:
            host, port = address
            url = RedisURL(host, port, 0, self.url.username, self.url.password, self.url.tls)
            node = _Node(url, self.clock, timeout=self.timeout, poolsize=self.poolsize, **self._node_options)
            node.cluster = self
            self._nodes[address] = node
        return node

    def _node_up(self, node: _Node) -> None:
        self.script_flags = node.script_flags
        self._redis_clock_offset = node._redis_clock_offset
        if not self._mapped:
            self.refresh()
        address = (node.url.host, node.url.port)
        if address in self._silent:
            self._silent.discard(address)
            self._log.info("Redis Cluster node {node} answers again; pub/sub may use it again", node=_shown(address))
        # A node before a bus's in L{bus_order} is up (again): the bus moves back to it, where the
        # other instances publish (a PUBLISH counts only its own node's subscribers).
        order = self.bus_order()
        if address not in order:
            return
        rank = order.index(address)
        for bus in self._buses:
            conn = bus.connection
            on = self.bus_node(conn)
            if on is not None and (on not in order or order.index(on) > rank):
                conn.transport.loseConnection()

    def bus_order(self) -> list[Address]:
        """The nodes pub/sub may use, in the order every instance tries them: the seeds as given,
        then the other masters of the slot map by address; a node that hangs (L{subscriber_silent})
        last, until it answers again."""
        seeds = list(self.url.seeds)
        order = seeds + sorted(address for address in self._nodes if address not in seeds)
        return [a for a in order if a not in self._silent] + [a for a in order if a in self._silent]

    def subscriber_silent(self, connection: Any) -> None:
        """A bus's PING went unanswered on C{connection} (relayd/storage/heartbeat.py): its node hangs,
        and still accepts connections (the kernel answers for a stopped process), so the bus would
        reconnect there and stay deaf. The node goes last in L{bus_order} (the bus reconnects to the
        next, keyless commands go there too, as every instance's bus does the same), and its pool
        is dropped: reconnected, it is up again (L{_node_up}) only once the node answers."""
        address = self.bus_node(connection)
        if address is None or address in self._silent:
            return
        self._silent.add(address)
        order = self.bus_order()
        self._log.warn("Redis Cluster node {node} does not answer; pub/sub moves to {next} until it answers again",
                       node=_shown(address), next=_shown(order[0]) if order[0] != address else "none")  # fmt: skip
        node = self._nodes.get(address)
        if node is not None:
            node.drop_pool()

    def bus_node(self, connection: Any) -> Address | None:
        """The node a bus connection went to (C{None} for no connection)."""
        return None if connection is None else self._bus_nodes.get(connection.transport)

    def endpoint(self) -> IStreamClientEndpoint:
        """Where a bus connects: the first node of L{bus_order} that accepts."""
        return _AnyNode(self)

    def _keyless_address(self) -> Address | None:
        """Where a keyless command (C{PUBLISH}) goes: the first node of L{bus_order} whose pool is up."""
        for address in self.bus_order():
            node = self._nodes.get(address)
            if node is not None and node.connected:
                return address
        return None

    @property
    def connected(self) -> bool:
        return self._checked and self.refusal is None

    def owner_of(self, slot: int) -> Address | None:
        """The master that owns C{slot} as the slot map says (C{None} before it is read)."""
        return self._slots[slot]

    def masters(self) -> set[Address]:
        """The masters of the slot map as last read (and those a C{MOVED} named since)."""
        return self._masters

    def on_map(self, listener: Callable[[], None]) -> None:
        """Call C{listener()} after every read of the slot map (L{ShardedBus} places its channels)."""
        self._map_listeners.append(listener)

    def moved(self, slot: int, where: str, answered_by: Address) -> None:
        """A node answered C{MOVED slot where} (C{host:port}, the host empty for the node that
        answered): the slot is there now, and the map is read again."""
        host, _, port = where.rpartition(":")
        address = (host.strip("[]") or answered_by[0], int(port))
        self._slots[slot] = address
        self._masters.add(address)
        self.refresh()

    def shard_bus(self) -> ShardedBus:
        """The process's sharded subscriber (one connection per master, made when first asked)."""
        if self._shard_bus is None:
            self._shard_bus = ShardedBus(self)
        return self._shard_bus

    def refresh(self) -> Deferred[None]:
        """Read the slot map again (now, or once L{REFRESH_AT_MOST} has passed since the last read)."""
        if self._refreshing is not None or self._closing or self.refusal is not None:
            return self._refreshing or defer.succeed(None)
        wait = self._last_refresh + REFRESH_AT_MOST - self.clock.monotonic()
        if wait > 0:
            if self._later is None:
                self._later = self.clock.call_later(wait, self._refresh_later)
            return defer.succeed(None)
        self._last_refresh = self.clock.monotonic()
        self._refreshing = Deferred.fromCoroutine(self._refresh())
        self._refreshing.addErrback(self._refresh_failed)

        def done(_: Any) -> None:
            self._refreshing = None

        return self._refreshing.addBoth(done)

    def _refresh_later(self) -> None:
        self._later = None
        self.refresh()

    def _refresh_failed(self, f: Failure) -> None:
        if f.check(KeyspaceMismatch):
            self._refuse(str(f.value))
            return
        self._log.warn("Redis Cluster at {url}: {error}; trying again", url=str(self.url), error=f.getErrorMessage())
        if self._later is None and not self._closing:
            self._later = self.clock.call_later(RETRY, self._refresh_later)

    async def _refresh(self) -> None:
        asked = [node for node in self._nodes.values() if node.connected]
        if not asked:
            for seed in self.url.seeds:  # every known node gone: start again from the seeds
                self._node(seed)
            raise StoreUnavailable("redis", "no node of the cluster is reachable")
        node = asked[0]
        reply = await node.execute("redis", b"CLUSTER", b"SLOTS")
        slots: list[Address | None] = [None] * SLOTS
        masters: set[Address] = set()
        for entry in reply:
            start, end, master = int(entry[0]), int(entry[1]), entry[2]
            host = master[0].decode() if master[0] else node.url.host  # empty: the node asked
            address = (host, int(master[1]))
            masters.add(address)
            slots[start : end + 1] = [address] * (end - start + 1)
        self._slots = slots
        self._masters = masters
        for address in masters:
            self._node(address)
        for address in list(self._nodes):
            if address not in masters and address not in self.url.seeds:  # (the seeds serve pub/sub)
                self._nodes.pop(address).close()
        first = not self._mapped
        self._mapped = True
        for listener in list(self._map_listeners):
            listener()
        if not self._checked:
            await self._check_keyspace()
            self._checked = True
        if first:
            self._log.info(
                "connected to Redis at {url} (keyspace version {version}; a Redis Cluster of {masters} masters)",
                url=str(self.url), masters=len(masters), version=KEYSPACE_VERSION,
            )  # fmt: skip

    async def _check_keyspace(self) -> None:
        """The version key and the bounds, as a single primary's connections check them
        (relayd/storage/redis.py), each key sent to its own slot."""
        key, mine = self.version_key, str(KEYSPACE_VERSION).encode()
        try:
            found = await self._send("redis", (b"GET", key))
            if found is None:
                prefix = key[: -len(VERSION_KEY)]
                for marker in UNVERSIONED_MARKERS:
                    if int(await self._send("redis", (b"EXISTS", prefix + marker.encode()))):
                        raise KeyspaceVersionError(self.mismatch("keys of an earlier relayd without a keyspace version"))
                await self._send("redis", (b"SET", key, mine, b"NX"))
                found = await self._send("redis", (b"GET", key))
        except txredisapi.ResponseError as e:
            if str(e).startswith("WRONGTYPE"):
                raise KeyspaceVersionError(self.mismatch(f"a {key.decode(errors='replace')} key that is not a version")) from None
            raise
        if found != mine:
            raise KeyspaceVersionError(self.mismatch(f"relayd keyspace version {found.decode(errors='replace')}"))
        bounds = dict(self.bounds)
        if bounds:
            for name, value in bounds.items():
                await self._send("redis", (b"HSETNX", self.bounds_key, name, value))
            held = await self._send("redis", (b"HMGET", self.bounds_key, *bounds))
            differ = [(name, mine, there) for (name, mine), there in zip(bounds.items(), held, strict=True) if there != mine]
            if differ:
                raise KeyspaceMismatch(self.bounds_mismatch(differ))

    def _refuse(self, message: str) -> None:
        if self.refusal is not None:
            return
        self.refusal = message
        self._log.critical("{reason}", reason=message)
        for node in self._nodes.values():
            node.close()
        self.refused.callback(message)

    # commands

    def execute(self, store: str, *command: Any, **options: Any) -> Deferred[Any]:
        """Run one command on the master of its key's slot (L{Redis.execute}'s failures, and
        L{StoreUnavailable} while the slot map is unknown or keeps moving); C{options} go to the
        master's L{Redis.execute} as they are."""
        if self.refusal is not None:
            return defer.fail(StoreUnavailable(store, "another relayd keyspace version"))
        if not self._checked:
            return defer.fail(StoreUnavailable(store, "not connected"))
        return self._send(store, command, options=options)

    def _send(
        self,
        store: str,
        command: tuple[Any, ...],
        redirects: int = 0,
        asking: Address | None = None,
        options: dict[str, Any] | None = None,
    ) -> Deferred[Any]:
        key = _routing_key(command)
        if asking is not None:
            address: Address | None = asking
        elif key is None:
            address = self._keyless_address()
            if address is None:
                self.refresh()
                return defer.fail(StoreUnavailable(store, "no node of the cluster is reachable"))
        else:
            address = self._slots[key_slot(key)]
        if address is None:
            self.refresh()
            return defer.fail(StoreUnavailable(store, "no master serves that slot"))
        node = self._node(address)
        if not node.connected:
            self.refresh()  # a master gone, or one just learned of
        options = options or {}
        if asking is not None:
            d = node.execute_asking(store, *command, **options)
        else:
            d = node.execute(store, *command, **options)
        return d.addErrback(self._redirected, store, command, redirects, node, options)

    def _redirected(
        self, f: Failure, store: str, command: tuple[Any, ...], redirects: int, node: _Node, options: dict[str, Any]
    ) -> Any:
        if f.check(txredisapi.ResponseError):
            words = str(f.value).split()
            if len(words) == 3 and words[0] in ("MOVED", "ASK"):
                if redirects >= MAX_REDIRECTS:
                    self.refresh()
                    raise StoreUnavailable(store, f"the Redis Cluster's slots keep moving ({words[0]} {words[1]})")
                if words[0] == "MOVED":
                    self.moved(int(words[1]), words[2], (node.url.host, node.url.port))
                    return self._send(store, command, redirects + 1, options=options)
                host, _, port = words[2].rpartition(":")
                address = (host.strip("[]") or node.url.host, int(port))
                return self._send(store, command, redirects + 1, asking=address, options=options)
        elif f.check(StoreRefused):
            if f.value.code in _TOPOLOGY:  # type: ignore[union-attr]
                self.refresh()
        elif f.check(StoreUnavailable):
            self.refresh()
        return f

    def execute_many(
        self, store: str, commands: Sequence[tuple[Any, ...]], durable: bool = False
    ) -> list[Deferred[Any]]:
        """Several commands at once, each routed as by L{execute}: those of one master go to it
        together (its L{Redis.execute_many}: one write, the replies matched in order), so a batch
        over many slots costs a write per master, not per command. Each command is redirected on
        its own (a C{MOVED} or C{ASK} in the middle of a master's group sends that command alone
        where it now goes; the rest of the group is answered where it was)."""
        if self.refusal is not None or not self._checked:
            return [self.execute(store, *command, durable=durable) for command in commands]
        options = {"durable": durable}
        sent: list[Deferred[Any] | None] = [None] * len(commands)
        groups: dict[Address, list[int]] = {}
        for i, command in enumerate(commands):
            key = _routing_key(command)
            address = self._slots[key_slot(key)] if key is not None else None
            node = self._nodes.get(address) if address is not None else None
            if node is None or not node.connected:
                sent[i] = self._send(store, command, options=options)  # (it refreshes the map, or fails)
            else:
                groups.setdefault(address, []).append(i)  # type: ignore[arg-type]
        for address, at in groups.items():
            node = self._nodes[address]
            answers = node.execute_many(store, [commands[i] for i in at], durable=durable)
            for i, d in zip(at, answers, strict=True):
                sent[i] = d.addErrback(self._redirected, store, commands[i], 0, node, options)
        return sent  # type: ignore[return-value]  # (every one set above)

    def get_many(self, store: str, keys: list[bytes]) -> Deferred[list[Any]]:
        """One C{GET} per key, each on its slot's master (sent at once: one write per master)."""
        reads = self.execute_many(store, [(b"GET", key) for key in keys])
        return defer.gatherResults(reads, consumeErrors=True).addErrback(first_error)

    def close(self) -> Deferred[Any]:
        self._closing = True
        if self._later is not None:
            self.clock.cancel(self._later)
            self._later = None
        ds = [bus.close() for bus in list(self._buses)] + [node.close() for node in self._nodes.values()]
        self._buses = []
        if self._shard_bus is not None:
            ds.append(self._shard_bus.close())
        return defer.gatherResults(ds, consumeErrors=True)


def redis_client(url: str, clock: Timekeeper, *, prefix: str = "relayd:", **options: Any) -> Redis:
    """The client C{--redis} names: a single primary's, or a Redis Cluster's (C{options}: the
    other keyword arguments of L{Redis}, given to each master's)."""
    if parse_redis_url(url).cluster:
        return ClusterRedis(url, clock, prefix=prefix, **options)
    return Redis(url, clock, prefix=prefix, **options)
