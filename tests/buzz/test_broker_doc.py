"""docs/broker.md says what the code does: the statements a test can check, checked against the code."""

from __future__ import annotations

import os
import re

from twisted.trial import unittest

from relayd.base.config import ConfigError
from relayd.buzz import config
from relayd.buzz.core import contract, state
from relayd.buzz.http import UNAUTHENTICATED_BODY_LIMIT
from relayd.buzz.nostr_upstream import NostrRelayPool
from relayd.buzz.service import check_listeners

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "broker.md")


def _doc() -> str:
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def _section(doc: str, title: str) -> str:
    start = doc.index(title)
    end = doc.find("\n## ", start + len(title))
    return doc[start : end if end >= 0 else len(doc)]


def _rows(table_text: str) -> dict[str, str]:
    """First cell -> whole row, for the Markdown table rows of C{table_text}."""
    rows = {}
    for line in table_text.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = line
    return rows


class BrokerDoc(unittest.TestCase):
    def test_every_setting_is_documented_with_its_default(self) -> None:
        rows = _rows(_section(_doc(), "## Setup"))
        for setting in config.SETTINGS:
            name = f"--{setting.name}"
            row = next((r for k, r in rows.items() if k.startswith(f"`{name}`")), None)
            assert row is not None, f"{name} missing from the settings table"
            default = setting.default
            if isinstance(default, bool) or default is None:
                continue
            if isinstance(default, (int, float)) and not isinstance(default, bool):
                text = f"{default:g}" if isinstance(default, float) else str(default)
                assert f"`{text}`" in row, (name, default, row)

    def test_every_code_is_in_the_verdict_table(self) -> None:
        rows = _rows(_section(_doc(), "### Verdict codes"))
        documented = {m for k in rows for m in re.findall(r"`([a-z_]+)`", k)}
        assert set(contract.CODES) <= documented, set(contract.CODES) - documented

    def test_limits_table_matches_the_code(self) -> None:
        doc = _doc()
        limits = _rows(_section(doc, "## Limits"))
        assert f"{contract.MAX_CONTENT_BYTES:,}" in limits["`content`"]
        assert f"1-{contract.MAX_REQUEST_ID}" in limits["`requestId`"]
        assert f"1-{contract.MAX_MENTIONS}" in limits["`mentions`"]
        assert f"{contract.MAX_ERROR}" in limits["error messages"] and f"{contract.MAX_ECHO}" in limits["error messages"]
        assert f"{contract.MAX_DEPTH} levels" in limits["JSON nesting"]
        assert f"{state.STAMPS_PER_SECOND:,}" in limits["events of one identity in one second"]
        assert f"{state.RECEIPT_RETENTION // 86400} days" in limits["receipts"]
        assert f"{state.WAL_LIMIT // 2**20} MiB" in limits["SQLite WAL"]
        unread = limits["body read without a valid credential"]
        assert f"{UNAUTHENTICATED_BODY_LIMIT:,} bytes ({UNAUTHENTICATED_BODY_LIMIT // 1024} KiB)" in unread
        import inspect

        recycle = inspect.signature(NostrRelayPool.__init__).parameters["recycle_after"].default
        assert f"after {recycle} failed" in limits["relay connection"]
        assert f"`cursor` ≤ {contract.MAX_CURSOR}" in limits["`channel.read` page"]
        assert f"1-{contract.MAX_LIMIT}, default {contract.DEFAULT_LIMIT}" in limits["`channel.read` page"]

    def test_listeners_the_page_allows_are_the_ones_relayd_allows(self) -> None:
        row = _rows(_section(_doc(), "## Setup"))["`--broker-listen` / `RELAYD_BROKER_LISTEN`"]
        for kind in ("ssl:", "tls:", "le:", "lets:", "unix:", "systemd:"):
            assert f"`{kind}`" in row, kind
        check_listeners(["tcp:8789:interface=127.0.0.1", "tcp:8789:interface=\\:\\:1", "unix:/tmp/broker.sock"])
        for refused in ("tcp:8789", "tcp:8789:interface=0.0.0.0", "systemd:domain=INET:index=0"):
            with self.assertRaises(ConfigError):
                check_listeners([refused])  # no socket was inherited here: refused, not assumed loopback

    def test_file_modes_and_recorded_verdicts_are_stated(self) -> None:
        doc = _doc()
        # Checked by test_faults.StateFiles (0600 from the first start) and EveryVerdictRecorded.
        assert "`-wal` and `-shm` files" in doc and "0600" in doc
        recorded = _section(doc, "### Idempotency and retries")
        for code in ("invalid_request", "unknown_action", "unauthorized", "action_failed"):
            assert code in recorded.split("Not\nrecorded")[0], code
        assert "`unauthenticated`" in recorded.split("Not\nrecorded")[1]
