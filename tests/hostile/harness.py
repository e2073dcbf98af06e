"""The hostile-input harness: one real ``twistd -n relayd`` with all four listeners, raw sockets, and
the invariants every attack is judged by.

What runs
    L{hostile} gives a test the relayd of its class: AEP (C{--aep-token} L{TOKEN}), MCP, the broker
    (on a real PyPI nostr-relay, with one issued credential: L{Target.credential} for
    L{Target.channel}) and the metrics listener, every one on 127.0.0.1 port 0. The first test of a
    class starts it; it is stopped when a test of another class asks for one, and the last one at
    interpreter exit. It is a plain C{subprocess} whose log a thread reads: trial removes every
    reactor reader after each test, so a reactor-spawned process could not outlive one test.

Invariants
    1. No C{5xx}, and no missing answer: every request gets complete responses (parseable, framed by
       a length, chunks, or C{connection: close}), or the connection closes where closing is the
       documented answer; a C{405} names C{Allow}, a C{431} has a body. L{judge} checks one
       connection's L{Answer}; the test calls it.
    2. Nothing in relayd's log since the test began contains C{Unhandled Error} or C{Traceback}.
       A log barrier (a request whose access line must appear) makes sure the log is caught up.
    3. Each listener's probe (C{GET /healthz} on AEP, MCP and the broker, C{GET /metrics} on the
       metrics listener) answers within
       L{PROBE_BUDGET} (100 ms) on a new connection; one slow probe is retried twice, so a scheduler
       hiccup on a loaded machine is not a failure but a relay that stays slow is.
    4. Resident memory grew by at most L{RSS_BUDGET} (16 MiB) since the relayd first answered on
       every listener (the whole suite stays under 1 MiB of growth; one client that reads nothing
       while it pipelines requests for 7 KB answers used to cost 20 MB).
    2 to 4 are L{Target.check} (awaitable) or L{Target.check_now} (blocking, for a property after
    each example); L{hostile} registers a cleanup that checks them after every test.

How a wing test uses it::

    from tests.hostile.harness import SETTINGS, hostile, in_thread, judge, request

    class MyAttacks(TestCase):
        async def test_something(self) -> None:
            target = await hostile(self)                      # invariants 2-4 checked at cleanup
            answer = await target.send("mcp", request(b"POST", b"/register", body=b"{"))
            judge(answer)                                     # invariant 1
            self.assertEqual(answer.responses[0].status, 400)

        async def test_generated(self) -> None:
            target = await hostile(self)

            @SETTINGS
            @given(body=st.binary())
            def attack(body: bytes) -> None:                  # runs on a worker thread
                answer = target.exchange("broker", request(b"POST", b"/v1/action", body=body))
                judge(answer)
                target.check_now("broker")                    # log, probe and RSS after each example

            await in_thread(attack)

L{Target.exchange} and L{Target.check_now} block (worker thread: hypothesis keeps its shrinking and
reporting); L{Target.send} and L{Target.check} are their awaitable forms for the reactor thread.
C{hostile(self, ["--aep-max-body", "1000"])} runs the class's relayd with more flags. Generic
request strategies (request lines, header sets, body framings) are in L{tests.hostile.strategies}.
"""

from __future__ import annotations

import atexit
import itertools
import os
import tempfile
import uuid
from typing import Any, Callable, Sequence

from hypothesis import HealthCheck, settings
from twisted.internet import reactor, threads
from twisted.trial.unittest import TestCase

from tests.support.connections import memory
from tests.support.raw import Answer, Response, exchange
from tests.support.skips import require_module
from tests.support.twistd import DetachedRelayd

WINGS = ("aep", "mcp", "broker", "metrics")
"""Every listener of the relayd under attack; all four speak HTTP."""
TOKEN = "hostile-aep-token-0123456789"
MAX_BODY = 65536
"""C{--aep-max-body} and C{--broker-max-body} (MCP's cap is fixed at 256 KiB, metrics' at 64 KiB)."""
DEADLINE = 3.0
"""C{--header-timeout} and C{--body-timeout}: an unfinished request is answered 408 after this."""
PROBE_BUDGET = 0.1
RSS_BUDGET = 16 * 2**20
PROBES: dict[str, tuple[bytes, int]] = {
    "aep": (b"/healthz", 200),
    "mcp": (b"/healthz", 200),
    "broker": (b"/healthz", 200),
    "metrics": (b"/metrics", 200),
}
_LOG_DEFECTS = (b"Unhandled Error", b"Traceback", b"Unhandled error in Deferred")

