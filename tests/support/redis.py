"""A real redis-server on a free loopback port, started by the test (skip locally without one)."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twisted.internet import threads
from twisted.internet.defer import Deferred

from tests.support.skips import missing

CI = os.environ.get("CI") == "true"


def require_redis_server() -> str:
    """The redis-server binary; skips the test locally without it, fails under CI=true."""
    binary = shutil.which("redis-server")
    if binary is None:
        missing("redis-server is not installed (apt-get install redis-server; CI: .ci/install-redis.sh)")
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """C{RedisServer.start()}; C{.url}; C{.stop()}; C{.restart()} keeps the data (AOF off, RDB on stop)."""

    def __init__(self, options: tuple[str, ...] = (), port: int | None = None) -> None:
        self.binary = require_redis_server()
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="relayd-redis-")
        self.options = options
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, *options: str, port: int | None = None) -> RedisServer:
        """A server started with the default options and C{options}."""
        server = cls(options, port)
        server._spawn()
        return server

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
             "--save", "", "--appendonly", "no", "--dbfilename", "dump.rdb", *self.options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    if "--requirepass" in self.options:  # (its +OK is read with the INFO below)
                        password = self.options[self.options.index("--requirepass") + 1]
                        s.sendall(b"AUTH %s\r\n" % password.encode())
                    s.sendall(b"INFO server\r\n")
                    info = b""
                    while b"process_id:" not in info or not info.endswith(b"\r\n"):
                        chunk = s.recv(65536)
                        if not chunk:
                            break
                        info += chunk
                    # The server that answers must be ours: another test run may have taken the
                    # port while this one was restarting.
                    if f"process_id:{self.proc.pid}\r\n".encode() in info:
                        return
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"redis-server could not start on port {self.port}")
            except OSError:
                pass
            time.sleep(0.02)  # waiting for an external process to accept connections
        raise RuntimeError("redis-server did not start")

    def stop(self, save: bool = True) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if save:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                    s.sendall(b"SHUTDOWN SAVE\r\n")
                    s.recv(16)
            else:
                self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> None:
        self.stop(save=True)
        self._spawn()

    def pause(self, case: Any) -> None:
        """Redis stops (C{SIGSTOP}); this returns once the kernel says it has. It still accepts
        connections, and what clients send waits in their sockets, unread and unanswered, until
        L{resume} (or C{case}'s cleanup). (C{DEBUG SLEEP} did this with a race: on a busy machine
        Redis could read a command sent after it first.)"""
        assert self.proc is not None
        pid = self.proc.pid
        os.kill(pid, signal.SIGSTOP)
        case.addCleanup(lambda: self.proc is not None and os.kill(pid, signal.SIGCONT))
        deadline = time.monotonic() + 10
        while _state(pid) != "T":  # (the stop is asynchronous: an external process's state)
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not stop")
            time.sleep(0.001)

    def resume(self) -> Deferred[Any]:
        """Redis runs again. Fires once it answered a C{PING} on a new connection: the commands
        it held (readable before that connection was accepted) have run by then."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)
        return threads.deferToThread(command, self.port, "PING", timeout=10)

    def cleanup(self) -> None:
        self.stop(save=False)
        shutil.rmtree(self.dir, ignore_errors=True)


