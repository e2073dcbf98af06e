"""A real ``twistd -n relayd`` subprocess for the benchmarks: its listeners' ports, CPU time and RSS."""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
# A command the redis-servers the bench starts run under (bench/cluster_append.py --callgrind:
# valgrind, which counts each node's instructions); empty: redis-server itself.
REDIS_WRAPPER: list[str] = []


def raise_nofile() -> None:
    """Lift the soft open-file limit to the hard one (thousands of benchmark connections)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (field 3 is index 0)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_cpu(pid: int) -> float:
    """User plus system CPU seconds process C{pid} has used so far."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / TICK


def group_cpu(pgid: int) -> float:
    """User plus system CPU seconds of every live process in process group C{pgid} (a relay started
    through a shell: the shell and what it runs)."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat(int(entry.name))
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid:
            total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def process_switches(pid: int) -> tuple[int, int]:
    """Process C{pid}'s context switches so far (its main thread's): voluntary (it waited: for a
    read, an epoll) and involuntary (preempted)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"])


def process_rss_kb(pid: int) -> int:
    """Resident memory of process C{pid} in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0



def wait_listening(port: int, seconds: float) -> None:
    """Until a server accepts connections on loopback C{port} (raises once C{seconds} have passed)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # another process still starting

class RelaydServer:
    """Starts relayd with C{options} and waits until each listener in C{wait_for} announced its port."""

    def __init__(self, *options: str, wait_for: tuple[str, ...] = ("aep",), env: dict[str, str] | None = None,
                 prefix: tuple[str, ...] = (), start_timeout: float = 20) -> None:
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("AEP_", "RELAYD_"))}
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("BENCH_EXTRA_PATH"), str(ROOT)]))
        # Every benchmark client is one address: no per-client connection cap (an environment
        # variable, which a relayd older than the setting ignores, as a comparison run may use).
        environ["RELAYD_MAX_CLIENT_CONNECTIONS"] = "0"
        environ.update(env or {})
        twistd = Path(sys.executable).with_name("twistd")
        argv = [sys.executable, str(twistd)] if twistd.exists() else [
            sys.executable, "-c", "from twisted.scripts.twistd import run; run()"]
        argv = [*prefix, *argv, "-n", "--pidfile=", "--logfile=-", "relayd", *options]  # prefix: e.g. valgrind
        # The log goes to a file: a pipe nobody reads would fill and block the server.
        self.log = tempfile.NamedTemporaryFile(prefix="relayd-bench-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=environ,
                                     preexec_fn=raise_nofile)
        self.ports: dict[str, int] = {}
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            text = Path(self.log.name).read_bytes()
            for name in wait_for:
                found = re.search(rb'%s listening on https?://[^\s"]+:(\d+)' % name.encode(), text)
                if found:
                    self.ports[name] = int(found.group(1))
            if len(self.ports) == len(wait_for):
                return
            time.sleep(0.05)  # waiting for another process to start
        raise RuntimeError("relayd did not start:\n" + self.log_text())

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def cpu(self) -> float:
        """User plus system CPU seconds so far."""
        return process_cpu(self.proc.pid)

    def rss_kb(self) -> int:
        return process_rss_kb(self.proc.pid)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.unlink(self.log.name)


