"""Issue 6 acceptance 3, against a real ``twistd -n relayd``: TLS end to end with a certificate made by
the test; a ``systemd:`` listener on a socket inherited the way systemd passes it (fd 3, LISTEN_FDS,
LISTEN_PID) with READY=1 / STOPPING=1 on a real NOTIFY_SOCKET; a PROXY-protocol header's source in the
access log."""

from __future__ import annotations

import json
import re
import signal
import socket
import tempfile
from pathlib import Path
from typing import Any

import treq
from treq.client import HTTPClient
from twisted.internet import reactor, ssl
from twisted.internet.defer import DeferredQueue
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import DatagramProtocol
from twisted.trial.unittest import TestCase
from twisted.web.client import Agent, BrowserLikePolicyForHTTPS, HTTPConnectionPool

from tests.support.aep import event, ndjson
from tests.support.raw import RawClient
from tests.support.tls import make_pki
from tests.support.twistd import SYSTEMD_WRAPPER, RelaydProcess
from tests.support.ws import WSClient

TIMEOUT = 10.0
TOKEN = "tls-e2e-token-123"


class _Notifications(DatagramProtocol):
    def __init__(self) -> None:
        self.queue: DeferredQueue[bytes] = DeferredQueue()

    def datagramReceived(self, data: bytes, addr: Any) -> None:
        self.queue.put(data)

    async def next(self) -> bytes:
        d = self.queue.get()
        d.addTimeout(TIMEOUT, reactor)
        return await d


class TLSEndToEnd(TestCase):
    timeout = 60

    async def test_https_sse_and_wss_with_a_test_certificate(self) -> None:
        tmp = Path(tempfile.mkdtemp())
        pki = make_pki(tmp)
        proc = await RelaydProcess.start_for(
            self,
            [
                "--aep-listen", f"ssl:0:interface=127.0.0.1:privateKey={pki.key}:certKey={pki.cert}",
                "--no-mcp",
            ],
            env={"AEP_TOKEN": TOKEN},
        )
        port = proc.port("aep")
        trust = ssl.Certificate.loadPEM(pki.ca_pem)
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(pool.closeCachedConnections)
        client = HTTPClient(Agent(reactor, contextFactory=BrowserLikePolicyForHTTPS(trustRoot=trust), pool=pool))
        base = f"https://localhost:{port}"
        auth = {"authorization": f"Bearer {TOKEN}"}

        stream = await client.get(base + '/stream?filter={"session":"T"}', headers=auth, unbuffered=True)
        self.assertEqual(stream.code, 200)
        received = DeferredQueue()
        done = treq.collect(stream, received.put)

        ws = await WSClient.connect(
            f"wss://localhost:{port}/socket", auth,
            context_factory=ssl.optionsForClientTLS("localhost", trustRoot=trust),
        )
        await ws.hello(role="consumer", identity={"agent": "tls"})
        ws.send({"type": "subscribe", "id": 1, "filter": {"session": "T"}})
        self.assertEqual((await ws.recv())["type"], "subscribed")

        posted = await client.post(
            base + "/events", data=ndjson(event("T", 0)),
            headers={**auth, "aep-version": "0.1", "content-type": "application/x-ndjson"},
        )
        self.assertEqual(posted.code, 202)
        await treq.content(posted)
        text = b""
        while b"id: T:0:0" not in text:
            d = received.get()
            d.addTimeout(TIMEOUT, reactor)
            text += await d
        self.assertEqual((await ws.recv())["id"], "T-0-session.started")

        # The same port refuses plain HTTP (no TLS handshake, no answer).
        raw = RawClient()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), raw)
        raw.transport.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        await raw.closed
        self.assertNotIn(b"HTTP/1.1 200", raw.received)

        await ws.close()
        status = await proc.terminate(signal.SIGTERM)
        await done
        self.assertEqual(status, 0)
        self.assertNotIn(b"Traceback", proc.log)


class SystemdAndProxy(TestCase):
    timeout = 60

    async def test_inherited_socket_ready_stopping_and_proxy_source_in_access_log(self) -> None:
        tmp = Path(tempfile.mkdtemp())
        notify_path = str(tmp / "notify")
        notifications = _Notifications()
        notify_port = reactor.listenUNIXDatagram(notify_path, notifications)
        self.addCleanup(notify_port.stopListening)

        inherited = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        inherited.bind(("127.0.0.1", 0))
        inherited.listen(64)
        self.addCleanup(inherited.close)
        systemd_port = inherited.getsockname()[1]

        proc = await RelaydProcess.start_for(
            self,
            [
                "--aep-listen", "systemd:domain=INET:name=relayd-aep",
                "--aep-listen", "haproxy:tcp:0:interface=127.0.0.1",
                "--no-mcp",
            ],
            env={"NOTIFY_SOCKET": notify_path},
            wait_for=(),
            wrapper=SYSTEMD_WRAPPER,
            child_fds={3: inherited.fileno()},
        )
        ready = await notifications.next()
        self.assertTrue(ready.startswith(b"READY=1\n"), ready)
        # READY comes only once both listeners are bound: both are in the log already.
        ports = [int(p) for p in re.findall(rb'aep listening on https?://[^\s"]+:(\d+)', proc.log)]
        self.assertEqual(len(ports), 2)
        self.assertEqual(ports[0], systemd_port)
        proxy_port = ports[1]

        pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(pool.closeCachedConnections)
        response = await treq.get(f"http://127.0.0.1:{systemd_port}/healthz", pool=pool)
        self.assertEqual(json.loads(await treq.content(response))["ok"], True)

        raw = RawClient()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", proxy_port), raw)
        raw.transport.write(
            b"PROXY TCP4 203.0.113.7 127.0.0.1 51234 8787\r\n"
            b"GET /healthz?access_token=proxy-secret HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        )
        await raw.closed
        self.assertIn(b"HTTP/1.1 200", raw.received)
        line = await proc.wait_for(rb'aep 203\.0\.113\.7 "GET /healthz" 200 \d+')
        self.assertNotIn(b"?", line.group(0))

        status = await proc.terminate(signal.SIGTERM)
        self.assertEqual(await notifications.next(), b"STOPPING=1")
        self.assertEqual(status, 0)
        self.assertNotIn(b"proxy-secret", proc.log)
        self.assertNotIn(b"Traceback", proc.log)