def _state(pid: int) -> str:
    """A process's state letter (C{T}: stopped), from C{/proc/PID/stat}."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def require_redis_cli() -> str:
    """The redis-cli binary (it creates clusters); skips locally without it, fails under CI=true."""
    binary = shutil.which("redis-cli")
    if binary is None:
        missing("redis-cli is not installed (apt-get install redis-tools; CI: .ci/install-redis.sh)")
    return binary


def cluster_port() -> int:
    """A free port whose cluster bus port (10000 more) is free too."""
    while True:
        port = free_port()
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port


class RedisCluster:
    """A Redis Cluster of C{masters} real redis-servers on loopback, each with C{replicas} replicas
    (none by default), its slots split evenly by C{redis-cli --cluster create}: C{RedisCluster.start()};
    C{.url} (C{redis+cluster://}, every node a seed); C{.nodes} (the masters first); C{.cleanup()}
    kills every node by its PID. relayd WAITs for a replica by default on a cluster: a client of a
    cluster without replicas that makes acknowledged writes needs C{--redis-wait-replicas 0}."""

    NODE_TIMEOUT = 2.0  # seconds (cluster-node-timeout): a master is failed over this long after it dies

    def __init__(self, masters: int = 3, replicas: int = 0) -> None:
        self.cli = require_redis_cli()
        self.nodes: list[RedisServer] = []
        self.masters = masters
        self.replicas = replicas

    @classmethod
    def start(cls, masters: int = 3, replicas: int = 0) -> RedisCluster:
        """C{masters} masters (the first nodes), each with C{replicas} replicas (the nodes after)."""
        cluster = cls(masters, replicas)
        try:
            for _ in range(masters * (1 + replicas)):
                cluster.nodes.append(
                    RedisServer.start("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                      "--cluster-node-timeout", str(int(cls.NODE_TIMEOUT * 1000)),
                                      port=cluster_port())
                )  # fmt: skip
            addresses = [f"127.0.0.1:{node.port}" for node in cluster.nodes]
            subprocess.run(
                [cluster.cli, "--cluster", "create", *addresses, "--cluster-replicas", str(replicas), "--cluster-yes"],
                check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30,
            )  # fmt: skip
            cluster.wait_ok()
        except BaseException:
            cluster.cleanup()
            raise
        return cluster

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)

    def command(self, node: RedisServer, *args: str) -> str:
        """C{redis-cli -p <node> args...}'s output (a test's look at one node)."""
        done = subprocess.run([self.cli, "-p", str(node.port), *args], capture_output=True, timeout=30, check=True)
        return done.stdout.decode()

    def wait_ok(self, timeout: float = 20) -> None:
        """Until every node says cluster_state:ok and agrees on the slots, and every master has its
        replicas in sync (an acknowledged write WAITs for one) (an external process)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in self.command(node, "CLUSTER", "INFO") for node in self.nodes) and all(
                self._replicated(node) for node in self.nodes
            ):
                return
            time.sleep(0.05)  # waiting for redis-server's cluster bus to converge
        raise RuntimeError("the Redis Cluster did not come up")

    def _replicated(self, node: RedisServer) -> bool:
        info = self.command(node, "INFO", "replication")
        if "role:slave" in info:
            return "master_link_status:up" in info
        return f"connected_slaves:{self.replicas}" in info

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()


_shared_cluster: RedisCluster | None = None


def shared_cluster() -> RedisCluster:
    """One 3-master Redis Cluster for the whole test run (tests isolate themselves by key prefix),
    each master with a replica: relayd's acknowledged writes WAIT for one by default on a cluster
    (6 nodes take no longer to create than 3, about 2 s)."""
    global _shared_cluster
    if _shared_cluster is None or any(n.proc is None or n.proc.poll() is not None for n in _shared_cluster.nodes):
        _shared_cluster = RedisCluster.start(3, replicas=1)
        import atexit

        atexit.register(_shared_cluster.cleanup)
    return _shared_cluster


_shared: RedisServer | None = None
_prefixes = itertools.count()


def shared_redis() -> RedisServer:
    """One redis-server for the whole test run (tests isolate themselves by key prefix)."""
    global _shared
    if _shared is None or _shared.proc is None or _shared.proc.poll() is not None:
        _shared = RedisServer.start()
        import atexit

        atexit.register(_shared.cleanup)
    return _shared


class OnCluster:
    """Mixin for a test case of several relayd instances on Redis: run it on the run's shared
    3-master Redis Cluster (L{shared_cluster}) instead of a single redis-server. The case asks
    L{layout_url} for its Redis and isolates itself by key prefix."""

    redis_layout = "cluster"


def layout_url(case: Any) -> str:
    """The URL of the Redis a test case's relays share: the one the case started for itself
    (C{case.own_redis_url}, a L{SentinelGroup}'s, set before its relays start), the shared Redis
    Cluster for an L{OnCluster} case, else the shared redis-server."""
    own = getattr(case, "own_redis_url", None)
    if own is not None:
        return str(own)
    if getattr(case, "redis_layout", "standalone") == "cluster":
        return shared_cluster().url
    return shared_redis().url


def redis_flags(url: str | None = None, prefix: str | None = None) -> dict[str, str]:
    """The flags of a wing on Redis (the shared server unless C{url}); a fresh key prefix isolates
    each test (or each of a test's instances, given the same C{prefix})."""
    return {"redis": url or shared_redis().url, "redis-prefix": prefix or f"t{os.getpid()}-{next(_prefixes)}:"}


def session_key(prefix: str, wing: str, kind: str, session: str) -> bytes:
    """A session's key as keyspace 4 names it (C{session_key("p:", "aep", "s", "S")}: C{p:aep:{b}:s:S})."""
    from relayd.storage.buckets import BUCKETS

    name = session.encode()
    return f"{prefix}{wing}:".encode() + BUCKETS.tag_of(name) + b":" + kind.encode() + b":" + name


