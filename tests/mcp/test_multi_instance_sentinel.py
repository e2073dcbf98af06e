"""tests/mcp/test_multi_instance.py's instances on a Redis Sentinel layout (a master, two replicas,
three sentinels; relayd/storage/sentinel.py): the same behaviour, every acknowledged write confirmed
by a replica (issue 25 acceptance 1, MCP)."""

from __future__ import annotations

from tests.mcp import test_multi_instance as standalone
from tests.support.redis import SentinelGroup


class MultiInstanceOnSentinel(standalone.MultiInstanceTests):
    def redis_server_url(self) -> str:
        group = SentinelGroup.start()
        self.addCleanup(group.cleanup)
        return group.url