SETTINGS = settings(
    max_examples=int(os.environ.get("RELAYD_HOSTILE_EXAMPLES", "100")),
    deadline=None,
    database=None,
    derandomize=os.environ.get("RELAYD_HYPOTHESIS_RANDOM") is None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
"""Hypothesis settings for hostile properties: reproducible unless C{RELAYD_HYPOTHESIS_RANDOM} is
set; C{RELAYD_HOSTILE_EXAMPLES} (default 100) examples per property."""


def request(
    method: bytes = b"GET",
    target: bytes = b"/",
    headers: list[tuple[bytes, bytes]] | None = None,
    body: bytes = b"",
    *,
    version: bytes = b"HTTP/1.1",
    host: bool = True,
    close: bool = True,
    length: bool = True,
) -> bytes:
    """The bytes of one request: C{Host} and C{Connection: close} unless told otherwise, and a
    C{Content-Length} for a body unless C{length} is false (the caller frames it itself)."""
    lines = [method + b" " + target + b" " + version]
    if host:
        lines.append(b"Host: localhost")
    if close:
        lines.append(b"Connection: close")
    lines.extend(name + b": " + value for name, value in headers or [])
    if body and length:
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def judge(answer: Answer, *, expected: int = 1, silent_close: bool = False) -> None:
    """Invariant 1 for one connection that sent C{expected} requests.

    Every response is complete and below C{500}; a response without a length or chunks says
    C{connection: close}; C{405} names C{Allow}; C{431} explains itself in a body. Fewer than
    C{expected} responses are fine only when the server closed after one that said
    C{connection: close} (it reads nothing after that), or, with C{silent_close}, closed without
    a word (the client broke off its own request).
    """
    problems = []
    for response in answer.responses:
        problems += _response_problems(response)
    if answer.rest:
        problems.append("an incomplete or malformed response")
    if len(answer.responses) < expected:
        if not answer.closed:
            problems.append(f"no answer within the timeout ({len(answer.responses)} of {expected})")
        elif answer.responses:
            if answer.responses[-1].header(b"connection") != b"close":
                problems.append("closed after a response that did not say connection: close")
        elif not silent_close:
            problems.append("closed without an answer")
    if problems:
        raise AssertionError("; ".join(problems) + " -- " + answer.describe())


def _response_problems(response: Response) -> list[str]:
    problems = []
    if response.status >= 500:
        problems.append(f"{response.status} answered")
    framed = response.header(b"content-length") is not None or response.header(b"transfer-encoding") is not None
    if not framed and response.status not in (204, 304) and response.header(b"connection") != b"close":
        problems.append(f"{response.status} without a length or connection: close")
    if response.status == 405 and not response.header(b"allow"):
        problems.append("405 without Allow")
    if response.status == 431 and not response.body:
        problems.append("431 without a body")
    return problems


async def in_thread(f: Callable[[], Any]) -> Any:
    """Run blocking C{f} (a hypothesis property, raw exchanges) on a worker thread."""
    return await threads.deferToThread(f)


class Invariants:
    """Invariants 2 to 4 (see the module docstring) for one relayd."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.baseline_rss: int | None = None
        self._log_from = 0
        self._barriers = itertools.count()

    def mark(self) -> None:
        """Judge the log only from here on (a test's own start)."""
        self._log_from = len(self.target.relayd.log)

    def check_now(self, *wings: str) -> None:
        """Blocking: probe C{wings} (all by default), catch up with the log and scan it, weigh RSS."""
        for wing in wings or WINGS:
            self.probe(wing)
        self._barrier()
        log = self.target.relayd.log[self._log_from :]
        for defect in _LOG_DEFECTS:
            if defect in log:
                at = log.index(defect)
                raise AssertionError(f"{defect.decode()} in relayd's log:\n" + log[max(0, at - 2000) : at + 4000].decode(errors="replace"))
        rss = memory(self.target.relayd.popen.pid)["VmRSS"]
        grown = rss - (self.baseline_rss or rss)
        if grown > RSS_BUDGET:
            raise AssertionError(f"relayd's RSS grew by {grown / 2**20:.1f} MiB (budget {RSS_BUDGET / 2**20:.0f} MiB)")

    def warm_up(self) -> None:
        """Blocking: one untimed probe per listener (a fresh process pays one-time costs on its
        first answers), then the RSS baseline."""
        for wing in WINGS:
            self.probe(wing, attempts=0)
        self.baseline_rss = memory(self.target.relayd.popen.pid)["VmRSS"]

    def probe(self, wing: str, attempts: int = 3) -> float:
        """Blocking: the probe of C{wing} answers its status within L{PROBE_BUDGET} (one of
        C{attempts} tries; 0: untimed); its latency."""
        path, status = PROBES[wing]
        latencies = []
        for _ in range(max(attempts, 1)):
            answer = exchange(self.target.port(wing), request(b"GET", path), timeout=5.0)
            codes = [r.status for r in answer.responses]
            if codes != [status]:
                raise AssertionError(f"{wing} probe {path.decode()}: expected {status}, got {answer.describe()}")
            latencies.append(answer.elapsed)
            if answer.elapsed <= PROBE_BUDGET or not attempts:
                return answer.elapsed
        raise AssertionError(f"{wing} probe {path.decode()} took {[round(s * 1000) for s in latencies]} ms (budget 100)")

    def _barrier(self) -> None:
        # Everything relayd logged while handling earlier requests precedes this request's access
        # line in its (ordered) log.
        path = b"/hostile-barrier/%d" % next(self._barriers)
        answer = exchange(self.target.port("metrics"), request(b"GET", path))
        judge(answer)
        threads.blockingCallFromThread(reactor, self.target.relayd.wait_for, b'"GET ' + path + b'"')


class Target:
    """The relayd under attack (see L{hostile})."""

    def __init__(self, relayd: DetachedRelayd, nostr: Any, state_dir: str, credential: str, channel: str) -> None:
        self.relayd = relayd
        self.nostr = nostr
        self.state_dir = state_dir
        self.credential = credential
        """A broker credential (C{Authorization: Bearer ...}) scoped to L{channel}."""
        self.channel = channel
        self.invariants = Invariants(self)
        self.owner: tuple[type, tuple[str, ...]] | None = None

    def port(self, wing: str) -> int:
        return self.relayd.port(wing)

    def exchange(self, wing: str, data: bytes | list[bytes], **kw: Any) -> Answer:
        """Blocking L{tests.support.raw.exchange} with C{wing}'s listener."""
        return exchange(self.port(wing), data, **kw)

    async def send(self, wing: str, data: bytes | list[bytes], **kw: Any) -> Answer:
        """L{exchange} from the reactor thread."""
        return await threads.deferToThread(self.exchange, wing, data, **kw)

    def check_now(self, *wings: str) -> None:
        """Blocking invariants 2-4 (see L{Invariants.check_now})."""
        self.invariants.check_now(*wings)

    async def check(self, *wings: str) -> None:
        """Invariants 2-4 from the reactor thread."""
        await threads.deferToThread(self.invariants.check_now, *wings)

    async def stop(self) -> None:
        try:
            await self.relayd.terminate()
        finally:
            self.nostr.stop()


_current: Target | None = None


async def hostile(test: TestCase, options: Sequence[str] = ()) -> Target:
    """The relayd for C{test}'s class (started by its first test); checks invariants at cleanup.

    C{options} are more relayd flags (a later flag wins over the harness's own: C{--aep-max-body
    1000}); a class that wants several configurations gets a fresh relayd per change.
    """
    global _current
    owner = (type(test), tuple(options))
    if _current is not None and (_current.owner != owner or _current.relayd.exited.called):
        previous, _current = _current, None
        await previous.stop()
    if _current is None:
        _current = await _start(list(options))
        _current.owner = owner
        await threads.deferToThread(_current.invariants.warm_up)
    target = _current
    target.invariants.mark()
    test.addCleanup(target.check)
    return target


async def _start(extra: list[str]) -> Target:
    from tests.buzz.harness import issue
    from tests.support.nostr import NostrRelay

    require_module("nostr_relay", "the hostile suite attacks the broker on a real Nostr relay")
    state = tempfile.mkdtemp(prefix="relayd-hostile-")
    kek_file = os.path.join(state, "kek")
    with open(kek_file, "w") as f:
        f.write(os.urandom(32).hex())
    channel = str(uuid.uuid4())
    credential = issue(state, "--agent", "hostile", "--channel", channel, kek_file=kek_file)["credential"]
    nostr = NostrRelay(state)
    nostr.start()
    atexit.register(nostr.stop)
    listen = "tcp:0:interface=127.0.0.1"
    options = [
        "--aep-listen", listen, "--mcp-listen", listen, "--broker-listen", listen, "--metrics-listen", listen,
        "--aep-token", TOKEN, "--aep-max-body", str(MAX_BODY), "--broker-max-body", str(MAX_BODY),
        "--broker-nostr-relay", nostr.url, "--broker-state-dir", state, "--broker-kek-file", kek_file,
        "--header-timeout", str(DEADLINE), "--body-timeout", str(DEADLINE), "--shutdown-grace", "2",
        *extra,
    ]  # fmt: skip
    try:
        relayd = await DetachedRelayd.launch(options, wait_for=WINGS)
    except BaseException:
        nostr.stop()
        raise
    return Target(relayd, nostr, state, credential, channel)

