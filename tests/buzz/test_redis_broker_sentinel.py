"""tests/buzz/test_redis_broker.py's two broker instances on a Redis Sentinel layout (a master, two
replicas, three sentinels; relayd/storage/sentinel.py): the same behaviour, each verdict confirmed by
a replica before it is answered (issue 25 acceptance 1, broker)."""

from __future__ import annotations

from tests.buzz import test_redis_broker as standalone
from tests.support.redis import SentinelGroup


class TwoInstancesOnSentinel(standalone.TwoInstances):
    async def setUp(self) -> None:
        group = SentinelGroup.start()
        self.addCleanup(group.cleanup)
        self.own_redis_url = group.url  # (tests.support.redis.layout_url)
        await super().setUp()
