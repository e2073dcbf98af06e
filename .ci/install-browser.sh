#!/usr/bin/env bash
# Headless Chromium + chromedriver (Debian) and selenium (PyPI) for the MCP wing's real-browser test
# (tests/mcp/test_browser.py). Idempotent; everything offline-safe once installed.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
if ! dpkg -s chromium-driver >/dev/null 2>&1; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends chromium chromium-driver
fi
python -m pip install -q 'selenium==4.51.0'
# Selenium Manager is never run: the test names /usr/bin/chromedriver itself and sets SE_OFFLINE.