class RedisProcess:
    """A throwaway redis-server on a free port (bench/aep.py's --redis scenarios, bench/redis_append.py)."""

    engine = "standalone"

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("the --redis scenarios need redis-server")
        self.proc = subprocess.Popen([*REDIS_WRAPPER, binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL)
        time.sleep(0.5)  # waiting for another process to start listening
        wait_listening(self.port, 60)  # (under REDIS_WRAPPER's valgrind, seconds)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def cpu(self) -> float:
        """redis-server's user plus system CPU seconds so far."""
        return process_cpu(self.proc.pid)

    @property
    def node_pids(self) -> list[int]:
        return [self.proc.pid]

    def node_cpus(self) -> list[float]:
        """Each node's CPU seconds so far (the one server's)."""
        return [self.cpu()]

    @property
    def node_ports(self) -> list[int]:
        return [self.port]

    @property
    def relayd_options(self) -> tuple[str, ...]:
        """relayd's options for this store: no replica to WAIT for (as on the cluster, like for like)."""
        return ("--redis", self.url, "--redis-wait-replicas", "0")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def redis_info(port: int, section: str) -> dict[str, str]:
    """C{INFO section} of the redis-server on loopback C{port}, as field -> value (a plain socket:
    the bench's own reads must not start a process per node per reading)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"INFO %s\r\n" % section.encode())
        data = b""
        while b"\r\n" not in data:
            data += s.recv(65536)
        head, _, body = data.partition(b"\r\n")
        size = int(head[1:])
        while len(body) < size + 2:
            body += s.recv(65536)
    fields = {}
    for line in body[:size].decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition(":")
            fields[name] = value
    return fields


def command_stats(port: int) -> dict[str, tuple[int, int]]:
    """Each command's calls and microseconds so far (C{INFO commandstats}; a subcommand as
    C{cluster|slots})."""
    out = {}
    for name, value in redis_info(port, "commandstats").items():
        parts = dict(item.split("=") for item in value.split(","))
        out[name.removeprefix("cmdstat_")] = (int(parts["calls"]), int(parts["usec"]))
    return out


# The INFO stats and cpu counters the cluster scenarios report per node (deltas over a run).
NODE_COUNTERS = ("total_commands_processed", "total_net_input_bytes", "total_net_output_bytes",
                 "total_reads_processed", "total_writes_processed", "used_cpu_user", "used_cpu_sys")


def node_counters(port: int) -> dict[str, float]:
    """L{NODE_COUNTERS} of one node now (C{INFO stats} and C{INFO cpu}: the CPU in seconds to the
    microsecond, finer than /proc's ticks)."""
    info = {**redis_info(port, "stats"), **redis_info(port, "cpu")}
    return {name: float(info[name]) for name in NODE_COUNTERS if name in info}


def _cluster_ports(count: int) -> list[int]:
    """C{count} free loopback ports whose cluster bus ports (10000 more) are free too, none of the
    2 x C{count} the same (each is held bound until all are chosen, so the kernel hands out no port twice)."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port + 10000 >= 65536:
                continue
            bus = socket.socket()
            held.append(bus)
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            ports.append(port)
        return ports
    finally:
        for s in held:
            s.close()


def _redis_cli(cli: str, port: int, *args: str) -> str:
    return subprocess.run([cli, "-p", str(port), *args], capture_output=True, timeout=30, check=True).stdout.decode()


class RedisClusterProcess:
    """A throwaway Redis Cluster of C{masters} redis-servers without replicas on free loopback ports,
    its slots split evenly by C{redis-cli --cluster create} (as tests/support/redis.py's RedisCluster
    makes one); C{.stop()} kills every node. relayd runs on it with C{--redis-wait-replicas 0}: there
    is no replica to WAIT for, as on the single primary it is compared with."""

    engine = "cluster"

    def __init__(self, masters: int = 3) -> None:
        binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if binary is None or cli is None:
            raise SystemExit("the cluster engine needs redis-server and redis-cli (apt-get install redis-server "
                             "redis-tools)")
        self.cli = cli
        self.binary = binary
        self.dir = tempfile.mkdtemp(prefix="relayd-bench-cluster-")
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            # A port taken by another process between its choice and the node's bind makes that node
            # exit: start the whole cluster again on other ports (three tries).
            for attempt in range(3):
                if self._start(masters, attempt):
                    break
                self._kill()
            else:
                raise RuntimeError("the Redis Cluster's nodes could not start (ports taken?)")
            if masters == 1:  # (redis-cli --cluster create wants three: one node takes every slot itself)
                _redis_cli(cli, self.ports[0], "CLUSTER", "ADDSLOTSRANGE", "0", "16383")
            else:
                subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                                "--cluster-replicas", "0", "--cluster-yes"],
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
            self._wait(lambda: all("cluster_state:ok" in _redis_cli(cli, p, "CLUSTER", "INFO") for p in self.ports))
        except BaseException:
            self.stop()
            raise
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def _start(self, masters: int, attempt: int) -> bool:
        """Start C{masters} nodes; whether every one answers PING (false: one exited)."""
        self.ports = _cluster_ports(masters)
        for i, port in enumerate(self.ports):
            node_dir = Path(self.dir, f"{attempt}-{i}")
            node_dir.mkdir()
            self.procs.append(subprocess.Popen(
                [*REDIS_WRAPPER, self.binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(node_dir), "--save", "",
                 "--appendonly", "no", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 # (Under valgrind a node answers the others slowly: not taken for failed.)
                 "--cluster-node-timeout", "60000" if REDIS_WRAPPER else "2000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if any(proc.poll() is not None for proc in self.procs):
                return False
            try:
                if all(_redis_cli(self.cli, p, "PING").strip() == "PONG" for p in self.ports):
                    return True
            except subprocess.CalledProcessError:
                pass  # not listening yet
            time.sleep(0.05)  # waiting for other processes to start listening
        raise RuntimeError("the Redis Cluster's nodes did not start")

    def _wait(self, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if ready():
                    return
            except subprocess.CalledProcessError:
                pass  # not listening yet
            time.sleep(0.05)  # waiting for other processes (the nodes, their cluster bus) to converge
        raise RuntimeError("the Redis Cluster did not come up")

    @property
    def node_pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def node_cpus(self) -> list[float]:
        """Each master's user plus system CPU seconds so far (from /proc/PID/stat)."""
        return [process_cpu(proc.pid) for proc in self.procs]

    def cpu(self) -> float:
        """All nodes' CPU seconds so far."""
        return sum(self.node_cpus())

    @property
    def node_ports(self) -> list[int]:
        return list(self.ports)

    @property
    def relayd_options(self) -> tuple[str, ...]:
        return ("--redis", self.url, "--redis-wait-replicas", "0")

    def _kill(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait(10)
        self.procs = []

    def stop(self) -> None:
        self._kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def redis_store(engine: str, masters: int = 3) -> RedisProcess | RedisClusterProcess:
    """A fresh store for C{engine}: "standalone" (one redis-server) or "cluster" (C{masters} masters)."""
    return RedisClusterProcess(masters) if engine == "cluster" else RedisProcess()
