"""The shared-state setting: with C{--redis}, every relay keeps its shared state in Redis."""

from __future__ import annotations

from relayd.config import Setting
from relayd.redis import parse_redis_url, redis_url

SETTINGS = [
    Setting(
        "redis",
        None,
        "Redis URL (redis://[user:password@]host:port/db, rediss:// for TLS) for shared state and "
        "fan-out across relayd instances; without it each process keeps its state in memory",
        parse=redis_url,
        env=("RELAYD_REDIS",),
        secret=True,  # the URL may carry a password: only that is scrubbed from the logs
        secret_part=lambda url: parse_redis_url(url).password,
        metavar="URL",
    ),
    Setting(
        "redis-prefix",
        "relayd:",
        "Prefix of every Redis key relayd writes (several deployments can share one Redis)",
        env=("RELAYD_REDIS_PREFIX",),
        metavar="PREFIX",
    ),
]
