"""relayd side by side with its peers (a benchmark, not a test; issue 24): the Node AEP reference relay
and nginx with the Nchan module, on the load real clients make.

    python bench/peers.py --node-relay DIR --install                 # every scenario, 3 rounds
    python bench/peers.py --node-relay DIR sdk single --rounds 5     # a selection
    AEP_NODE_RELAY=DIR python bench/peers.py --floors                # and bench/http_floor.py's floors

For each scenario and round the sides run one after the other, each on a fresh server process
(``bench/aep.py SCENARIO``, which starts ``twistd -n relayd`` itself, or ``bench/aep.py SCENARIO
--target-cmd ...`` for a peer), the order of the sides rotating from round to round. It prints each
run as a JSON line as it finishes, then per scenario the median of each side and the ratios
relayd/Node and relayd/Nchan against the issue's target.

The peers (nothing in relayd depends on them; CI does not install them):

- **Node**: the reference relay in ``--node-relay DIR`` (or ``$AEP_NODE_RELAY``), a copy of the
  relay vendored in the AEP TypeScript SDK with its schemas. The driver copies DIR to a temporary
  directory, runs ``npm ci`` there and starts ``node server.cjs`` from ``test/fixtures/relay`` per
  run, as that directory's README says (auth off, the bench's buffer settings). It validates every
  event against the AEP schemas, buffers it per session, filters and resumes as relayd does.
- **Nchan**: nginx (Debian ``nginx-light``) with ``libnginx-mod-nchan``, installed with apt-get
  when missing and ``--install`` is given. One process (``master_process off``: the CPU measured is
  the one worker's), a publisher at ``/events`` and an EventSource subscriber at ``/stream`` on one
  channel, a static ``/healthz``. It does no AEP work: a POST body (one event or a batch of 100) is
  one message, stored and sent to every subscriber as it is; filters and resume positions are
  ignored (the query string names no channel), a new subscriber gets the channel's buffered
  messages (``nchan_subscriber_first_message oldest``, ``nchan_message_buffer_length 5``).

A peer that cannot run a scenario is reported as n/a (``--redis`` and ``--trust-forwarded-for``
variants are relayd's alone; their ratios are against Node's plain ``single``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
AEP = BENCH / "aep.py"


@dataclass(frozen=True)
class Scenario:
    """One row: the bench/aep.py scenario, the figure taken from its result, and the issue's target."""

    name: str
    label: str
    metric: str
    unit: str
    target: str
    # Which peer the target compares with, and the most relayd may be as a multiple of it.
    against: str | None = None
    bound: float | None = None
    sides: tuple[str, ...] = ("relayd", "node", "nchan")
    # Node's settings for the run (relayd's scenario flags, in Node's environment names).
    node_env: tuple[tuple[str, str], ...] = ()
    pick: tuple[tuple[str, Any], ...] = ()  # which JSON line, when the scenario prints several
    compare_with: str | None = None  # another scenario whose peer medians the ratios use
    extra: tuple[str, ...] = field(default=())  # more figures to show
    # relayd alone against a figure (no peer has an MCP endpoint): the most (or with at_least the
    # least) the metric may be.
    limit: float | None = None
    at_least: bool = False
    script: str = "aep.py"
    args: tuple[str, ...] = ()


INGEST_ENV = (("AEP_BUFFER", "1000"), ("AEP_MAX_SESSIONS", "64"))