def bucket_key(prefix: str, wing: str, kind: str, session: str) -> bytes:
    """A per-bucket key of a session's bucket (C{bucket_key("p:", "aep", "clock", "S")}: C{p:aep:{b}:clock})."""
    from relayd.storage.buckets import BUCKETS

    return f"{prefix}{wing}:".encode() + BUCKETS.tag_of(session.encode()) + b":" + kind.encode()


def same_bucket(count: int, stem: str = "s") -> list[str]:
    """C{count} session names of one bucket (C{stem}0, C{stem}17...)."""
    from relayd.storage.buckets import BUCKETS

    found: dict[int, list[str]] = {}
    for n in itertools.count():
        name = f"{stem}{n}"
        names = found.setdefault(BUCKETS.index_of(name.encode()), [])
        names.append(name)
        if len(names) == count:
            return names
    raise AssertionError("unreachable")


async def connected_redis(url: str, timeout: float = 5.0, **options: Any):  # type: ignore[no-untyped-def]
    """A L{relayd.storage.redis.Redis} client whose pool is up (a L{ClusterRedis} for a
    C{redis+cluster://} URL, once the slot map is read and every master's pool is up); C{options}:
    the client's keyword arguments (C{wait_replicas}...)."""
    from twisted.internet import reactor
    from twisted.internet.task import deferLater

    from relayd.base.clock import Timekeeper
    from relayd.storage.cluster import ClusterRedis, redis_client
    from relayd.storage.redis import Redis

    redis = redis_client(url, Timekeeper(reactor), **options)
    waited = 0.0
    if isinstance(redis, ClusterRedis):
        while not (redis.connected and all(n._factory.size == n._factory.poolsize for n in redis._nodes.values())):
            if waited > timeout:
                raise AssertionError(f"could not connect to {url}")
            await deferLater(reactor, 0.01, lambda: None)  # polling a connection that is being made
            waited += 0.01
        return redis
    assert isinstance(redis, Redis)
    factory = redis._pool._factory
    # Every pool slot up: closing a pool while a slot is still connecting trips over
    # ClientService's own connect (AlreadyCalledError), which a short test would hit.
    while factory.size < factory.poolsize:
        if waited > timeout:
            raise AssertionError(f"could not connect to {url}")
        await deferLater(reactor, 0.01, lambda: None)  # polling a connection that is being made
        waited += 0.01
    return redis


def _connect(port: int, timeout: float, tls_ca: str | None) -> socket.socket:
    """A socket to C{port} on loopback; over TLS (the server's certificate for C{localhost} checked
    against the CA of the PEM file C{tls_ca}) when C{tls_ca} is given."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    if tls_ca is None:
        return s
    return ssl.create_default_context(cafile=tls_ca).wrap_socket(s, server_hostname="localhost")


def command(port: int, *args: str | bytes, timeout: float = 2.0, tls_ca: str | None = None) -> Any:
    """One command to the Redis (or sentinel) on C{port}, over a plain socket (TLS with C{tls_ca}),
    its reply parsed (bytes, int, list, or a C{RuntimeError} value for an error reply): a second
    client, not the one under test."""
    parts = [a.encode() if isinstance(a, str) else a for a in args]
    with _connect(port, timeout, tls_ca) as s:
        s.sendall(b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts))
        reader = s.makefile("rb")
        return _reply(reader)


def read_on_replica(port: int, key: bytes, timeout: float = 2.0) -> Any:
    """C{GET key} on the Redis Cluster replica on C{port} (C{READONLY} first, on the same connection):
    what that replica holds, not a redirection to its master."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(b"*1\r\n$8\r\nREADONLY\r\n*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key))
        reader = s.makefile("rb")
        _reply(reader)  # +OK
        return _reply(reader)


def _reply(reader: Any) -> Any:
    line = reader.readline()
    if not line:
        raise ConnectionError("closed")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest
    if kind == b"-":
        return RuntimeError(rest.decode(errors="replace"))
    if kind == b":":
        return int(rest)
    if kind == b"$":
        return None if rest == b"-1" else reader.read(int(rest) + 2)[:-2]
    if kind == b"*":
        return None if rest == b"-1" else [_reply(reader) for _ in range(int(rest))]
    raise ValueError(f"unexpected reply {line!r}")


