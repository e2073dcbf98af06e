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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")


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


def process_rss_kb(pid: int) -> int:
    """Resident memory of process C{pid} in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class RelaydServer:
    """Starts relayd with C{options} and waits until each listener in C{wait_for} announced its port."""

    def __init__(self, *options: str, wait_for: tuple[str, ...] = ("aep",), env: dict[str, str] | None = None) -> None:
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("AEP_", "RELAYD_"))}
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("BENCH_EXTRA_PATH"), str(ROOT)]))
        # Every benchmark client is one address: no per-client connection cap (an environment
        # variable, which a relayd older than the setting ignores, as a comparison run may use).
        environ["RELAYD_MAX_CLIENT_CONNECTIONS"] = "0"
        environ.update(env or {})
        twistd = Path(sys.executable).with_name("twistd")
        argv = [sys.executable, str(twistd)] if twistd.exists() else [
            sys.executable, "-c", "from twisted.scripts.twistd import run; run()"]
        argv += ["-n", "--pidfile=", "--logfile=-", "relayd", *options]
        # The log goes to a file: a pipe nobody reads would fill and block the server.
        self.log = tempfile.NamedTemporaryFile(prefix="relayd-bench-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=environ,
                                     preexec_fn=raise_nofile)
        self.ports: dict[str, int] = {}
        deadline = time.monotonic() + 20
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

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("the --redis scenarios need redis-server")
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL)
        time.sleep(0.5)  # waiting for another process to start listening
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def cpu(self) -> float:
        """redis-server's user plus system CPU seconds so far."""
        return process_cpu(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
