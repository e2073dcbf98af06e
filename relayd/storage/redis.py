"""Redis for relayd: one connection pool, prompt failure while Redis is away, and a pub/sub bus.

It knows no protocol. Every call fails fast with L{StoreUnavailable} while no connection is up (instead
of queueing until Redis returns, which would hang requests), and after C{timeout} seconds when Redis
does not answer; the pool and the subscriber reconnect by themselves with backoff.

With C{redis+sentinel://} every connection goes where relayd/storage/sentinel.py says the master is,
and an acknowledged write waits for its replicas (L{Redis.execute} C{durable}). (Over 600 lines: the
URL, the handshake, the pool and the bus are the one client and change together; the Sentinel
follower is its own module.)
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, replace
from functools import cache, partial
from typing import Any, Callable, Sequence
from urllib.parse import parse_qs, unquote, urlsplit

import txredisapi
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.logger import Logger
from twisted.python.failure import Failure

from relayd.base.clock import Timekeeper
from relayd.base.errors import OutcomeUnknown, StoreRefused, StoreUnavailable, first_error
from relayd.compat import txredisapi as fence
from relayd.compat.tcp import write_now
from relayd.compat.txredisapi import OneDeferredCommands, OnePassCommands, WholeReads
from relayd.storage.heard import HeardChannels
from relayd.storage.heartbeat import Heartbeat
from relayd.storage.sentinel import SentinelFollower
from relayd.storage.tls import tls_failure

DEFAULT_TIMEOUT = 2.0

# The version of relayd's keyspace: the names, types and encodings of every key relayd keeps in Redis
# and what its Lua scripts expect of them. Bump it (one integer for every wing) with any change a
# relayd of the previous version would misread. Each connection checks it under --redis-prefix
# (relayd:schema) before it is used, and a relayd that finds another version refuses that Redis
# (docs/deployment.md "Upgrades").
# 2: Lua scripts in files, keys hash-tagged per session (docs/decisions.md REDIS-1); 3: AEP members carry
# their dedupe key, and the usual batch is stored once, as it came (relayd/aep/redis/store.py); 4: every
# key tagged by its bucket, deployment-wide keys split per bucket, so that every script touches one
# Redis Cluster slot (relayd/storage/buckets.py).
KEYSPACE_VERSION = 4
VERSION_KEY = "schema"  # after the prefix
# Beside it, a hash of the deployment-wide bounds the keys are kept by (a wing's, by flag name:
# aep-buffer, mcp-queue-frames...): instances with other values would trim one another's keys, so
# each connection checks them too, and the first instance's values hold (L{Redis.hold_bounds}).
BOUNDS_KEY = "bounds"  # after the prefix
# Deployment-wide keys every earlier relayd kept (before keyspace versions): with no version key
# beside them, the keys under the prefix are an unversioned layout, not an empty keyspace.
UNVERSIONED_MARKERS = ("aep:lru", "aep:arrival", "aep:clock", "mcp:sessions", "mcp:buffered", "mcp:seq")


# Redis's refusals of a command it did not run, by the error's first word (after the "-" that quotes
# it inside a script's error before Redis 7): memory full under noeviction, a replica, a failed
# snapshot, a script running too long, a dataset loading, a replica cut from its primary, too few
# replicas, a cluster moving or down. Each is an outage of the store (503, retry), not a bug;
# NOSCRIPT is relayd/storage/redis_lua.py's to answer (it sends the script in full).
_REFUSAL = re.compile(
    r"(?:^|-)(OOM|READONLY|MISCONF|BUSY|LOADING|MASTERDOWN|NOREPLICAS|TRYAGAIN|CLUSTERDOWN|NOSCRIPT)\b"
)

# A script that must not run once relayd has stopped waiting for it (the AEP append) is handed a
# deadline this much earlier than the client's timeout, in Redis's clock (L{Redis.deadline}): when
# Redis reaches it later (queued behind a slow command), it does nothing, so a write relayd
# answered "outcome unknown" for is not stored after all, and its retry is not a duplicate.
DEADLINE_MARGIN = 0.25  # of the timeout


# The refusals of a node that is not (or no longer, or not yet) a usable master: with Sentinel each
# also sends the follower to ask the sentinels where the master is now.
DEMOTED = frozenset({"READONLY", "LOADING", "MASTERDOWN", "NOREPLICAS"})

# How long an acknowledged write waits for its replicas (C{WAIT}), by default and at most: well
# within the client's L{DEFAULT_TIMEOUT}, which the write and the wait share.
DEFAULT_WAIT_TIMEOUT_MS = 500
MAX_WAIT_TIMEOUT_MS = 1000
WAITED = ("WAIT",)  # what a write its replicas did not confirm counts as in the refusal log

# The longest pause between reconnections with Sentinel (seconds): each asks the sentinels first,
# and a master is replaced within seconds, so the next one is tried soon after it is promoted.
SENTINEL_MAX_DELAY = 0.5


class ReplicasBehind(Exception):
    """C{WAIT} counted fewer replicas than L{Redis.wait_replicas} after an acknowledged write."""

    def __init__(self, replicas: int) -> None:
        super().__init__(f"{replicas} replicas")
        self.replicas = replicas


def refusal_code(message: str) -> str | None:
    """The refusal an error reply of Redis is (L{_REFUSAL}: C{OOM}, C{READONLY}...), or C{None}."""
    found = _REFUSAL.search(message)
    return found.group(1) if found else None


class KeyspaceMismatch(Exception):
    """Redis holds relayd keys this relayd cannot share; the message says what to do."""


class KeyspaceVersionError(KeyspaceMismatch):
    """Redis holds relayd keys of another keyspace version (L{KEYSPACE_VERSION})."""


def _bound_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # and whether the data nodes use TLS
DEFAULT_SENTINEL_PORT = 26379
SENTINEL_FORM = "redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/DB]"
SENTINEL_QUERY = ("sentinel_username", "sentinel_password")  # the sentinels' own credentials
# With rediss+sentinel:// the sentinels are asked over TLS too (the same CA, their host names checked),
# unless ?sentinel_tls=no: sentinels on plain TCP beside data nodes on TLS.
SENTINEL_TLS_QUERY = "sentinel_tls"
# The CA certificates (a PEM file) that Redis's TLS certificates must chain to, instead of the
# system's: a self-hosted Redis's private CA. Any TLS form of the URL takes it.
TLS_CA_QUERY = "tls_ca"
_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^:\[\]]+))(?::(?P<port>[^:]*))?$")


@dataclass(frozen=True)
class RedisURL:
    """A parsed C{redis://} / C{rediss://} URL, a C{redis+sentinel://} one (C{sentinels} and
    C{master} set; C{host} and C{port} are then the first sentinel's, never connected to as data),
    or a C{redis+cluster://} one (its seeds; C{host} and C{port} are the first of them)."""

    host: str
    port: int
    db: int
    username: str | None
    password: str | None
    tls: bool
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    seeds: tuple[tuple[str, int], ...] = ()  # a Redis Cluster's seed nodes (relayd/storage/cluster.py)
    tls_ca: str | None = None  # a PEM file of the CAs trusted for the data nodes' (and sentinels') certificates
    sentinel_tls: bool = False  # the sentinels are asked over TLS (rediss+sentinel://, unless ?sentinel_tls=no)

    @property
    def cluster(self) -> bool:
        return bool(self.seeds)

    def __str__(self) -> str:  # never shows a password
        if self.sentinels:
            scheme = "rediss+sentinel" if self.tls else "redis+sentinel"
            hosts = ",".join(_address(host, port) for host, port in self.sentinels)
            plain = "?sentinel_tls=no" if self.tls and not self.sentinel_tls else ""
            return f"{scheme}://{hosts}/{self.master}/{self.db}{plain}"
        scheme = "rediss" if self.tls else "redis"
        if self.seeds:
            return f"{scheme}+cluster://" + ",".join(_address(host, port) for host, port in self.seeds)
        return f"{scheme}://{self.host}:{self.port}/{self.db}"

    @property
    def secrets(self) -> tuple[str, ...]:
        """The passwords in the URL (the data nodes', the sentinels'): scrubbed from the logs."""
        return tuple(p for p in (self.password, self.sentinel_password) if p)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
CLUSTER_FORM = "redis+cluster://HOST:PORT[,HOST:PORT...]"


def parse_redis_url(text: str) -> RedisURL:
    """Parse C{redis://[user:password@]host[:port][/db]} (C{rediss://} for TLS), or
    C{redis+sentinel://[user:password@]HOST:PORT[,HOST:PORT...]/MASTER[/DB][?sentinel_password=...]}
    (C{rediss+sentinel://} for TLS to the sentinels and the data nodes, C{&sentinel_tls=no} for plain
    sentinels; the userinfo is the data nodes' credentials), or
    C{redis+cluster://[user:password@]host:port[,host:port...]} (a Redis Cluster's seed nodes; db 0)."""
    parts = urlsplit(text.strip())
    if parts.scheme in SENTINEL_SCHEMES:
        query = _query(parts.query, (*SENTINEL_QUERY, SENTINEL_TLS_QUERY, TLS_CA_QUERY))
        return _with_tls_ca(_parse_sentinel_url(parts.scheme, parts.netloc, parts.path, query), query)
    if parts.scheme in CLUSTER_SCHEMES:
        query = _query(parts.query, (TLS_CA_QUERY,))
        return _with_tls_ca(_parse_cluster_url(parts.scheme, parts.netloc, parts.path), query)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"must be a redis://, rediss://, {CLUSTER_FORM} or {SENTINEL_FORM} URL")
    query = _query(parts.query, (TLS_CA_QUERY,))
    if not parts.hostname:
        raise ValueError("must name a host")
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError("has an invalid port") from None
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ValueError("database must be a number (redis://host:port/0)")
    url = RedisURL(
        host=parts.hostname,
        port=port,
        db=int(path or 0),
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
        tls=parts.scheme == "rediss",
    )
    return _with_tls_ca(url, query)


def _query(text: str, known: tuple[str, ...]) -> dict[str, str]:
    """The URL's query parameters, each given once and each one this form of URL knows."""
    given = parse_qs(text, keep_blank_values=True)
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(f"has an unknown query parameter {unknown[0]!r} (known: {', '.join(known)})")
    if any(len(v) > 1 for v in given.values()):
        raise ValueError("gives a query parameter twice")
    return {name: values[0] for name, values in given.items()}


def _with_tls_ca(url: RedisURL, query: dict[str, str]) -> RedisURL:
    """C{url} trusting the CAs of C{?tls_ca=PATH}, checked now so that a bad file stops the start."""
    path = query.get(TLS_CA_QUERY)
    if path is None:
        return url
    if not url.tls:
        raise ValueError(f"{TLS_CA_QUERY} needs TLS: use rediss://, rediss+sentinel:// or rediss+cluster://")
    trust_root(path)
    return replace(url, tls_ca=path)


@cache
def trust_root(path: str) -> Any:
    """The CA certificates of the PEM file at C{path}, as a Twisted trust root (read once)."""
    from twisted.internet.ssl import Certificate, trustRootFromCertificates  # pyOpenSSL, only for TLS

    try:
        pem = open(path, "rb").read()
    except OSError as e:
        raise ValueError(f"{TLS_CA_QUERY}: cannot read {path!r} ({e.strerror})") from None
    blocks = [b"-----BEGIN CERTIFICATE-----" + block for block in pem.split(b"-----BEGIN CERTIFICATE-----")[1:]]
    try:
        certificates = [Certificate.loadPEM(block) for block in blocks]
    except Exception:
        certificates = []
    if not certificates or len(certificates) != len(blocks):
        raise ValueError(f"{TLS_CA_QUERY}: {path!r} is not a PEM file of CA certificates")
    return trustRootFromCertificates(certificates)


def _credentials(netloc: str) -> tuple[str | None, str | None, str]:
    """The user name, the password and the host list of a URL naming several hosts."""
    userinfo, _, hosts = netloc.rpartition("@")
    username, colon, password = userinfo.partition(":")
    return unquote(username) or None, unquote(password) if colon and password else None, hosts


def _addresses(hosts: str, default_port: int, what: str, form: str) -> list[tuple[str, int]]:
    """C{HOST[:PORT],...} (an IPv6 host in brackets) as (host, port) pairs: the sentinels, the seeds."""
    addresses = []
    for item in (entry.strip() for entry in hosts.split(",")):
        found = _HOST_PORT.match(item)
        if not item or found is None:
            raise ValueError(f"must name each {what} as HOST:PORT ({form}); got {item!r}")
        port_text = found.group("port")
        if port_text is not None and not (port_text.isdigit() and 0 < int(port_text) < 65536):
            raise ValueError(f"{what} {item!r} has an invalid port")
        addresses.append((found.group("v6") or found.group("host"), int(port_text) if port_text else default_port))
    return addresses


def _parse_sentinel_url(scheme: str, netloc: str, path: str, given: dict[str, str]) -> RedisURL:
    username, password, hosts = _credentials(netloc)
    sentinels = _addresses(hosts, DEFAULT_SENTINEL_PORT, "sentinel", SENTINEL_FORM)
    names = path.strip("/").split("/") if path.strip("/") else []
    if not names:
        raise ValueError(f"must name the master the sentinels monitor after the sentinels ({SENTINEL_FORM})")
    if len(names) > 2:
        raise ValueError(f"has more than a master and a database after the sentinels ({SENTINEL_FORM})")
    if len(names) == 2 and not names[1].isdigit():
        raise ValueError(f"database must be a number ({SENTINEL_FORM})")
    tls = SENTINEL_SCHEMES[scheme]
    sentinel_tls = given.get(SENTINEL_TLS_QUERY, "yes" if tls else None)
    if sentinel_tls is not None and not tls:
        raise ValueError(f"{SENTINEL_TLS_QUERY} needs TLS: use rediss+sentinel://")
    if sentinel_tls not in (None, "yes", "no"):
        raise ValueError(f"{SENTINEL_TLS_QUERY} must be yes or no; got {sentinel_tls!r}")
    return RedisURL(
        host=sentinels[0][0],
        port=sentinels[0][1],
        db=int(names[1]) if len(names) == 2 else 0,
        username=username,
        password=password,
        tls=tls,
        sentinels=tuple(sentinels),
        master=unquote(names[0]),
        sentinel_username=given.get("sentinel_username") or None,
        sentinel_password=given.get("sentinel_password") or None,
        sentinel_tls=sentinel_tls == "yes",
    )


def _parse_cluster_url(scheme: str, netloc: str, path: str) -> RedisURL:
    username, password, hosts = _credentials(netloc)
    seeds = _addresses(hosts, 6379, "seed node", CLUSTER_FORM)
    if path.strip("/") not in ("", "0"):
        raise ValueError(f"a Redis Cluster has database 0 only ({CLUSTER_FORM})")
    host, port = seeds[0]
    return RedisURL(host, port, 0, username, password, scheme == "rediss+cluster", seeds=tuple(seeds))


def redis_url(text: str) -> str:
    """Setting parser: validates and keeps the URL text."""
    parse_redis_url(text)
    return text.strip()


class _Handshake:
    """AUTH, SELECT and the keyspace version check on every (re)connect; when AUTH or SELECT fail,
    only this connection is dropped and retried. Another keyspace version refuses the whole client.

    txredisapi's own handshake would stop the whole pool from reconnecting instead
    (relayd/compat/txredisapi.py READY_STATE, which also says what happens without it).
    """

    _log = Logger()
    password: str | None
    username: str | None
    dbid: int | None
    # Why TLS closed the connection during the handshake (txredisapi reports only "Lost connection").
    _lost_because: str | None = None
    transport: Any
    factory: Any

    @defer.inlineCallbacks
    def connectionMade(self) -> Any:
        client: Redis | None = getattr(self.factory, "relayd_client", None)
        if client is not None:
            fence.time_replies_with(self, client.clock)
        try:
            if fence.READY_STATE:
                yield self._authenticate()
            else:
                yield super().connectionMade()  # type: ignore[misc]  # txredisapi's: a failure stops the pool
                if self.transport.disconnecting:
                    return
            follower: SentinelFollower | None = getattr(self.factory, "relayd_follower", None)
            if follower is not None:  # Sentinel: this goes to the master the sentinels name, which says it is one
                yield follower.check(self)
            yield self._check_keyspace()
        except KeyspaceMismatch as e:
            self.transport.loseConnection()
            self._refused(str(e))
            return
        except Exception as e:
            error = str(e) if self._lost_because is None else self._lost_because
            self._log.warn("Redis connection handshake failed ({error}); reconnecting", error=error)
            self.transport.loseConnection()
            return
        if fence.READY_STATE:
            fence.mark_ready(self)
        self._usable()

    def connectionLost(self, why: Failure) -> Any:
        self._lost_because = tls_failure(why)  # before txredisapi fails the handshake's commands
        return super().connectionLost(why)  # type: ignore[misc]

    def _usable(self) -> None:
        """The handshake passed: the connection carries commands from now on."""

    @defer.inlineCallbacks
    def _authenticate(self) -> Any:
        if self.password is not None:
            reply = yield self.auth(self.password, self.username)  # type: ignore[attr-defined]
            if isinstance(reply, Exception):
                raise reply
        if self.dbid:  # database 0 is where every connection starts
            reply = yield self.select(self.dbid)  # type: ignore[attr-defined]
            if isinstance(reply, Exception):
                raise reply

    def _check_keyspace(self) -> Any:
        """Before the connection is used: refuse a keyspace of another version (a pool connection's job)."""
        return None

    def _refused(self, message: str) -> None:
        pass


class _Protocol(_Handshake, OneDeferredCommands, OnePassCommands, WholeReads, txredisapi.RedisProtocol):
    _counted: Redis | None = None  # the client this connection counts as usable for

    def send_command(self, data: bytes) -> None:
        # At once on an idle plain TCP connection: one send, where transport.write watches the socket,
        # sends on the reactor's next turn and unwatches it (two epoll calls and a turn more per
        # command; relayd/compat/tcp.py). Else queued behind what waits, as txredisapi queues it.
        write_now(self.transport, data)

    @defer.inlineCallbacks
    def _check_keyspace(self) -> Any:
        client: Redis | None = getattr(self.factory, "relayd_client", None)
        if client is None:
            return
        key, mine = client.version_key, str(KEYSPACE_VERSION).encode()
        try:
            found = (yield self.execute_command("GET", key)) if client.checks_keyspace else mine
            if found is None:  # a new keyspace (or one emptied): this relayd's version, unless another was first
                prefix = key[: -len(VERSION_KEY)]
                # One EXISTS per marker: on a Redis Cluster they live in different slots.
                earlier = 0
                for marker in UNVERSIONED_MARKERS:
                    earlier += int((yield self.execute_command("EXISTS", prefix + marker.encode())))
                if earlier:
                    raise KeyspaceVersionError(client.mismatch("keys of an earlier relayd without a keyspace version"))
                yield self.execute_command("SET", key, mine, "NX")
                found = yield self.execute_command("GET", key)
            # Redis's clock against this process's (for L{Redis.deadline}), and whether it reads a
            # script's flags (relayd/storage/redis_lua.py): both in the same handshake.
            before = client.clock.monotonic()
            seconds, micros = yield self.execute_command("TIME")
            client._redis_clock_offset = int(seconds) + int(micros) / 1e6 - (before + client.clock.monotonic()) / 2
            info = yield self.execute_command("INFO", "server")
            version = re.search(rb"redis_version:(\d+)", info)
            client.script_flags = version is not None and int(version.group(1)) >= 7
        except txredisapi.ResponseError as e:
            if str(e).startswith("WRONGTYPE"):
                raise KeyspaceVersionError(
                    client.mismatch(f"a {key.decode(errors='replace')} key that is not a version")
                ) from None
            raise  # a transient refusal (LOADING, READONLY...): retried like a failed SELECT
        if found != mine:
            raise KeyspaceVersionError(client.mismatch(f"relayd keyspace version {found.decode(errors='replace')}"))
        bounds = dict(client.bounds)
        if bounds:
            # The first instance's values stay (HSETNX); every later one must have the same.
            for name, value in bounds.items():
                yield self.execute_command("HSETNX", client.bounds_key, name, value)
            held = yield self.execute_command("HMGET", client.bounds_key, *bounds)
            differ = [(name, mine, there) for (name, mine), there in zip(bounds.items(), held, strict=True) if there != mine]
            if differ:
                raise KeyspaceMismatch(client.bounds_mismatch(differ))

    def _refused(self, message: str) -> None:
        client: Redis | None = getattr(self.factory, "relayd_client", None)
        if client is not None:
            client._refuse(message)

    def _usable(self) -> None:
        client: Redis | None = getattr(self.factory, "relayd_client", None)
        if client is not None:
            self._counted = client
            client._pool_connection(+1)

    def connectionLost(self, why: Failure) -> None:
        client = self._counted
        if client is not None:
            self._counted = None
            client._pool_connection(-1)
        super().connectionLost(why)


class _Subscriber(_Handshake, Heartbeat, WholeReads, txredisapi.SubscriberProtocol):
    bus: RedisBus

    def connectionMade(self) -> Any:
        d = super().connectionMade()
        # Wait for AUTH/SELECT, then (re)subscribe: a reconnect must not lose the bus.
        self.whenConnected().addCallback(self._handshaken)
        return d

    def _handshaken(self, _: Any) -> None:
        self.bus._subscribed(self)
        self.start_heartbeat(self.bus.redis.clock, self.bus.redis.timeout)

    def messageReceived(self, pattern: Any, channel: bytes, message: bytes) -> None:
        self.bus._message(channel, message)

    def unanswered(self, timeout: float) -> None:
        super().unanswered(timeout)
        self.bus.redis.subscriber_silent(self)

    def connectionLost(self, why: Failure) -> None:
        self.stop_heartbeat()
        self.bus._lost(self)
        super().connectionLost(why)


class Redis:
    """The process's Redis client: the tap makes one with C{--redis} (relayd.wing.Plumbing), every
    wing shares it, and the root service closes it once the wings are drained."""

    _log = Logger()

    # Whether each pool connection checks the keyspace version and bounds (a Redis Cluster's node
    # clients do not: relayd/storage/cluster.py checks them once, routed by slot).
    checks_keyspace = True
    what = "Redis"  # in the log lines about its connections
    # Whether the AEP fan-out uses shard channels (a Redis Cluster's: relayd/storage/cluster.py);
    # a single primary and Sentinel keep one classic channel, which works on every Redis version.
    sharded_pubsub = False

    def __init__(
        self,
        url: str | RedisURL,
        clock: Timekeeper,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        poolsize: int = 4,
        prefix: str = "relayd:",
        wait_replicas: int | None = None,
        wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS,
    ) -> None:
        self.url = url if isinstance(url, RedisURL) else parse_redis_url(url)
        if self.url.cluster:
            raise ValueError("a redis+cluster:// URL is a Redis Cluster's (relayd.storage.cluster.redis_client)")
        self.clock = clock
        self.timeout = timeout
        # An acknowledged write (L{execute} with C{durable}) waits for this many replicas (C{WAIT}):
        # by default one with Sentinel, none with a single primary.
        self.wait_replicas = (1 if self.url.sentinels else 0) if wait_replicas is None else wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        # With Sentinel, where the master is (relayd/storage/sentinel.py); every connection asks it.
        self.follower: SentinelFollower | None = None
        if self.url.sentinels:
            assert self.url.master is not None
            self.follower = SentinelFollower(
                self.url.sentinels, self.url.master, clock, timeout=timeout,
                username=self.url.sentinel_username, password=self.url.sentinel_password,
                endpoint=partial(_endpoint, self.url, timeout=timeout, clock=clock, tls=self.url.sentinel_tls),
            )  # fmt: skip
            self.follower.on_switch(self._switched)
            self.follower.start()
        self.version_key = (prefix + VERSION_KEY).encode()
        self.bounds_key = (prefix + BOUNDS_KEY).encode()
        self.bounds: dict[bytes, bytes] = {}  # L{hold_bounds}
        # Set (with the reason) once Redis was found to hold another keyspace version: the client
        # then stops reconnecting and refuses every call; C{refused} fires with the reason.
        self.refusal: str | None = None
        self.refused: Deferred[str] = Deferred()
        self._buses: list[RedisBus] = []
        # Redis's clock minus the monotonic clock here, in seconds (measured at each handshake),
        # and whether Redis reads a script's shebang flags (7 and later).
        self._redis_clock_offset = 0.0
        self.script_flags = False
        # The commands Redis refuses now (L{_REFUSAL}), by what they run: logged once when the
        # first is refused and once when the last of them is run again, not once per request.
        self._refused_commands: set[Any] = set()
        self._usable_connections = 0
        self._closing = False
        # The pool as txredisapi.lazyConnectionPool makes it, from its public parts, so that relayd
        # holds the factory it configures (lazyConnectionPool keeps it private).
        factory = txredisapi.RedisFactory(
            f"{self.url.host}:{self.url.port}",
            self.url.db,
            poolsize,
            isLazy=True,
            charset=None,  # bytes in, bytes out: payloads are forwarded as they are
            password=self.url.password,
            username=self.url.username,
            replyTimeout=timeout,
            convertNumbers=False,
        )
        factory.reconnect = True
        factory.protocol = _Protocol
        factory.relayd_client = self  # the keyspace check reports here
        factory.relayd_follower = self.follower  # and, with Sentinel, the role check asks here
        # Reconnect quickly: while Redis is away every request that needs it is refused.
        factory.initialDelay = 0.2
        # With Sentinel a lost master is soon replaced: its successor is found by reconnecting.
        factory.maxDelay = 2 if self.follower is None else SENTINEL_MAX_DELAY
        factory.startConnecting(self.endpoint())
        self._factory = factory
        self._pool = factory.handler

    @property
    def connected(self) -> bool:
        return bool(self._factory.size) and self.refusal is None

    def endpoint(self) -> IStreamClientEndpoint:
        """Where a connection goes: the URL's host, or with Sentinel the master the sentinels name then."""
        if self.follower is None:
            return _endpoint(self.url, self.url.host, self.url.port, self.timeout, self.clock)
        return self.follower.endpoint(lambda host, port: _endpoint(self.url, host, port, self.timeout, self.clock))

    def subscriber_silent(self, connection: Any) -> None:
        """A bus's PING went unanswered on C{connection}, which is dropped: a single primary (or the
        master the sentinels name) is the one place to reconnect to (a Redis Cluster has others)."""

    def drop_pool(self) -> None:
        """Abort every pool connection (a node that hangs: each reconnects, and is usable again only
        once its handshake is answered)."""
        for conn in list(self._factory.pool):
            conn.transport.abortConnection()

    def _switched(self, address: tuple[str, int]) -> None:
        """Sentinel moved the master: drop every connection to another address (they reconnect there)."""
        assert self.follower is not None
        for conn in [*self._factory.pool, *(bus.connection for bus in self._buses)]:
            if conn is not None and self.follower.address_of(conn) != address:
                conn.transport.loseConnection()

    def _pool_connection(self, change: int) -> None:
        """A pool connection became usable (+1) or was lost (-1): say when the first is up and when
        the last is gone, so an operator (and a test) sees when relayd can reach Redis."""
        before, self._usable_connections = self._usable_connections, self._usable_connections + change
        if before == 0 and change > 0:
            self._log.info("connected to {what} at {url} (keyspace version {version})", what=self.what,
                           url=str(self.url), version=KEYSPACE_VERSION)  # fmt: skip
        elif self._usable_connections == 0 and change < 0 and not self._closing:
            self._log.warn("lost every connection to {what} at {url}; reconnecting", what=self.what, url=str(self.url))

    def mismatch(self, found: str) -> str:
        """The refusal for a Redis that holds C{found} where this relayd keeps its keyspace version."""
        prefix = self.version_key[: -len(VERSION_KEY)].decode(errors="replace")
        return (
            f"Redis at {self.url} holds {found} (key {self.version_key.decode(errors='replace')}), this relayd "
            f"uses keyspace version {KEYSPACE_VERSION}: relayd versions that lay out their keys differently cannot "
            f"share them. Stop the relayd processes of the other version and delete the keys under {prefix!r} "
            "(FLUSHDB if that database holds nothing else), or give this relayd another Redis database "
            "(redis://host:port/N) or --redis-prefix; see docs/deployment.md \"Upgrades\""
        )

    def hold_bounds(self, bounds: dict[str, float]) -> None:
        """Keep keys by these deployment-wide bounds (by flag name, C{{"aep-buffer": 10000}}): each
        connection checks that the keyspace is kept by the same values, and a relayd with other
        values is refused (L{refused}; the process stops). A wing declares them as it is made."""
        self.bounds.update({name.encode(): _bound_text(value).encode() for name, value in bounds.items()})

    def bounds_mismatch(self, differ: list[tuple[bytes, bytes, bytes | None]]) -> str:
        """The refusal for bounds other than those the keyspace is kept by: C{(name, mine, held)}."""
        key = self.bounds_key.decode(errors="replace")
        values = "; ".join(
            f"--{name.decode()} is {mine.decode()} here and {(held or b'?').decode(errors='replace')} on Redis"
            for name, mine, held in differ
        )
        given = " ".join(f"--{name.decode()} {(held or b'?').decode(errors='replace')}" for name, _, held in differ)
        return (
            f"{values} (key {key} at {self.url}): every relayd sharing these keys must use the same bounds, or "
            f"each would trim the others' data by its own. Start this relayd with {given}; to change a bound, "
            f"stop every relayd using this prefix, delete the key {key}, and start them with the new value "
            "(docs/deployment.md \"Deployment-wide bounds\")"
        )

    def _refuse(self, message: str) -> None:
        if self.refusal is not None:
            return
        self.refusal = message
        self._log.critical("{reason}", reason=message)
        self._factory.stopTrying()
        for conn in list(self._factory.pool):  # connections checked before another version took over
            conn.transport.loseConnection()
        self.refused.callback(message)

    def execute(self, store: str, *command: Any, durable: bool = False) -> Deferred[Any]:
        """Run one command. It fails with L{StoreUnavailable} (naming C{store}) when Redis is away
        (nothing was sent) or refuses it (L{StoreRefused}), and with L{OutcomeUnknown} when it was
        sent and no answer came within the timeout (or the connection went first).

        C{durable}: a write the caller acknowledges (an AEP 202, an MCP ok, a broker verdict). With
        L{wait_replicas}, C{WAIT} follows it on the same connection and a write fewer replicas
        confirmed is L{OutcomeUnknown} (on the primary only, it may be lost in a failover: 503, and
        the client retries); with Sentinel it is refused while a failover is under way."""
        what = _what(command)
        if durable and self.follower is not None and self.follower.failing_over:
            return defer.fail(StoreUnavailable(store, "Sentinel is failing the Redis master over"))
        # A connection the pool holds ready is written to at once; else the pool hands one out when
        # it has one (a Deferred, and a generator's steps, per command: relayd/compat/txredisapi.py).
        connection = fence.idle_connection(self._factory)
        if not (durable and self.wait_replicas):
            if connection is not None:
                # (its reply timer is relayd's timeout, when it is one: then no second one)
                timed = not fence.reply_timer_first(connection, self.clock, self.timeout)
                return self._guard(store, what, partial(connection.execute_command, *command), timed=timed)
            return self._guard(store, what, lambda: self._pool.execute_command(*command))
        if connection is not None:
            return self._guard(store, what, partial(self._confirmed, connection, command), waits=True)
        return self._guard(
            store, what, lambda: self._factory.getConnection(peek=True).addCallback(self._confirmed, command), waits=True
        )

    def _confirmed(self, conn: Any, command: tuple[Any, ...]) -> Deferred[Any]:
        """C{command}, then C{WAIT} on the same connection (pipelined: one round trip)."""
        written = conn.execute_command(*command)
        waited = conn.execute_command(b"WAIT", self.wait_replicas, self.wait_timeout_ms)

        def counted(replicas: Any, result: Any) -> Any:
            if int(replicas) < self.wait_replicas:
                raise ReplicasBehind(int(replicas))
            return result

        def failed(f: Failure) -> Failure:
            waited.addErrback(lambda _: None)
            return f

        return written.addCallbacks(lambda result: waited.addCallback(counted, result), failed)

    def execute_many(
        self, store: str, commands: Sequence[tuple[Any, ...]], durable: bool = False
    ) -> list[Deferred[Any]]:
        """Run several commands at once, one L{execute} each (its failures and C{durable}), all on
        one pool connection: written together (one send), Redis reads them in one go and its replies
        come back in one, matched in order. (Each on its own would go to a connection picked at
        random: as many sends and reads as connections touched, on both ends.) With C{durable} and
        L{wait_replicas}, one C{WAIT} after the last confirms them all."""
        connections: list[Any] = []
        if self.connected and not (durable and self.follower is not None and self.follower.failing_over):
            idle = fence.idle_connection(self._factory)
            if idle is not None:
                connections.append(idle)
            else:  # (it fires at once when a connection is up; else each command fails or waits as alone)
                self._factory.getConnection(peek=True).addCallbacks(connections.append, lambda _: None)
        if not connections or len(commands) < 2:
            return [self.execute(store, *command, durable=durable) for command in commands]
        conn = connections[0]
        if durable and self.wait_replicas:
            return self._confirmed_many(store, conn, commands)
        timed = not fence.reply_timer_first(conn, self.clock, self.timeout)
        return [
            self._guard(store, _what(command), partial(conn.execute_command, *command), timed=timed)
            for command in commands
        ]

    def _confirmed_many(self, store: str, conn: Any, commands: Sequence[tuple[Any, ...]]) -> list[Deferred[Any]]:
        """C{commands}, then one C{WAIT} on the same connection: each command's answer once its
        own reply came and the C{WAIT} counted enough replicas (it counts every write before it)."""
        try:
            written = [conn.execute_command(*command) for command in commands]
            waited = _Shared(conn.execute_command(b"WAIT", self.wait_replicas, self.wait_timeout_ms))
        except Exception as e:  # txredisapi raises at once on a connection that just died: nothing sent
            return [defer.fail(StoreUnavailable(store, str(e))) for _ in commands]

        def counted(replicas: Any, result: Any) -> Any:
            if int(replicas) < self.wait_replicas:
                raise ReplicasBehind(int(replicas))
            return result

        def confirmed(d: Deferred[Any]) -> Deferred[Any]:
            return d.addCallback(lambda result: waited.get().addCallback(counted, result))

        return [
            self._guard(store, _what(command), partial(confirmed, d), waits=True)
            for command, d in zip(commands, written, strict=True)
        ]

    def get_many(self, store: str, keys: list[bytes]) -> Deferred[list[Any]]:
        """The values of several keys, in order (C{None} for a missing one): one C{MGET} on a single
        primary; a Redis Cluster client reads them slot by slot."""
        return self.execute(store, "MGET", *keys)

    def deadline(self) -> int:
        """When a script sent now must no longer run, in microseconds of Redis's clock (C{TIME}):
        a little before this client stops waiting for its answer (L{DEADLINE_MARGIN})."""
        seconds = self.clock.monotonic() + self._redis_clock_offset + self.timeout * (1 - DEADLINE_MARGIN)
        return int(seconds * 1e6)

    def _guard(
        self, store: str, what: Any, call: Callable[[], Deferred[Any]], waits: bool = False, timed: bool = True
    ) -> Deferred[Any]:
        """C{call()}'s answer as L{execute} gives it, timed out after L{timeout} unless C{timed} is
        false (a command whose reply timer is that timeout: L{fence.reply_timer_first})."""
        if self.refusal is not None:
            return defer.fail(StoreUnavailable(store, "another relayd keyspace version"))
        if not self.connected:
            return defer.fail(StoreUnavailable(store, "not connected"))
        try:
            d = call()
        except Exception as e:  # txredisapi raises synchronously on a connection that just died
            return defer.fail(StoreUnavailable(store, str(e)))
        if timed:
            self.clock.timeout(d, self.timeout)

        def answered(result: Any) -> Any:
            if self._refused_commands and (what in self._refused_commands or (waits and WAITED in self._refused_commands)):
                self._refused_commands.discard(what)
                if waits:  # replicas confirmed a write again
                    self._refused_commands.discard(WAITED)
                if not self._refused_commands:
                    self._log.info("Redis at {url} runs the commands it refused again", url=str(self.url))
            return result

        def translate(f: Failure) -> Failure:
            if isinstance(f.value, ReplicasBehind):
                message = (
                    f"written on the primary but confirmed by {f.value.replicas} of {self.wait_replicas} "
                    f"replicas within {self.wait_timeout_ms} ms (--redis-wait-replicas); it may be lost in a failover"
                )
                self._refused(WAITED, message)
                if self.follower is not None:  # a master its replicas left (demoted, or cut off)?
                    self.follower.recheck()
                raise OutcomeUnknown(store, message)
            if f.check(txredisapi.ResponseError):
                message = str(f.value)
                code = refusal_code(message)
                if code is None:
                    return f  # a real answer from Redis (a bug, not an outage)
                if code != "NOSCRIPT":
                    self._refused(what, message)
                if code in DEMOTED and self.follower is not None:
                    self.follower.recheck()  # a master demoted or not yet promoted: ask where it is now
                raise StoreRefused(store, code, message)
            # The command was sent (or queued for a connection): Redis may have run it, or run it still.
            reason = f.getErrorMessage() or getattr(f.type, "__name__", "error")
            raise OutcomeUnknown(store, f"no answer from Redis ({reason}); the command may have run")

        return d.addCallbacks(answered, translate)

    def _refused(self, what: Any, message: str) -> None:
        if not self._refused_commands:
            self._log.warn(
                "Redis at {url} refuses commands: {error}; answering 503 store-unavailable until it runs them again",
                url=str(self.url),
                error=message,
            )
        self._refused_commands.add(what)

    def bus(self) -> RedisBus:
        """A pub/sub subscriber on its own connection."""
        return RedisBus(self)

    def close(self) -> Deferred[Any]:
        """Close the pool and every bus made from this client."""
        self._closing = True
        ds = [bus.close() for bus in list(self._buses)] + [self._pool.disconnect()]
        if self.follower is not None:
            ds.append(self.follower.stop())
        self._buses = []
        return defer.gatherResults(ds, consumeErrors=True)


def _what(command: tuple[Any, ...]) -> Any:
    """What a command runs, for the refusal log: a script by its SHA-1 or text, else its name."""
    return command[1] if command[0] in (b"EVALSHA", b"EVAL") else command[0]


class _Shared:
    """One Deferred's result for several waiters (each L{get} is a new Deferred that fires with
    it, or has it already)."""

    def __init__(self, d: Deferred[Any]) -> None:
        self._waiters: list[Deferred[Any]] = []
        self._result: Any = None
        self._done = False
        d.addBoth(self._fire)

    def _fire(self, result: Any) -> None:  # (a failure is kept for the waiters, not left unhandled)
        self._done, self._result = True, result
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if isinstance(result, Failure):
                waiter.errback(result)
            else:
                waiter.callback(result)

    def get(self) -> Deferred[Any]:
        if self._done:
            return defer.fail(self._result) if isinstance(self._result, Failure) else defer.succeed(self._result)
        waiter: Deferred[Any] = Deferred()
        self._waiters.append(waiter)
        return waiter


class RedisBus:
    """Pub/sub on a dedicated connection that resubscribes after every reconnect."""

    _log = Logger()

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._handlers: dict[bytes, Callable[[bytes], None]] = {}
        self._protocol: _Subscriber | None = None
        # The channels Redis answered the SUBSCRIBE of on this connection (L{heard}); and each
        # channel's latest SUBSCRIBE (a number from L{_asks}): only the answer to it counts.
        self._heard = HeardChannels(redis.clock)
        self._asked: dict[bytes, int] = {}
        self._asks = itertools.count()
        factory = txredisapi.SubscriberFactory(isLazy=True)
        factory.charset = None  # channels and messages stay bytes
        factory.convertNumbers = False  # and are never numbers (it tried to parse every message as one)
        factory.continueTrying = True
        bus = self

        class Subscriber(_Subscriber):
            pass

        Subscriber.bus = bus
        factory.protocol = Subscriber
        factory.relayd_follower = redis.follower
        factory.password = redis.url.password
        factory.username = redis.url.username
        factory.initialDelay = 0.2
        factory.maxDelay = 2 if redis.follower is None else SENTINEL_MAX_DELAY
        # The handshake's AUTH and SELECT (and UNSUBSCRIBE) time out as the pool's commands do: a
        # reconnection to a node that hangs is dropped there, before L{Heartbeat} takes over.
        factory.replyTimeout = redis.timeout
        self._factory = factory
        # Every bus of the client, made by L{Redis.bus} or not (the MCP bus makes its own): the client
        # moves it when its node changes (a Sentinel switch, a Redis Cluster node back) and closes it.
        redis._buses.append(self)
        factory.startConnecting(redis.endpoint())
        self.ready: Deferred[None] = Deferred()

    def subscribe(self, channel: bytes, handler: Callable[[bytes], None]) -> None:
        """Call C{handler(message)} for every message published on C{channel} once Redis has
        answered its SUBSCRIBE (L{heard})."""
        self._handlers[channel] = handler
        if self._protocol is not None:
            self._ask(self._protocol, channel).addErrback(self._subscribe_failed)

    def unsubscribe(self, channel: bytes) -> None:
        """Hear C{channel} no more."""
        if self._handlers.pop(channel, None) is None:
            return
        self._asked.pop(channel, None)
        self._heard.forget(channel)
        if self._protocol is not None:
            # (A connection lost meanwhile took the subscription with it.)
            self._protocol.unsubscribe([channel]).addErrback(lambda _: None)

    def heard(self, channels: set[bytes]) -> Deferred[None] | None:
        """C{None} when Redis has answered the SUBSCRIBE of every one of C{channels} on this
        connection, else a C{Deferred} that fires once it has (at most a second: L{HeardChannels})."""
        return self._heard.wait(channels)

    def publish(self, store: str, channel: bytes, message: bytes) -> Deferred[Any]:
        return self.redis.execute(store, "PUBLISH", channel, message)

    def _ask(self, protocol: _Subscriber, channel: bytes) -> Deferred[Any]:
        """C{SUBSCRIBE} of one channel: its one answer is matched to it (one of several channels'
        would answer once per channel, and txredisapi hands only the first to the caller)."""
        asked = self._asked[channel] = next(self._asks)

        def answered(_: Any) -> None:
            if self._protocol is protocol and self._asked.get(channel) == asked:
                self._heard.confirm(channel)

        return protocol.subscribe([channel]).addCallback(answered)

    def _subscribed(self, protocol: _Subscriber) -> None:
        self._protocol = protocol
        asked = [self._ask(protocol, channel) for channel in list(self._handlers)]
        d = defer.gatherResults(asked, consumeErrors=True).addErrback(first_error) if asked else defer.succeed(None)

        def up(_: Any) -> None:
            if not self.ready.called:
                self.ready.callback(None)

        d.addCallback(up)
        d.addErrback(self._subscribe_failed)

    def _subscribe_failed(self, f: Failure) -> None:
        if f.check(txredisapi.ConnectionError):
            # The connection went while subscribing (Redis restarting, or this process stopping):
            # the next connection subscribes again; nothing to report beyond one line.
            self._log.info("Redis subscribe interrupted ({error}); resubscribing on reconnect", error=f.getErrorMessage())
            return
        self._log.failure("Redis subscribe failed", f)

    def _lost(self, protocol: _Subscriber) -> None:
        if self._protocol is protocol:
            self._protocol = None
            self._heard.confirmed.clear()

    def _message(self, channel: bytes, message: bytes) -> None:
        handler = self._handlers.get(channel)
        if handler is None:
            return
        try:
            handler(message)
        except Exception:
            self._log.failure("Redis bus handler failed for {channel}", channel=channel)

    @property
    def connected(self) -> bool:
        return self._protocol is not None

    @property
    def connection(self) -> _Subscriber | None:
        """The subscribed connection, or C{None} while there is none."""
        return self._protocol

    def close(self) -> Deferred[Any]:
        if self in self.redis._buses:
            self.redis._buses.remove(self)
        self._factory.stopTrying()
        return self._factory.disconnect()


def _endpoint(
    url: RedisURL, host: str, port: int, timeout: float, clock: Timekeeper, tls: bool | None = None
) -> IStreamClientEndpoint:
    """A connection to C{host}: by name (IPv4 or IPv6), through verified TLS (certificate chain and
    hostname, via service_identity) for C{rediss://}, C{rediss+sentinel://} and C{rediss+cluster://},
    the chain to the system's CAs or to those of C{?tls_ca=PATH}. C{tls}: whether this connection
    uses TLS, if not as the URL's data nodes do (a sentinel's: L{RedisURL.sentinel_tls})."""
    endpoint = HostnameEndpoint(clock.reactor, host, port, timeout=timeout)
    if not (url.tls if tls is None else tls):
        return endpoint
    from twisted.internet.ssl import optionsForClientTLS  # pyOpenSSL, only for rediss://

    trusted = None if url.tls_ca is None else trust_root(url.tls_ca)
    return wrapClientTLS(optionsForClientTLS(host, trustRoot=trusted), endpoint)
