#!/usr/bin/env bash
# Node.js and the npm packages of the MCP endpoint's interop tests (tests/mcp/test_endpoint_node.py):
# the official TypeScript SDK and the MCP Inspector, pinned by tests/mcp/clients/package-lock.json and
# installed into tests/mcp/clients/node_modules. Idempotent; offline-safe once npm's cache holds them.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends nodejs npm
fi
cd "$(dirname "$0")/../tests/mcp/clients"
if [ -d node_modules/@modelcontextprotocol/sdk ] && [ -d node_modules/@modelcontextprotocol/inspector ] \
    && [ node_modules/.package-lock.json -nt package-lock.json ]; then
    exit 0  # already installed from this lock file
fi
# npm install honours the lock file (npm ci refuses this tree: an optional Windows-only dependency
# is left out of the lock by npm itself); --prefer-offline uses npm's cache when it has the packages.
npm install --prefer-offline --no-audit --no-fund --loglevel=error
