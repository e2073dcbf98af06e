"""The soak script's 30-second version (bench/soak.py; the 10-minute run is recorded in docs/scaling.md):
all three relays under a steady mix, no refused request, no gap or duplicate across resumes, no
traceback, a clean SIGTERM, and RSS flat once the relay's history has filled."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

from twisted.trial.unittest import TestCase

from tests.support.command import Command

ROOT = Path(__file__).resolve().parents[2]


class Soak(TestCase):
    timeout = 120

    async def test_thirty_seconds_of_everything(self) -> None:
        out = Path(tempfile.mkdtemp()) / "soak.json"
        argv = [sys.executable, str(ROOT / "bench" / "soak.py"), "--seconds", "30", "--interval", "5",
                # 50 events per session fill in ~12 s: the second half of the run is steady state.
                "--aep-buffer", "50", "--json", str(out)]
        broker = importlib.util.find_spec("nostr_relay") is not None or os.environ.get("CI") == "true"
        argv.append("--require-broker" if broker else "--no-broker")  # CI must run the broker too
        soak = Command.start(argv)
        status = await soak.finished(timeout=100)
        summary = json.loads(out.read_text()) if out.exists() else {}
        self.assertEqual(status, 0, soak.stdout.decode() + soak.stderr.decode())
        self.assertEqual(summary["problems"], [])
        samples = summary["samples"]
        self.assertGreaterEqual(len(samples), 5)
        for sample in samples:
            self.assertGreater(sample["aep_delivered_per_s"], 1000)
            self.assertGreater(sample["mcp_round_trips"], 0)
            self.assertGreater(sample["resumes"], 0)
            if broker:
                self.assertGreater(sample["broker_actions"], 0)
        self.assertEqual(summary["broker"], broker)
        self.assertLess(summary["rss_growth_second_half_mib"], 20)

        # Issue 6 acceptance 1 under real traffic: the metrics listener's account matches the clients'.
        totals, metrics = summary["totals"], summary["metrics"]
        ingested = metrics["relayd_events_ingested_total"]["aep"]
        self.assertLessEqual(ingested, totals["aep_posted"])
        self.assertGreater(ingested, totals["aep_posted"] - 50)  # WebSocket sends still in flight at the end
        delivered = metrics["relayd_events_delivered_total"]["aep"]
        self.assertGreaterEqual(delivered, totals["aep_delivered"])
        self.assertLessEqual(delivered, totals["aep_delivered"] + totals["aep_resumed_events"] + 500)
        self.assertGreaterEqual(sum(metrics["relayd_replays_total"].values()), totals["aep_resumes"] - 10)
        for relay in ("aep", "mcp") + (("broker",) if broker else ()):
            self.assertGreater(metrics["relayd_http_requests_total"][relay], 0)
        if broker:
            self.assertEqual(metrics["relayd_broker_actions_total"]["message.post/succeeded"], totals["broker_actions"])
            self.assertEqual(metrics["relayd_nostr_relay_connections"]["ready"], 1)
