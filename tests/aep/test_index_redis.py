"""The subscription index serves events that arrive from another instance over Redis too."""

from __future__ import annotations

import uuid

from twisted.trial.unittest import TestCase

from tests.aep.test_index import EvaluationCounting
from tests.support.aep import AEPRelay, start_relay
from tests.support.redis import shared_redis


class OverRedisEvaluationTests(EvaluationCounting, TestCase):
    """Events posted to instance A reach B's subscribers through B's index only."""

    async def relays(self) -> tuple[AEPRelay, AEPRelay]:
        shared = {"redis": shared_redis().url, "redis_prefix": f"test-{uuid.uuid4().hex[:8]}:"}
        return await start_relay(self, **shared), await start_relay(self, **shared)