SCENARIOS = [
    Scenario("sdk", "SDK-shaped ingest: a connection per event (`Connection: close`, `application/json`), "
             "8 concurrent", "server_cpu_us_per_event", "µs/event", "≤ 0.5× Node", "node", 0.5,
             node_env=INGEST_ENV, extra=("events_per_s",)),
    Scenario("single", "one event per POST, 8 keep-alive connections", "server_cpu_us_per_event", "µs/event",
             "≤ 0.5× Node", "node", 0.5, node_env=INGEST_ENV, extra=("events_per_s",)),
    Scenario("single-xff", "the same, `--trust-forwarded-for 1`, `X-Forwarded-For` on every POST",
             "server_cpu_us_per_event", "µs/event", "≤ 0.7× Node (single)", "node", 0.7, sides=("relayd",),
             compare_with="single"),
    Scenario("single-redis", "the same, `--redis` (redis-server's CPU not counted)", "server_cpu_us_per_event",
             "µs/event", "≤ 0.7× Node (single)", "node", 0.7, sides=("relayd",), compare_with="single",
             extra=("redis_cpu_us_per_event",)),
    Scenario("fanout-single", "fan-out to 1 000 SSE subscribers, one event per POST, 100/s",
             "server_cpu_us_per_delivery", "µs/delivery", "≤ 1.0× Nchan", "nchan", 1.0, extra=("p99_ms",)),
    Scenario("storm", "5 000 SSE subscribers connect at once and are primed (filter, resume 5 back)", "wall_s",
             "s", "≤ 2× Nchan and ≤ Node; `/healthz` p99 ≤ 50 ms", "nchan", 2.0,
             extra=("primed", "healthz_p99_ms", "server_cpu_us_per_stream", "stream_p50_s", "reconnects")),
    Scenario("storm-backlog511", "the same, relayd listening with Node's and nginx's backlog (511; Twisted's is 50)",
             "wall_s", "s", "≤ 2× Nchan and ≤ Node (storm)", "nchan", 2.0, sides=("relayd",), compare_with="storm",
             extra=("primed", "healthz_p99_ms", "server_cpu_us_per_stream", "stream_p50_s", "reconnects")),
    Scenario("ingest", "batched NDJSON ingest, 100 events per POST, 8 keep-alive connections",
             "server_cpu_us_per_event", "µs/event", "≤ 0.6× Node", "node", 0.6, node_env=INGEST_ENV,
             extra=("events_per_s",)),
    Scenario("idle", "idle SSE connection (5 000 held)", "kb_per_connection", "KB", "≤ 0.5× Nchan", "nchan", 0.5,
             pick=(("connections", 5000),)),
]

MCP_SCENARIOS = [  # --mcp: relayd's MCP endpoint (issue 24 target 6; no peer has one)
    Scenario("rt-endpoint", "MCP endpoint, 100 Streamable HTTP clients, closed loop", "round_trips_per_s",
             "round trips/s", "≥ 4 000/s", limit=4000, at_least=True, sides=("relayd",), script="mcp.py",
             extra=("server_cpu_per_rt_us", "p99_ms")),
    Scenario("latency-endpoint", "MCP endpoint, 100 clients paced to 2 000 round trips/s", "p99_ms", "ms p99",
             "≤ 10 ms", limit=10, sides=("relayd",), script="mcp.py", args=("--rate", "2000"),
             extra=("round_trips_per_s", "server_cpu_per_rt_us")),
    Scenario("rt-endpoint-cpu", "MCP endpoint, server CPU per round trip (rt-endpoint)", "server_cpu_per_rt_us",
             "µs/round trip", "≤ 250 µs", limit=250, sides=("relayd",), script="mcp.py"),
]

# bench/http_floor.py's floors (with --floors) and the scenarios each runs on.
FLOOR_SCENARIOS = {
    "floor-protocol": ("sdk", "single"),
    "floor-shortcuts": ("sdk", "single"),
    "floor-web": ("sdk", "single"),
    "floor-redis": ("single-redis",),
}
FLOORS = tuple(FLOOR_SCENARIOS)


# The peers ----------------------------------------------------------------------------------------


def prepare_node(source: Path, into: Path) -> Path:
    """Copy the Node relay to C{into} and install its locked dependencies; the directory to start it in."""
    if not (source / "test/fixtures/relay/server.cjs").exists():
        raise SystemExit(f"--node-relay {source}: no test/fixtures/relay/server.cjs there (see its README)")
    if shutil.which("node") is None or shutil.which("npm") is None:
        raise SystemExit("the Node relay needs node and npm (Node 20 or later)")
    relay = into / "node-relay"
    shutil.copytree(source, relay)
    relay.chmod(0o755)
    for path in relay.rglob("*"):  # a read-only source copies read-only: npm writes beside it
        path.chmod(0o755 if path.is_dir() else 0o644)
    subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=relay, check=True)
    return relay / "test/fixtures/relay"


