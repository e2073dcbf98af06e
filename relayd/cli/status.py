"""C{relayd-admin status}: health and counts of a running relayd.

    relayd-admin status [--aep URL] [--mcp URL] [--broker URL] [--metrics URL]

Each relay's C{/healthz}, and with C{--metrics} a summary of the metrics listener's counts.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
from typing import Any, Callable

from relayd.base.clock import BlockingClock
from relayd.cli.client import CACERT_HELP, DEFAULT_AEP, DEFAULT_BROKER, DEFAULT_MCP, Target, auth, request


def add_parser(tools: Any) -> None:
    """Add C{status} to C{relayd-admin}'s subcommands (C{tools})."""
    cmd = tools.add_parser("status", help="Health and counts of a running relayd")
    cmd.add_argument("--aep", metavar="URL", help=f"AEP relay URL [default: {DEFAULT_AEP}]")
    cmd.add_argument("--mcp", metavar="URL", help=f"MCP relay URL [default: {DEFAULT_MCP}]")
    cmd.add_argument("--broker", metavar="URL", help=f"Broker URL [default: {DEFAULT_BROKER}]")
    cmd.add_argument("--metrics", metavar="URL", help="Metrics listener URL (adds counts from /metrics)")
    cmd.add_argument("--token", help="AEP token, to see its counts [default: $AEP_TOKEN]")
    cmd.add_argument("--json", action="store_true", help="Machine-readable output")
    cmd.add_argument("--cacert", metavar="FILE", help=CACERT_HELP)
    cmd.set_defaults(run=status, prog=cmd.prog)


def status(args: argparse.Namespace, clock: BlockingClock) -> int:
    """C{relayd-admin status}: one line (or JSON member) per relay, exit 1 when a relay asked for is down."""
    explicit = any((args.aep, args.mcp, args.broker))
    checks: list[tuple[str, str, Callable[[Target], dict[str, Any]]]] = []
    token = args.token or os.environ.get("AEP_TOKEN") or None
    if args.aep or not explicit:
        checks.append(("aep", args.aep or DEFAULT_AEP, lambda t: _aep_health(t, token)))
    if args.mcp or not explicit:
        checks.append(("mcp", args.mcp or DEFAULT_MCP, _mcp_health))
    if args.broker or not explicit:
        checks.append(("broker", args.broker or DEFAULT_BROKER, _broker_health))
    report: dict[str, dict[str, Any]] = {}
    for name, url, check in checks:
        try:
            report[name] = {"url": url, "up": True, **check(Target.parse(url, args.cacert))}
        except (OSError, http.client.HTTPException, ValueError) as e:
            report[name] = {"url": url, "up": False, "error": str(e) or type(e).__name__}
    if args.metrics:
        try:
            report["metrics"] = {"url": args.metrics, "up": True, **_metrics_summary(Target.parse(args.metrics, args.cacert))}
        except (OSError, http.client.HTTPException, ValueError) as e:
            report["metrics"] = {"url": args.metrics, "up": False, "error": str(e) or type(e).__name__}
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        for name, item in report.items():
            state = "up" if item["up"] else ("not running" if not explicit and name != "metrics" else "DOWN")
            if item.get("status") == "degraded":
                state = "degraded"  # answering, but cannot do its work (the broker's relay is unreachable)
            details = " ".join(
                f"{k}={v}" for k, v in _flat(item) if k not in ("url", "up") and not (k == "status" and v == state)
            )
            sys.stdout.write(f"{name:<8} {state:<12} {item['url']:<28} {details}\n")
    relays = [item["up"] for name, item in report.items() if name != "metrics"]
    if explicit or args.metrics:
        return 0 if all(item["up"] for item in report.values()) else 1
    return 0 if any(relays) else 1


def _aep_health(target: Target, token: str | None) -> dict[str, Any]:
    status, body = request(target, "GET", "/healthz", headers=auth(token), timeout=5)
    if status != 200:
        raise ValueError(f"/healthz answered {status}")
    health = json.loads(body)
    if token and "sessions" not in health:
        health["note"] = "token refused: counts hidden"
    health.pop("ok", None)
    return health


def _mcp_health(target: Target) -> dict[str, Any]:
    status, _ = request(target, "GET", "/healthz", timeout=5)
    if status != 200:
        raise ValueError(f"/healthz answered {status}")
    return {}


def _flat(item: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """C{item}'s members, a nested object's as C{outer.inner}."""
    out: list[tuple[str, Any]] = []
    for key, value in item.items():
        if isinstance(value, dict):
            out.extend(_flat(value, f"{prefix}{key}."))
        else:
            out.append((prefix + key, value))
    return out


def _broker_health(target: Target) -> dict[str, Any]:
    """The broker's C{/healthz}: C{status} (C{ok}, or C{degraded} while its Nostr relay is
    unreachable) and C{upstream} (which relay, connected, since when, the last error)."""
    status, body = request(target, "GET", "/healthz", timeout=5)
    if status != 200:
        raise ValueError(f"/healthz answered {status}")
    health = json.loads(body)
    health.pop("ok", None)
    return health


_SUMMARY = {
    "relayd_connections": "connections",
    "relayd_sessions": "sessions",
    "relayd_subscribers": "subscribers",
    "relayd_events_ingested_total": "ingested",
    "relayd_events_delivered_total": "delivered",
    "relayd_events_dropped_total": "dropped",
    "process_resident_memory_bytes": "rss_bytes",
    "process_open_fds": "open_fds",
}


def _metrics_summary(target: Target) -> dict[str, Any]:
    path = "" if target.path.endswith("/metrics") else "/metrics"
    status, body = request(target, "GET", path, timeout=5)
    if status != 200:
        raise ValueError(f"/metrics answered {status}")
    totals: dict[str, float] = {}
    for line in body.decode("utf-8").splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _SUMMARY:
            key = _SUMMARY[name]
            totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return {k: int(v) if v.is_integer() else v for k, v in totals.items()}
