"""End to end: a real ``twistd -n relayd`` with a WebSocket emitter and an SSE consumer (issue 2, item 5)."""

from __future__ import annotations

import json
import signal

import treq
from twisted.internet import reactor
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from tests.support.aep import event
from tests.support.sse import SSEClient
from tests.support.twistd import RelaydProcess
from tests.support.ws import WSClient

TOKEN = "e2e-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class TwistdAEP(TestCase):
    timeout = 60

    async def test_events_and_a_command_then_sigterm_drains(self) -> None:
        proc = await RelaydProcess.start_for(
            self,
            ["--aep-listen", "tcp:0:interface=127.0.0.1", "--no-mcp"], env={"AEP_TOKEN": TOKEN}
        )
        port = proc.port("aep")
        base = f"http://127.0.0.1:{port}"

        consumer = await SSEClient.connect(base + '/stream?filter={"session":"S"}', AUTH)
        self.assertEqual(consumer.code, 200)
        emitter = await WSClient.connect(f"ws://127.0.0.1:{port}/socket", AUTH)
        hello = await emitter.hello(
            role="emitter", identity={"agent": "agent-1"}, capabilities={"control": {"accepts": ["control.pause"]}}
        )
        self.assertEqual(hello["type"], "hello")
        emitter.send(event("S", 0, "session.started"))
        first = await consumer.next_event()
        self.assertEqual((first.event, first.id), ("session.started", "S:0:0"))

        sender = await WSClient.connect(f"ws://127.0.0.1:{port}/socket", AUTH)
        await sender.hello(role="consumer", identity={"agent": "operator"})
        command = event("S", None, "control.pause", id="cmd-1", agent="operator")
        sender.send(command)
        routed = await emitter.recv()
        self.assertEqual(routed, command)  # the bare envelope reaches the owner
        audit = await consumer.next_event()
        self.assertEqual(audit.event, "control.pause")
        self.assertIsNone(audit.id)  # commands carry no SSE id
        emitter.send(event("S", 1, "control.accepted", cause="cmd-1", data={}))
        ack = await consumer.next_event()
        self.assertEqual((ack.event, ack.json()["cause"]), ("control.accepted", "cmd-1"))

        pool = HTTPConnectionPool(reactor, persistent=False)
        response = await treq.post(
            base + "/events",
            pool=pool,
            data=json.dumps(event("S", 2, "session.ended")).encode(),
            headers={**AUTH, "aep-version": "0.1", "content-type": "application/json"},
        )
        self.assertEqual(response.code, 202)
        await treq.content(response)
        self.assertEqual((await consumer.next_event()).event, "session.ended")

        status = await proc.terminate(signal.SIGTERM)
        rest = await consumer.read_until_end()
        self.assertIn("shutting-down", [m.comment for m in rest])
        code, _ = await emitter.closed
        self.assertEqual(code, 1001)
        self.assertEqual(status, 0)
        self.assertNotIn(b"Traceback", proc.log)
        self.assertNotIn(TOKEN.encode(), proc.log)

    async def test_invalid_configuration_exits_2_with_one_line(self) -> None:
        proc = await RelaydProcess.start(["--aep-buffer", "lots"], wait_for=())
        status = await proc.exited
        self.assertEqual(status, 2)
        lines = [line for line in proc.log.decode().splitlines() if line.strip()]
        self.assertEqual(lines, ["relayd: error: --aep-buffer: 'lots' must be an integer"])

    async def test_invalid_environment_names_the_variable(self) -> None:
        proc = await RelaydProcess.start([], env={"AEP_MAX_SESSIONS": "-3"}, wait_for=())
        status = await proc.exited
        self.assertEqual(status, 2)
        self.assertIn(b"AEP_MAX_SESSIONS", proc.log)
        self.assertNotIn(b"Traceback", proc.log)