NCHAN_MODULE = Path("/usr/lib/nginx/modules/ngx_nchan_module.so")

# One process, everything under the run's directory; @PORT@ is the run's port, @DIR@ the directory.
NGINX_CONF = """\
load_module @MODULE@;
daemon off;
master_process off;
worker_processes 1;
pid @DIR@/nginx.pid;
error_log @DIR@/error.log warn;
events { worker_connections 20000; }
worker_rlimit_nofile 20000;
http {
    access_log off;
    client_body_temp_path @DIR@/body;
    proxy_temp_path @DIR@/proxy;
    fastcgi_temp_path @DIR@/fastcgi;
    uwsgi_temp_path @DIR@/uwsgi;
    scgi_temp_path @DIR@/scgi;
    keepalive_requests 1000000;
    client_max_body_size 16m;
    client_body_buffer_size 1m;
    nchan_message_buffer_length 5;
    server {
        listen 127.0.0.1:@PORT@ backlog=511;
        location = /events {
            nchan_publisher;
            nchan_channel_id aep;
        }
        location = /stream {
            nchan_subscriber eventsource;
            nchan_channel_id aep;
            nchan_subscriber_first_message oldest;
        }
        location = /healthz {
            default_type application/json;
            return 200 '{"ok":true}';
        }
    }
}
"""


