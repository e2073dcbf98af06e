"""A scripted fault proxy in front of a real Nostr relay: it drops, refuses or delays OK replies,
closes connections before or after forwarding, and throttles, per rule (the broker's fault matrix).

    relay = shared_nostr_relay()                   # tests/support/nostr.py
    proxy = start_fault_relay(self, relay.url)     # stopped by addCleanup

Kept apart from tests/support/nostr.py so that importing the relay launcher does not choose
autobahn's Twisted flavour for a process (bench/soak.py uses autobahn's asyncio one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from autobahn.twisted.websocket import (
    WebSocketClientFactory,
    WebSocketClientProtocol,
    WebSocketServerFactory,
    WebSocketServerProtocol,
)
from twisted.internet import defer, endpoints

# --- the fault proxy ----------------------------------------------------------------------------
#
# A scriptable fault-injecting WebSocket proxy in front of the real relay. The relay behind it holds
# the truth: every event the proxy lets through is stored or refused by the real relay, and tests
# compare the broker's verdicts with the relay's database. The proxy only adds the faults a
# well-behaved relay does not produce on demand:
#
#  - refuse: answer ["OK", id, false, message] without forwarding (the relay never sees it);
#  - drop_ok: forward the EVENT, swallow the relay's OK (the event is stored, nobody is told);
#  - close_before: close the client's connection instead of forwarding;
#  - close_after: forward, and close the client's connection when the relay's OK arrives;
#  - throttle: from this EVENT on, the client's connection forwards nothing and answers nothing
#    (a relay throttling one identity's connection); a new connection is served normally.
#
# Rules match EVENTs in arrival order; each fires `times` times (then the next matching rule, or plain
# forwarding). AUTH, REQ and CLOSE pass, so NIP-42 is the real relay's; while `refuse_reads` holds a
# message, every REQ is answered ["CLOSED", sub, message] instead (a relay that cannot be queried).

FAULT_ACTIONS = frozenset({"pass", "refuse", "drop_ok", "close_before", "close_after", "throttle"})


@dataclass
class Rule:
    """What to do with EVENTs that C{match}: C{action} (one of L{FAULT_ACTIONS}), at most C{times} times."""

    action: str
    match: Callable[[dict[str, Any]], bool] = lambda ev: True
    times: int = 1
    message: str = "blocked: refused by the fault script"
    fired: int = 0

    def __post_init__(self) -> None:
        assert self.action in FAULT_ACTIONS, self.action


def kind(k: int) -> Callable[[dict[str, Any]], bool]:
    """A matcher for events of kind C{k}."""
    return lambda ev: ev.get("kind") == k


@dataclass
class Script:
    """The proxy's rules, and every EVENT that reached it."""

    rules: list[Rule] = field(default_factory=list)
    seen: list[dict[str, Any]] = field(default_factory=list)

    def decide(self, ev: dict[str, Any]) -> Rule | None:
        self.seen.append(ev)
        for rule in self.rules:
            if rule.fired < rule.times and rule.match(ev):
                rule.fired += 1
                return rule
        return None


# autobahn's opening and closing handshake timers run on txaio's batched timer: one still pending
# when a test ends (a close the test's own stop() cut short) fails it as a dirty reactor. The proxy
# needs neither: stop() aborts whatever is left.
NO_HANDSHAKE_TIMERS = {"openHandshakeTimeout": 0, "closeHandshakeTimeout": 0}


def _reactor() -> Any:
    from twisted.internet import reactor

    return reactor


class _Upstream(WebSocketClientProtocol):
    down: _Downstream

    def onOpen(self) -> None:
        self.down.upstream_open(self)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        self.down.from_relay(payload)

    def onClose(self, wasClean: bool, code: Any, reason: Any) -> None:
        self.down.upstream_closed()

