"""Access lines in a real ``twistd -n relayd``'s text log, where they go straight into its turn writer
(relayd/logs/access_log.py): every answered request's line, whole, in the order answered, with
Twisted's time prefix of its second, after the start-up lines and before the shutdown ones."""

from __future__ import annotations

import re
import signal

from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from tests.support.raw import exchange
from tests.support.twistd import RelaydProcess

REQUESTS = 60
LINE = re.compile(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d{4} \[relayd\.access#info\] (.*)")


class AccessLinesOfARealTwistd(TestCase):
    timeout = 60

    async def test_every_line_whole_in_order_with_its_second_s_prefix(self) -> None:
        proc = await RelaydProcess.start_for(self, ["--aep-listen", "tcp:0:interface=127.0.0.1", "--no-mcp"])
        port = proc.port("aep")
        pipelined = [b"GET /nope-%d?token=t HTTP/1.1\r\nHost: localhost\r\n\r\n" % n for n in range(REQUESTS)]
        for _ in range(2):  # (two connections, one after the other: two batches of turns)
            answer = await deferToThread(exchange, port, b"".join(pipelined), responses=REQUESTS)
            self.assertEqual([r.status for r in answer.responses], [404] * REQUESTS)
        self.assertEqual(await proc.terminate(signal.SIGTERM), 0)
        lines = proc.log.splitlines()
        access = [n for n, line in enumerate(lines) if b"[relayd.access#info]" in line]
        self.assertEqual(len(access), 2 * REQUESTS)
        listening = max(n for n, line in enumerate(lines) if b"listening on" in line)
        self.assertGreater(access[0], listening)
        self.assertIn(b"Main loop terminated", b"\n".join(lines[access[-1]:]))
        said = []
        for n in access:
            match = LINE.fullmatch(lines[n])
            self.assertIsNotNone(match, lines[n])
            assert match is not None
            said.append(match.group(1))
        self.assertEqual([re.sub(rb" \d+\Z", b"", s) for s in said],
                         [b'aep 127.0.0.1 "GET /nope-%d" 404' % n for n in range(REQUESTS)] * 2)
        self.assertNotIn(b"token=t", proc.log)