def install_nchan() -> None:
    """apt-get install nginx-light and libnginx-mod-nchan (Debian)."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "nginx-light",
                    "libnginx-mod-nchan"], check=True, env=env)
    # The package starts a system nginx on port 80; the bench runs its own.
    subprocess.run(["sh", "-c", "service nginx stop || true"], check=False, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def prepare_nchan(into: Path, install: bool) -> str:
    """The shell command (C{{port}}: the run's port) that starts nginx + Nchan in the foreground."""
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None or not NCHAN_MODULE.exists():
        if not install:
            raise SystemExit("nginx + Nchan is not installed: give --install (apt-get install nginx-light "
                             "libnginx-mod-nchan), or leave it out with --sides relayd,node")
        install_nchan()
        nginx = "/usr/sbin/nginx"
    root = into / "nchan"
    root.mkdir()
    (root / "nginx.conf.in").write_text(NGINX_CONF.replace("@MODULE@", str(NCHAN_MODULE)))
    # Each run gets its own directory (its config, pid, temp files) under root.
    run = f"{root}/run-{{port}}"
    return (f"mkdir -p {run} && sed -e 's|@PORT@|{{port}}|' -e 's|@DIR@|{run}|' {root}/nginx.conf.in "
            f"> {run}/nginx.conf && exec {nginx} -p {run} -c {run}/nginx.conf -e {run}/error.log")


def node_command(relay: Path, scenario: Scenario) -> str:
    env = " ".join(f"{k}={v}" for k, v in scenario.node_env)
    return f"cd {shlex.quote(str(relay))} && AEP_PORT={{port}} AEP_HOST=127.0.0.1 {env} exec node server.cjs"


def floor_command(mode: str) -> str:
    where = " {redis}" if mode == "redis" else ""  # (the scenario's Redis: bench/aep.py fills it in)
    return f"exec {shlex.quote(sys.executable)} {shlex.quote(str(BENCH / 'http_floor.py'))} {mode} {{port}}{where}"


# Running ------------------------------------------------------------------------------------------


def run_one(scenario: Scenario, side: str, commands: dict[str, str], seconds: float) -> dict[str, Any] | None:
    """One run of bench/aep.py; the scenario's result line, or None when it failed (said on stderr)."""
    argv = [sys.executable, str(BENCH / scenario.script), scenario.name, "--seconds", str(seconds), *scenario.args]
    if side == "node":
        argv += ["--target-cmd", node_command(Path(commands["node"]), scenario)]
    elif side != "relayd":
        argv += ["--target-cmd", commands[side]]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            proc.terminate()  # bench/aep.py then stops the relay it started
            stdout, stderr = proc.communicate(timeout=60)
            stderr += "\n(stopped after 900 s)"
    done = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    lines = [line for line in lines if all(line.get(k) == v for k, v in scenario.pick)]
    if done.returncode != 0 or not lines:
        sys.stderr.write(f"{scenario.name} on {side} failed ({done.returncode}):\n{done.stderr[-3000:]}\n")
        return None
    result: dict[str, Any] = lines[-1]
    for key, value in result.items():
        if isinstance(value, list) and len(value) == 1:  # bench/mcp.py: one figure per instance
            result[key] = value[0]
    return result


def source(scenario: Scenario) -> str:
    """The scenario whose runs a row reads (rt-endpoint-cpu is a second figure of rt-endpoint's)."""
    return scenario.name.removesuffix("-cpu")


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


def verdict(scenario: Scenario, ratios: dict[str, float | None], relayd: float | None,
            extras: dict[str, float | None]) -> str:
    if scenario.limit is not None:
        if relayd is None:
            return "not measured"
        return "met" if (relayd >= scenario.limit if scenario.at_least else relayd <= scenario.limit) else "missed"
    if scenario.against is None or scenario.bound is None:
        return ""
    ratio = ratios.get(scenario.against)
    if ratio is None:
        return "not measured"
    met = ratio <= scenario.bound
    if scenario.name.startswith("storm"):
        node = ratios.get("node")
        met = met and (node is None or node <= 1.0)
        p99, primed = extras.get("healthz_p99_ms"), extras.get("primed")
        met = met and p99 is not None and p99 <= 50 and primed == 5000
    return "met" if met else "missed"


def table(results: dict[tuple[str, str], list[dict[str, Any]]], scenarios: list[Scenario],
          sides: list[str]) -> str:
    """The markdown summary: per scenario, each side's median and the runs, the ratios, the verdict."""
    rows = ["| scenario | unit | " + " | ".join(sides) + " | relayd/Node | relayd/Nchan | target | verdict |",
            "|---|---|" + "---|" * len(sides) + "---|---|---|---|"]
    medians: dict[tuple[str, str], float | None] = {}
    for s in SCENARIOS + MCP_SCENARIOS:
        for side in ("relayd", "node", "nchan", *FLOORS):
            medians[s.name, side] = median([r[s.metric] for r in results.get((source(s), side), [])])
    for s in scenarios:
        cells = []
        for side in sides:
            runs = [r[s.metric] for r in results.get((source(s), side), [])]
            cells.append(f"{fmt(median(runs))} ({', '.join(fmt(v) for v in runs)})" if runs else "n/a")
        base = s.compare_with or s.name
        relayd = medians[s.name, "relayd"]
        ratios: dict[str, float | None] = {}
        for peer in ("node", "nchan"):
            other = medians.get((base, peer))
            ratios[peer] = relayd / other if relayd is not None and other else None
        extras = {k: median([r[k] for r in results.get((source(s), "relayd"), []) if k in r]) for k in s.extra}
        rows.append(f"| {s.label} | {s.unit} | " + " | ".join(cells)
                    + f" | {fmt(ratios['node'])} | {fmt(ratios['nchan'])} | {s.target} | "
                    + f"{verdict(s, ratios, relayd, extras)} |")
    return "\n".join(rows)


def extras_table(results: dict[tuple[str, str], list[dict[str, Any]]], scenarios: list[Scenario],
                 sides: list[str]) -> str:
    """The other figures of each scenario (throughput, p99, /healthz ...), medians per side."""
    rows = ["| scenario | figure | " + " | ".join(sides) + " |", "|---|---|" + "---|" * len(sides)]
    for s in scenarios:
        for key in s.extra:
            cells = []
            for side in sides:
                values = [r[key] for r in results.get((source(s), side), []) if key in r]
                cells.append(fmt(median(values)) if values else "n/a")
            rows.append(f"| {s.name} | {key} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def read_runs(path: Path) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """The runs of a C{--json} file, by (scenario, side), in their order."""
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for line in path.read_text().splitlines():
        run = json.loads(line)
        results.setdefault((run["scenario"], run["side"]), []).append(run)
    return results


def print_tables(results: dict[tuple[str, str], list[dict[str, Any]]], scenarios: list[Scenario],
                 sides: list[str]) -> None:
    print(table(results, scenarios, sides))
    print()
    print(extras_table(results, scenarios, sides))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*", help="of: " + ", ".join(s.name for s in SCENARIOS))
    parser.add_argument("--node-relay", metavar="DIR", default=os.environ.get("AEP_NODE_RELAY"),
                        help="the Node AEP reference relay's directory (default: $AEP_NODE_RELAY)")
    parser.add_argument("--install", action="store_true",
                        help="apt-get install nginx-light and libnginx-mod-nchan when missing")
    parser.add_argument("--sides", default="relayd,node,nchan", help="comma-separated: relayd, node, nchan")
    parser.add_argument("--floors", action="store_true",
                        help="also bench/http_floor.py's floors: protocol, shortcuts and web on sdk and single, redis on "
                             "single-redis")
    parser.add_argument("--mcp", action="store_true", help="also relayd's MCP endpoint (bench/mcp.py rt-endpoint, "
                        "latency-endpoint --rate 2000; target 6), relayd alone")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="per timed scenario run")
    parser.add_argument("--json", metavar="FILE", help="append every run's result here as JSON lines")
    parser.add_argument("--from-json", metavar="FILE", help="run nothing: print the tables of the runs in FILE "
                        "(written by --json)")
    args = parser.parse_args()
    known = {s.name: s for s in SCENARIOS + MCP_SCENARIOS}
    unknown = [name for name in args.scenarios if name not in known]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; known: {', '.join(known)}")
    scenarios = [known[name] for name in args.scenarios] if args.scenarios else list(SCENARIOS)
    if args.mcp:
        scenarios += [s for s in MCP_SCENARIOS if s not in scenarios]
    sides = [side.strip() for side in args.sides.split(",") if side.strip()]
    if set(sides) - {"relayd", "node", "nchan"}:
        parser.error("--sides takes relayd, node and nchan")
    if args.from_json:
        print_tables(read_runs(Path(args.from_json)), scenarios, sides + (list(FLOORS) if args.floors else []))
        return
    workdir = Path(tempfile.mkdtemp(prefix="relayd-peers-"))
    commands: dict[str, str] = {}
    try:
        if "node" in sides:
            if not args.node_relay:
                parser.error("the Node side needs --node-relay DIR (or $AEP_NODE_RELAY); or --sides relayd,nchan")
            commands["node"] = str(prepare_node(Path(args.node_relay).resolve(), workdir))
        if "nchan" in sides:
            commands["nchan"] = prepare_nchan(workdir, args.install)
        every = sides + (list(FLOORS) if args.floors else [])
        for floor in FLOORS:
            commands[floor] = floor_command(floor.split("-", 1)[1])
        results: dict[tuple[str, str], list[dict[str, Any]]] = {}
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        for r in range(args.rounds):
            for s in scenarios:
                if source(s) != s.name:
                    continue  # another figure of a scenario that runs anyway
                order = [side for side in every if side in s.sides
                         or s.name in FLOOR_SCENARIOS.get(side, ())]
                order = order[r % len(order):] + order[: r % len(order)]  # rotate: each side goes first in turn
                for side in order:
                    result = run_one(s, side, commands, args.seconds)
                    if result is None:
                        continue
                    results.setdefault((s.name, side), []).append(result)
                    line = json.dumps({"round": r + 1, "side": side, **result})
                    print(line, flush=True)
                    if args.json:
                        with open(args.json, "a") as out:
                            out.write(line + "\n")
        print(f"\n{args.rounds} rounds from {started}, load average now "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; medians (the runs in order)\n")
        print_tables(results, scenarios, every)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
