"""Issue 11: one startup line per listener, from one logger, naming the wing and its URL.

In process: L{HTTPWingService} announces each listener once on C{relayd.listening}; L{listener_url}
spells TCP, IPv6, TLS and Unix listeners. End to end: a real C{twistd -n relayd} with every wing
(two AEP listeners, the broker on a relay that is down) in the text and the JSON log formats logs
exactly one line per listener and none of Twisted's per-port or per-factory lines.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
from typing import Any

from twisted.internet import reactor
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import TestCase

from relayd.base.clock import Timekeeper
from relayd.logs import access
from relayd.logs import json as logs_json
from relayd.web.listen import HTTPWingService, listener_url
from relayd.web.site import RelaySite
from tests.support.cases import cases, expand
from tests.support.twistd import RelaydProcess

LOOPBACK = "tcp:0:interface=127.0.0.1"
NOISE = ("starting on", "Starting factory", "Stopping factory", "Port ", "Closed)")


class _Address:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class _Port:
    def __init__(self, address: Any) -> None:
        self.address = address

    def getHost(self) -> Any:
        return self.address


@expand
class ListenerURL(TestCase):
    @cases(
        tcp=(_Address(host="127.0.0.1", port=8787), "tcp:8787:interface=127.0.0.1", "", "http://127.0.0.1:8787"),
        ipv6=(_Address(host="::1", port=8788), "tcp6:8788:interface=\\:\\:1", "/p", "http://[::1]:8788/p"),
        tls=(_Address(host="0.0.0.0", port=443), "ssl:443:privateKey=k.pem", "", "https://0.0.0.0:443"),
        unix=(_Address(name=b"/run/relayd/aep.sock"), "unix:/run/relayd/aep.sock", "", "unix:/run/relayd/aep.sock"),
    )
    def test_url(self, address: Any, description: str, path: str, url: str) -> None:
        self.assertEqual(listener_url(_Port(address), description, path), url)  # type: ignore[arg-type]


class OneLinePerListener(TestCase):
    async def test_each_listener_is_announced_once_on_one_logger(self) -> None:
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        clock = Timekeeper(reactor)
        self.addCleanup(clock.shutdown)

        class Detailed(HTTPWingService):
            def details(self) -> str:
                return "cors=* from default"

        plain = HTTPWingService("aep", RelaySite(None), [LOOPBACK, LOOPBACK], reactor, clock)  # type: ignore[arg-type]
        detailed = Detailed("mcp", RelaySite(None), [LOOPBACK], reactor, clock)  # type: ignore[arg-type]
        detailed.url_path = "/p"
        for service in (plain, detailed):
            service.startService()
            self.addCleanup(service.stopService)
        aep = [p.getHost().port for p in await plain.ports()]
        (mcp,) = [p.getHost().port for p in await detailed.ports()]
        lines = [e for e in events if "listening on" in formatEvent(e)]
        self.assertEqual(
            [formatEvent(e) for e in lines],
            [f"aep listening on http://127.0.0.1:{aep[0]}", f"aep listening on http://127.0.0.1:{aep[1]}",
             f"mcp listening on http://127.0.0.1:{mcp}/p (cors=* from default)"],
        )
        self.assertEqual({e["log_namespace"] for e in lines}, {"relayd.listening"})
        self.assertEqual([e["relay"] for e in lines], ["aep", "aep", "mcp"])
        self.assertEqual(json.loads(logs_json.event_as_json(lines[2]))["fields"],
                         {"url": f"http://127.0.0.1:{mcp}/p", "details": "cors=* from default"})


@expand
class PortNoise(TestCase):
    @cases(
        tcp_start=("RelaySite starting on 8787", True),
        unix_start=("RelaySite starting on '/run/relayd.sock'", True),
        tcp_closed=("(TCP Port 8787 Closed)", True),
        unix_closed=("(UNIX Port /run/relayd.sock Closed)", True),
        other_factory=("OtherSite starting on 8787", False),
        prose=("the RelaySite starting on 8787 said", False),
    )
    def test_legacy_line(self, text: str, noise: bool) -> None:
        from twisted.python import log

        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        log.msg(text)
        self.assertEqual(access.is_port_noise(events[-1]), noise)

    def test_only_legacy_events(self) -> None:
        event = {"log_namespace": "relayd.web", "message": ("RelaySite starting on 80",), "log_format": "x"}
        self.assertFalse(access.is_port_noise(event))


@expand
class TwistdStartupLines(TestCase):
    """Every wing in one real relayd: one line per listener, nothing else about the ports."""

    timeout = 60

    def setUp(self) -> None:
        self.state = tempfile.mkdtemp(prefix="relayd-announce-")
        self.addCleanup(shutil.rmtree, self.state, ignore_errors=True)
        self.kek_file = os.path.join(self.state, "kek")
        with open(self.kek_file, "w") as f:
            f.write(os.urandom(32).hex())
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.relay_port = s.getsockname()[1]
        s.close()  # the broker's relay is down: its retries must not add lines either

    @cases(text=([],), json=(["--logger=relayd.logs.json.json_observer"],))
    async def test_one_line_per_listener(self, twistd_options: list[str]) -> None:
        sock_path = os.path.join(self.state, "aep.sock")
        proc = await RelaydProcess.start(
            ["--aep-listen", LOOPBACK, "--aep-listen", f"unix:{sock_path}", "--mcp-listen", LOOPBACK,
             "--metrics-listen", LOOPBACK, "--broker-listen", LOOPBACK,
             "--broker-nostr-relay", f"ws://127.0.0.1:{self.relay_port}", "--broker-state-dir", self.state,
             "--broker-kek-file", self.kek_file],
            wait_for=(),
            twistd_options=twistd_options,
        )
        self.addCleanup(proc.kill)
        await proc.wait_for(rb"relayd ready")
        await proc.wait_for(rb"upstream relay ws://127\.0\.0\.1:%d unreachable" % self.relay_port)
        self.assertEqual(await proc.terminate(), 0)
        if twistd_options:
            records = [json.loads(line) for line in proc.log.decode().splitlines() if line.strip()]
            said = [(r["relay"], r["namespace"], r["event"]) for r in records]
        else:
            said = []
            for line in proc.log.decode().splitlines():
                found = re.match(r"\S+ \[([^\]#]+)#\w+\] (.*)", line) or re.match(r"\S+ \[(-)\] (.*)", line)
                self.assertIsNotNone(found, line)
                assert found is not None
                text = found.group(2)
                said.append((text.split(" ", 1)[0], found.group(1), text))
        listening = [(relay, ns, text) for relay, ns, text in said if " listening on " in text]
        port = r"127\.0\.0\.1:\d+"
        expected = [
            ("metrics", rf"metrics listening on http://{port}"),
            ("aep", rf"aep listening on http://{port}"),
            ("aep", rf"aep listening on unix:{re.escape(sock_path)}"),
            ("mcp", rf"mcp listening on http://{port} \(ttl=14400s, cors=\* from default\)"),
            ("broker", rf"broker listening on http://{port} \(upstream relay ws://127\.0\.0\.1:{self.relay_port}\)"),
        ]
        self.assertEqual(len(listening), len(expected), listening)
        for (relay, ns, text), (wing, pattern) in zip(listening, expected, strict=True):
            self.assertEqual((relay, ns), (wing, "relayd.listening"))
            self.assertRegex(text, rf"\A{pattern}\Z")
        for _, _, text in said:
            for marker in NOISE:
                self.assertNotIn(marker, text)
