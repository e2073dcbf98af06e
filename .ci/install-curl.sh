#!/usr/bin/env bash
# curl: tests/test_readme.py runs the README's tour commands as a user pastes them.
set -euo pipefail
command -v curl >/dev/null || { apt-get update -qq && apt-get install -y -qq curl >/dev/null; }