def _authed(port: int, password: str, *args: str | bytes, tls_ca: str | None = None) -> Any:
    """C{AUTH password}, then one command, on one connection; the command's reply."""
    parts = [[b"AUTH", password.encode()], [a.encode() if isinstance(a, str) else a for a in args]]
    with _connect(port, 0.5, tls_ca) as s:
        s.sendall(b"".join(b"*%d\r\n" % len(p) + b"".join(b"$%d\r\n%s\r\n" % (len(x), x) for x in p) for p in parts))
        reader = s.makefile("rb")
        _reply(reader)
        return _reply(reader)


def role(port: int) -> bytes | None:
    """What the Redis on C{port} says it is (C{b"master"}, C{b"slave"}), or C{None} when it does not answer."""
    try:
        reply = command(port, "ROLE", timeout=0.5)
    except OSError:
        return None
    return reply[0] if isinstance(reply, list) else None


@dataclass(frozen=True)
class SentinelTLS:
    """TLS for a L{SentinelGroup}: the certificate and key every node and sentinel serves (for
    C{localhost} and 127.0.0.1, tests/support/tls.py), the CA's PEM file, and whether the sentinels
    listen on TLS only (C{port 0}) or on plain TCP only (their data nodes on TLS either way)."""

    cert: Path
    key: Path
    ca: Path
    sentinels_on_tls: bool = True

    def options(self, port: int) -> tuple[str, ...]:
        return ("--tls-port", str(port), "--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key),
                "--tls-ca-cert-file", str(self.ca), "--tls-auth-clients", "no", "--tls-replication", "yes")  # fmt: skip


