#!/usr/bin/env bash
# The Redis tests start their own redis-server on a free port; make sure the binary is there.
set -euo pipefail
command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }
