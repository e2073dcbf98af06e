#!/usr/bin/env bash
# The Redis tests start their own redis-server on a free port; make sure the binary is there.
set -euo pipefail
command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }
# redis-cli creates the Redis Cluster the cluster tests run on (tests/support/redis.py RedisCluster).
command -v redis-cli >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-tools >/dev/null; }
