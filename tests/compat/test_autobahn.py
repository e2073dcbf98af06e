"""The fence's autobahn entries (relayd/compat/autobahn.py) on real loopback WebSocket connections:
each state detected on the installed release, and frames arriving the same with the shortcuts off."""

from __future__ import annotations

from typing import Any

from autobahn.twisted.websocket import (
    WebSocketClientFactory,
    WebSocketClientProtocol,
    WebSocketServerFactory,
    WebSocketServerProtocol,
)
from twisted.internet import endpoints, reactor
from twisted.internet.defer import Deferred

from relayd.compat import autobahn as fence
from relayd.compat.autobahn import (
    WS_QUIET_RECEIVE,
    WS_RECEIVE_STATE,
    WS_SEND_STATE,
    ws_data_received,
    ws_frames_direct,
    ws_parser_idle,
)
from relayd.compat.tcp import write_now
from tests.compat.loopback import TIMEOUT, LoopbackCase
from tests.support.cases import cases, expand


class _WSServer(WebSocketServerProtocol):
    def onOpen(self) -> None:
        self.factory.opened.callback(self)


class _WSClient(WebSocketClientProtocol):
    def dataReceived(self, data: bytes) -> None:
        ws_data_received(self, data)

    def onOpen(self) -> None:
        self.factory.opened.callback(self)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        self.factory.messages.append(payload)
        if payload == b"last":
            self.factory.done.callback(None)


@expand
class WebSockets(LoopbackCase):
    async def pair(self) -> tuple[Any, Any]:
        server_factory = WebSocketServerFactory()
        server_factory.protocol = _WSServer
        server_factory.opened = Deferred()
        port = self.listen(server_factory)
        client_factory = WebSocketClientFactory(f"ws://127.0.0.1:{port}/")
        client_factory.protocol = _WSClient
        client_factory.opened, client_factory.messages, client_factory.done = Deferred(), [], Deferred()
        await endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", port).connect(client_factory)
        server = await server_factory.opened.addTimeout(TIMEOUT, reactor)
        client = await client_factory.opened.addTimeout(TIMEOUT, reactor)
        self.addCleanup(lambda: client.transport.loseConnection())
        return server, client

    def test_autobahn_state_is_detected(self) -> None:
        self.assertTrue(WS_SEND_STATE)
        self.assertTrue(WS_RECEIVE_STATE)
        self.assertTrue(WS_QUIET_RECEIVE)

    async def test_open_connections_show_the_state(self) -> None:
        server, client = await self.pair()
        self.assertIsNone(server._perMessageCompress)
        self.assertEqual(len(server.send_queue), 0)
        self.assertTrue(ws_frames_direct(server))
        self.assertTrue(ws_parser_idle(client))
        self.assertTrue(ws_parser_idle(server))

    @cases(detected=True, fallback=False)
    async def test_frames_arrive_the_same_either_way(self, detected: bool) -> None:
        for flag in ("WS_SEND_STATE", "WS_RECEIVE_STATE", "WS_QUIET_RECEIVE"):
            self.patch(fence, flag, detected)
        server, client = await self.pair()
        self.assertEqual(ws_frames_direct(server), detected)
        self.assertEqual(ws_parser_idle(client), detected)
        for text in (b"first", b"last"):
            message = server.factory.prepareMessage(text)
            if ws_frames_direct(server):
                write_now(server.transport, message.payloadHybi)
            else:
                server.sendPreparedMessage(message)
        await client.factory.done.addTimeout(TIMEOUT, reactor)
        self.assertEqual(client.factory.messages, [b"first", b"last"])

