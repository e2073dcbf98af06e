"""A real ``twistd -n relayd`` writes the access lines of requests answered in one reactor turn with one
write(2) (docs/configuration.md, "Log lines are written once per reactor turn"), and every line is there.

The requests come pipelined on one connection, so relayd reads and answers them in one turn; the
write system calls are the kernel's count for the process (/proc/PID/io, C{syscw}: write(2) and its
kin; an answer leaves by send(2), which it does not count)."""

from __future__ import annotations

import re
import sys

from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.trial.unittest import SkipTest, TestCase

from tests.support.raw import RawClient
from tests.support.twistd import RelaydProcess

REQUESTS = 50


def write_calls(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        found = re.search(r"^syscw: (\d+)$", f.read(), re.M)
    assert found is not None
    return int(found.group(1))


class AccessLinesOncePerTurn(TestCase):
    timeout = 60

    async def test_pipelined_requests_log_every_line_in_a_few_writes(self) -> None:
        if not sys.platform.startswith("linux"):
            raise SkipTest("the write count is Linux's /proc/PID/io")
        proc = await RelaydProcess.start_for(self, ["--aep-listen", "tcp:0:interface=127.0.0.1", "--no-mcp"])
        await proc.wait_for(rb"relayd ready")
        pid = proc.transport.pid
        before, mark = write_calls(pid), len(proc.log)
        client = RawClient()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", proc.port("aep")), client)
        ask = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
        client.transport.write(ask * (REQUESTS - 1) + ask.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        await client.closed
        self.assertEqual(client.received.count(b"HTTP/1.1 200 "), REQUESTS)
        await proc.wait_for(rb'(?s)(?:.*?"GET /healthz" 200 ){%d}' % REQUESTS, since=mark)
        writes = write_calls(pid) - before
        self.assertEqual(proc.log[mark:].count(b'"GET /healthz" 200 '), REQUESTS)
        # One per line before; now one per turn that logged (the connection's answers may span a few).
        self.assertLessEqual(writes, 5, f"{writes} write(2) calls for {REQUESTS} access lines")
        self.assertEqual(await proc.terminate(), 0)