class SentinelGroup:
    """A master, two replicas and three sentinels (quorum 2) on free loopback ports: C{.url} is the
    C{redis+sentinel://} URL of the master C{MASTER}; C{.master_port()} asks a sentinel where it is;
    every process is killed by its PID at C{cleanup()}. A failover takes about 2.5 s
    (C{down-after-milliseconds 1000}). The data nodes keep what a deployment would
    (docs/deployment.md "Sentinel"): C{min-replicas-to-write} is left at 0 here so that the master
    left alone after a kill accepts writes again, the WAIT of relayd's acknowledged writes is what
    is tested."""

    MASTER = "relayd"

    def __init__(
        self, password: str | None = None, sentinel_password: str | None = None, tls: SentinelTLS | None = None
    ) -> None:
        self.binary = require_redis_server()
        self.tls = tls
        self.tls_ports: dict[int, int] = {}  # a data node's TLS port -> its plain one (the fixture's checks)
        self.password = password  # the data nodes' (requirepass, masterauth)
        self.sentinel_password = sentinel_password  # the sentinels' own (requirepass)
        self.nodes: list[RedisServer] = []
        self.sentinels: list[tuple[int, subprocess.Popen[bytes], str]] = []

    @classmethod
    def start(
        cls, password: str | None = None, sentinel_password: str | None = None, tls: SentinelTLS | None = None
    ) -> SentinelGroup:
        """The group; with C{password} the data nodes require it, with C{sentinel_password} the sentinels
        do; with C{tls} the data nodes (and the sentinels, as it says) serve TLS, and replicate over it."""
        group = cls(password, sentinel_password, tls)
        try:
            group._spawn()
        except BaseException:
            group.cleanup()
            raise
        return group

    def _spawn(self) -> None:
        # A replica moved to a new master may need a full copy: sent at once, not after Redis's
        # default 5 s wait for more replicas (the new master has none to confirm writes until then).
        options: tuple[str, ...] = ("--repl-diskless-sync-delay", "0")
        if self.password:
            options += ("--requirepass", self.password, "--masterauth", self.password)
        master = self._data_node(options)
        for _ in range(2):
            self._data_node((*options, "--replicaof", "127.0.0.1", str(self._served_port(master))))
        for _ in range(3):
            port = free_port()
            folder = tempfile.mkdtemp(prefix="relayd-sentinel-")
            config = os.path.join(folder, "sentinel.conf")
            with open(config, "w") as f:
                if self.tls is None:
                    f.write(f"port {port}\n")
                else:  # TLS to the data nodes and between sentinels; to clients, TLS only or plain only
                    plain, tls_port = (0, port) if self.tls.sentinels_on_tls else (port, free_port())
                    pairs = zip(self.tls.options(tls_port)[::2], self.tls.options(tls_port)[1::2], strict=True)
                    f.write(f"port {plain}\n" + "".join(f"{name[2:]} {value}\n" for name, value in pairs))
                f.write(
                    f"bind 127.0.0.1\ndir {folder}\n"
                    f"sentinel monitor {self.MASTER} 127.0.0.1 {self._served_port(master)} 2\n"
                    f"sentinel down-after-milliseconds {self.MASTER} 1000\n"
                    f"sentinel failover-timeout {self.MASTER} 2000\n"
                    f"sentinel parallel-syncs {self.MASTER} 2\n"
                )
                if self.password:
                    f.write(f"sentinel auth-pass {self.MASTER} {self.password}\n")
                if self.sentinel_password:
                    f.write(f"requirepass {self.sentinel_password}\nsentinel sentinel-pass {self.sentinel_password}\n")
            proc = subprocess.Popen([self.binary, config, "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.sentinels.append((port, proc, folder))
        # Ready once every sentinel knows both replicas and the two other sentinels (the INFO of the
        # master and the hello messages, every 2 s): before that a failover has no quorum.
        deadline = time.monotonic() + 20
        while not all(self._knows_all(port) for port, _, _ in self.sentinels):
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinels did not find each other and the replicas")
            time.sleep(0.05)  # waiting for external processes to find each other

    def _data_node(self, options: tuple[str, ...]) -> RedisServer:
        if self.tls is None:
            node = RedisServer.start(*options)
        else:
            tls_port = free_port()
            node = RedisServer.start(*options, *self.tls.options(tls_port))
            self.tls_ports[tls_port] = node.port
        self.nodes.append(node)
        return node

    def _served_port(self, node: RedisServer) -> int:
        """The port the sentinels know C{node} by (its TLS port with TLS)."""
        return next((tls for tls, plain in self.tls_ports.items() if plain == node.port), node.port)

    def _sentinel(self, port: int, *args: str) -> Any:
        """A command to the sentinel on C{port} (authenticated when the sentinels require it)."""
        ca = str(self.tls.ca) if self.tls is not None and self.tls.sentinels_on_tls else None
        if self.sentinel_password:
            return _authed(port, self.sentinel_password, *args, tls_ca=ca)
        return command(port, *args, timeout=0.5, tls_ca=ca)

    def _knows_all(self, port: int) -> bool:
        try:
            flat = self._sentinel(port, "SENTINEL", "MASTER", self.MASTER)
        except OSError:
            return False
        if not isinstance(flat, list):
            return False
        info = dict(zip(flat[::2], flat[1::2], strict=True))
        return info.get(b"num-slaves") == b"2" and info.get(b"num-other-sentinels") == b"2"

    @property
    def url(self) -> str:
        """The C{redis+sentinel://} URL (with TLS, C{rediss+sentinel://} naming the sentinels
        C{localhost}, trusting the group's CA, and C{sentinel_tls=no} when they are plain)."""
        host = "127.0.0.1" if self.tls is None else "localhost"
        hosts = ",".join(f"{host}:{port}" for port, _, _ in self.sentinels)
        auth = f":{self.password}@" if self.password else ""
        query = [f"sentinel_password={self.sentinel_password}"] if self.sentinel_password else []
        if self.tls is not None:
            query += [f"tls_ca={self.tls.ca}"] + ([] if self.tls.sentinels_on_tls else ["sentinel_tls=no"])
        scheme = "redis+sentinel" if self.tls is None else "rediss+sentinel"
        return f"{scheme}://{auth}{hosts}/{self.MASTER}/0" + ("?" + "&".join(query) if query else "")

    def master_port(self) -> int | None:
        """The master's port as the first sentinel that answers says."""
        for port, _, _ in self.sentinels:
            try:
                reply = self._sentinel(port, "SENTINEL", "get-master-addr-by-name", self.MASTER)
            except OSError:
                continue
            if isinstance(reply, list):
                return int(reply[1])
        return None

    def node(self, port: int) -> RedisServer:
        """The data node on C{port} (its plain port, or with TLS the TLS port the sentinels name)."""
        port = self.tls_ports.get(port, port)
        return next(n for n in self.nodes if n.port == port)

    def failover(self) -> None:
        """C{SENTINEL FAILOVER}: a replica promoted, the master demoted later."""
        reply = self._sentinel(self.sentinels[0][0], "SENTINEL", "FAILOVER", self.MASTER)
        if isinstance(reply, Exception):
            raise reply

    def cleanup(self) -> None:
        for _port, proc, folder in self.sentinels:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            shutil.rmtree(folder, ignore_errors=True)
        self.sentinels = []
        for node in self.nodes:
            node.cleanup()
        self.nodes = []