class _Downstream(WebSocketServerProtocol):
    factory: Any

    def onConnect(self, request: Any) -> Any:
        # The client's handshake completes only once the relay's is done, so the relay's AUTH
        # challenge reaches the client as promptly as it would without the proxy.
        self.up: _Upstream | None = None
        self.opened = False
        self.early: list[bytes] = []  # relay messages before the client's side is open
        self.swallow: set[str] = set()  # event ids whose OK is not passed on
        self.close_on_ok: set[str] = set()
        self.throttled = False
        self.factory.connections.append(self)
        self.ready: defer.Deferred[None] = defer.Deferred()
        f = WebSocketClientFactory(self.factory.upstream_url)
        f.setProtocolOptions(**NO_HANDSHAKE_TIMERS)
        down = self

        class P(_Upstream):
            pass

        P.down = down  # type: ignore[misc]
        f.protocol = P
        endpoints.TCP4ClientEndpoint(_reactor(), "127.0.0.1", self.factory.upstream_port).connect(f).addErrback(
            lambda _: self.ready.called or self.ready.errback(ConnectionRefusedError("relay unreachable"))
        )
        return self.ready.addCallback(lambda _: None)

    def onOpen(self) -> None:
        self.opened = True
        early, self.early = self.early, []
        for m in early:
            self.sendMessage(m)

    def upstream_open(self, up: _Upstream) -> None:
        self.up = up
        if not self.ready.called:
            self.ready.callback(None)

    def upstream_closed(self) -> None:
        self.sendClose()

    def _forward(self, payload: bytes) -> None:
        if self.up is not None:
            self.up.sendMessage(payload)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        if self.throttled:
            return
        try:
            msg = json.loads(payload)
        except ValueError:
            msg = None
        refusal = self.factory.refuse_reads
        if refusal is not None and isinstance(msg, list) and len(msg) > 1 and msg[0] == "REQ":
            self.sendMessage(json.dumps(["CLOSED", msg[1], refusal]).encode())
            return
        if not (isinstance(msg, list) and msg and msg[0] == "EVENT" and isinstance(msg[1], dict)):
            self._forward(payload)
            return
        ev = msg[1]
        rule = self.factory.script.decide(ev)
        action = rule.action if rule is not None else "pass"
        eid = str(ev.get("id"))
        if action == "refuse":
            assert rule is not None
            self.sendMessage(json.dumps(["OK", eid, False, rule.message]).encode())
        elif action == "close_before":
            self.dropConnection(abort=True)
        elif action == "throttle":
            self.throttled = True
        else:
            if action == "drop_ok":
                self.swallow.add(eid)
            elif action == "close_after":
                self.close_on_ok.add(eid)
            self._forward(payload)

    def from_relay(self, payload: bytes) -> None:
        try:
            msg = json.loads(payload)
        except ValueError:
            msg = None
        if isinstance(msg, list) and len(msg) > 1 and msg[0] == "OK":
            eid = str(msg[1])
            if eid in self.close_on_ok:
                self.dropConnection(abort=True)
                return
            if eid in self.swallow:
                return
        if self.throttled:
            return
        if self.opened:
            self.sendMessage(payload)
        else:
            self.early.append(payload)

    def onClose(self, wasClean: bool, code: Any, reason: Any) -> None:
        up = getattr(self, "up", None)
        if up is not None:
            up.dropConnection(abort=True)

class FaultRelay(WebSocketServerFactory):
    """The proxy: C{start()} listens on 127.0.0.1:0; C{proxy_url} is what the broker connects to."""

    protocol = _Downstream

    def __init__(self, upstream_url: str) -> None:
        super().__init__()
        self.setProtocolOptions(**NO_HANDSHAKE_TIMERS)
        self.upstream_url = upstream_url
        self.upstream_port = int(upstream_url.rsplit(":", 1)[1])
        self.script = Script()
        self.refuse_reads: str | None = None
        self.connections: list[_Downstream] = []
        self.listening: Any = None

    def start(self) -> None:
        self.listening = _reactor().listenTCP(0, self, interface="127.0.0.1")
        self.port_number = self.listening.getHost().port
        self.setSessionParameters(url=self.proxy_url)

    @property
    def proxy_url(self) -> str:
        return f"ws://127.0.0.1:{self.port_number}"

    def on(
        self,
        action: str,
        match: Callable[[dict[str, Any]], bool] = lambda ev: True,
        times: int = 1,
        message: str | None = None,
    ) -> Rule:
        """Add a rule (see the comment above L{FAULT_ACTIONS})."""
        rule = Rule(action, match, times, message or "blocked: refused by the fault script")
        self.script.rules.append(rule)
        return rule

    def clear(self) -> None:
        self.script.rules.clear()

    def stop(self) -> defer.Deferred[None]:
        """Abort every proxied connection and stop listening (idempotent)."""
        for c in list(self.connections):
            if c.transport is not None:
                c.transport.abortConnection()
            up = getattr(c, "up", None)
            if up is not None and up.transport is not None:
                up.transport.abortConnection()
        listening, self.listening = self.listening, None
        if listening is None:
            return defer.succeed(None)
        return defer.maybeDeferred(listening.stopListening)


def start_fault_relay(testcase: Any, upstream_url: str) -> FaultRelay:
    """A listening fault proxy in front of C{upstream_url}, stopped by C{testcase.addCleanup}."""
    proxy = FaultRelay(upstream_url)
    proxy.start()
    testcase.addCleanup(proxy.stop)
    return proxy


# --- the relay process's side --------------------------------------------------------------------
