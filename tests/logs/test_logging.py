"""JSON-lines observer and the scrubber (unit level; the twistd run is in test_json_logs_e2e.py)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

from twisted.logger import ILogObserver, Logger, LogLevel, LogPublisher, textFileLogObserver
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from relayd.aep.service import LOGS as AEP_LOGS
from relayd.buzz.service import LOGS as BROKER_LOGS
from relayd.logs import access as logs_access
from relayd.logs import json as logs_json
from relayd.logs import scrub
from relayd.mcp.service import LOGS as MCP_LOGS
from tests.support.cases import cases, expand

SECRET = "cfg-secret-0123456789"
scrub.register_secret(SECRET)
# What each wing declares when it is made (make_wing): the relays' names, the broker's credential formats.
for wing in (AEP_LOGS, MCP_LOGS, BROKER_LOGS):
    scrub.declare(wing)


@expand
class ScrubTests(TestCase):
    @cases(*[
        ("GET /stream?access_token=abc123&filter=x", "abc123"),
        ("/s/events?token=tok_zz9&direction=outbound", "tok_zz9"),
        ("authorization: Bearer eyJhbGciOi.xyz", "eyJhbGciOi"),
        ("Authorization: Basic dXNlcjpwYXNz", "dXNlcjpwYXNz"),
        ('{"session":"s1","token":"tok_abcdef"}', "tok_abcdef"),
        ("{'token': b'raw-bytes-token'}", "raw-bytes-token"),
        ("key=nsec1qqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqq", "nsec1qqq"),
        ("issued bzh_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "bzh_AAAA"),
        (f"configured with {SECRET}", SECRET),
        ("redis://:hunter2@127.0.0.1:6379/0", "hunter2"),
        ("redis+sentinel://s1:26379/main?sentinel_password=hunter3", "hunter3"),
        ("ws://h/socket?x=1&access_token%3Dleak", "leak"),
    ])
    def test_scrub_text_removes(self, text: str, leaked: str) -> None:
        clean = scrub.scrub_text(text)
        assert leaked not in clean
        assert scrub.SCRUBBED in clean
        assert scrub.scrub_text(clean) == clean  # idempotent

    def test_scrub_text_leaves_ordinary_text(self) -> None:
        for text in ("aep listening on 127.0.0.1:8787", "monkey=1 sessions=3", "auth on", "GET /healthz 200"):
            assert scrub.scrub_text(text) == text

    def test_secret_field_names(self) -> None:
        for name in ("token", "aep_token", "access-token", "secret", "password", "credential", "Authorization",
                     "cookie", "kek", "secret_key", "api_key", "key", "nsec"):
            assert scrub.is_secret_name(name), name
        for name in ("pubkey", "agent_pubkey", "token_hash", "session", "relay", "keys_count", "monkey"):
            assert not scrub.is_secret_name(name), name


def _event(**fields: object) -> dict:
    e: dict = {"log_format": "hello {who}", "who": "world", "log_namespace": "relayd.aep.http.AEPResource",
               "log_time": 1764460800.25}
    from twisted.logger import LogLevel

    e["log_level"] = LogLevel.info
    e.update(fields)
    return e


@expand
class JSONRecordKeys(TestCase):
    def test_json_record_keys_and_values(self) -> None:
        record = json.loads(logs_json.event_as_json(_event(count=3, raw=b"bytes", nested={"a": [1, 2.5, None]})))
        assert list(record) == ["time", "level", "relay", "event", "namespace", "fields"]
        assert record["time"] == "2025-11-30T00:00:00.250Z"
        assert (record["level"], record["relay"], record["event"]) == ("info", "aep", "hello world")
        assert record["fields"] == {"who": "world", "count": 3, "raw": "bytes", "nested": {"a": [1, 2.5, None]}}

    def test_json_record_relay_from_field_and_namespace(self) -> None:
        assert json.loads(logs_json.event_as_json(_event(relay="mcp")))["relay"] == "mcp"
        assert json.loads(logs_json.event_as_json(_event(log_namespace="relayd.buzz.host")))["relay"] == "broker"
        assert json.loads(logs_json.event_as_json(_event(log_namespace="twisted.internet.base")))["relay"] is None
        assert json.loads(logs_json.event_as_json(_event(log_namespace="relayd.metrics")))["relay"] == "metrics"
        assert json.loads(logs_json.event_as_json(_event(log_namespace="relayd.web.site")))["relay"] is None
        assert json.loads(logs_json.event_as_json(_event(log_namespace="relayd.aepx")))["relay"] is None


class WingDeclarations(TestCase):
    """The plumbing knows no wing: a wing declares its relay's name and its credential formats."""

    def test_a_declared_wing_names_its_records_and_its_secrets_are_scrubbed(self) -> None:
        namespace = f"tests.declared_{id(self)}"
        secret = "issued zqx_0123456789abcdef"
        wing = scrub.WingLogs(namespace, relay="declared", secret_formats=(scrub.SecretFormat(r"\bzqx_[0-9a-f]{16}", "ZQX_"),))
        assert json.loads(logs_json.event_as_json(_event(log_namespace=namespace + ".module")))["relay"] is None
        assert scrub.scrub_text(secret) == secret
        scrub.declare(wing)
        scrub.declare(wing)  # declaring again changes nothing
        assert json.loads(logs_json.event_as_json(_event(log_namespace=namespace + ".module")))["relay"] == "declared"
        assert json.loads(logs_json.event_as_json(_event(log_namespace=namespace)))["relay"] == "declared"
        assert json.loads(logs_json.event_as_json(_event(log_namespace=namespace + "x")))["relay"] is None
        assert scrub.scrub_text(secret) == "issued " + scrub.SCRUBBED
        assert scrub.scrub_text("ZQX_0123456789abcdef") == "ZQX_0123456789abcdef"  # the pattern's own case
        assert [p.pattern for p, _ in scrub._TEXT_PATTERNS].count(r"\bzqx_[0-9a-f]{16}") == 1

    def test_the_wings_declare_the_relay_names_records_had(self) -> None:
        assert {(w.namespace, w.relay) for w in (AEP_LOGS, MCP_LOGS, BROKER_LOGS)} == {
            ("relayd.aep", "aep"), ("relayd.mcp", "mcp"), ("relayd.buzz", "broker")
        }


class _Leaky:
    uri = b"/stream?access_token=obj-leak"

    def __repr__(self) -> str:
        return "<Request uri=/stream?access_token=obj-leak>"


@expand
class JSONRecordTests(TestCase):
    def test_json_record_scrubs_fields_formats_objects_and_failures(self) -> None:
        try:
            raise ValueError("could not use token=failure-leak")
        except ValueError:
            failure = Failure()
        line = logs_json.event_as_json(
            _event(
                log_format="request {request.uri} {request!r} auth {auth}",
                request=_Leaky(),
                auth="Bearer header-leak",
                aep_token="field-leak",
                log_failure=failure,
                nan=float("nan"),
            )
        )
        record = json.loads(line)
        for leak in ("obj-leak", "header-leak", "field-leak", "failure-leak"):
            assert leak not in line
        assert record["fields"]["aep_token"] == scrub.SCRUBBED
        assert "ValueError" in record["failure"]
        assert record["fields"]["nan"] == "nan"

    def test_scrub_event_copies(self) -> None:
        original = _event(token="t0k3n-value")
        clean = scrub.scrub_event(original)
        assert clean["token"] == scrub.SCRUBBED
        assert original["token"] == "t0k3n-value"

    def test_json_lines_observer_one_line_per_event(self) -> None:
        out = io.StringIO()
        observer = logs_json.JSONLinesObserver(out)
        assert ILogObserver.providedBy(observer)
        log = Logger(namespace="relayd.mcp.x", observer=observer)
        log.info("first {n}", n=1)
        log.warn("second\nwith a newline", token="x-secret-x")
        lines = out.getvalue().splitlines()
        assert len(lines) == 2
        records = [json.loads(line) for line in lines]
        assert [r["level"] for r in records] == ["info", "warning"]
        assert records[1]["event"] == "second\nwith a newline"
        assert "x-secret-x" not in out.getvalue()

    def test_json_observer_writes_to_the_stdout_of_its_creation(self) -> None:
        out = io.StringIO()
        self.patch(sys, "stdout", out)
        observer = logs_json.json_observer()
        self.patch(sys, "stdout", io.StringIO())  # twistd redirects stdout after creating it
        Logger(observer=observer).info("x")
        assert json.loads(out.getvalue())["event"] == "x"

    def test_install_scrubber_runs_before_observers_added_earlier_and_later(self) -> None:
        publisher = LogPublisher()
        early, late = io.StringIO(), io.StringIO()
        publisher.addObserver(textFileLogObserver(early))
        scrub.install_scrubber(publisher)
        scrub.install_scrubber(publisher)  # idempotent
        publisher.addObserver(logs_json.JSONLinesObserver(late))
        Logger(observer=publisher).info("url {u}", u="/s/poll?token=in-place-leak")
        assert "in-place-leak" not in early.getvalue()
        assert "in-place-leak" not in late.getvalue()
        assert "token=[scrubbed]" in early.getvalue()

    def test_text_observer_scrubs(self) -> None:
        buffer = io.StringIO()
        saved = sys.stdout
        sys.stdout = buffer
        try:
            observer = logs_json.text_observer()
        finally:
            sys.stdout = saved
        Logger(observer=observer).info("Authorization: Bearer text-leak")
        assert "text-leak" not in buffer.getvalue()
        assert "Bearer [scrubbed]" in buffer.getvalue()

    def test_render_matches_twisted_formatting(self) -> None:
        from twisted.logger import formatEvent

        class Thing:
            name = "t"

            def call(self) -> str:
                return "called"

        for fmt, fields in [
            ("{a} and {b!r} {c:>4}", {"a": "x", "b": "y", "c": 7}),
            ("{thing.name} {thing.call()}", {"thing": Thing()}),  # Twisted's call syntax
            ("missing {nope}", {}),
            ("braces {{literal}} {a}", {"a": 1}),
        ]:
            event = {"log_format": fmt, **fields}
            assert scrub.render(event) == formatEvent(event)

    def test_an_event_is_scrubbed_once(self) -> None:
        publisher = LogPublisher()
        seen: list[dict] = []
        scrub.install_scrubber(publisher)
        publisher.addObserver(seen.append)
        Logger(observer=publisher).info("x {t}", t="Bearer once-leak")
        (event,) = seen
        assert event["log_relayd_scrubbed"] is True
        assert scrub.scrub_event(event) is event  # observers after the scrubber do not copy it again
        assert "once-leak" not in logs_json.event_as_json(event)

    def test_access_lines_in_the_text_log_are_byte_identical_and_cheap(self) -> None:
        # twistd's text observer formats through Twisted's general formatter; relayd reuses the time
        # prefix within a second for access lines, and leaves every other event to Twisted.
        plain, quick = io.StringIO(), io.StringIO()
        published = LogPublisher()
        published.addObserver(textFileLogObserver(plain))
        quickened = LogPublisher()
        quickened.addObserver(textFileLogObserver(quick))
        logs_access.quicken_access_lines(quickened)
        observer = quickened._observers[0]  # type: ignore[attr-defined]
        calls = []
        original = observer.formatEvent.format_event
        observer.formatEvent.format_event = lambda event: calls.append(event) or original(event)

        def access(when: float, line: str, **extra: object) -> dict:
            return {"log_namespace": logs_access.ACCESS_NAMESPACE, "log_level": LogLevel.info, "log_time": when,
                    "log_format": "{access_line}", "access_line": line, **extra}

        events = [
            access(1000.1, 'aep 127.0.0.1 "POST /events" 202 0'),
            access(1000.5, 'aep 127.0.0.1 "GET /stream" 200 512'),
            {"log_namespace": "relayd.aep", "log_level": LogLevel.warn, "log_time": 1000.6,
             "log_format": "store {what}", "what": "down"},
            access(1000.9, 'mcp ::1 "POST /s/inbox" 401 0'),
            access(1001.0, 'aep 127.0.0.1 "POST /events" 413 0'),
            access(1001.2, "multi\nline"),
            access(1001.3, 'aep 127.0.0.1 "GET /" 200 0', log_system="custom"),
        ]
        for event in events:
            published(dict(event))
            quickened(dict(event))
        assert quick.getvalue() == plain.getvalue()
        assert quick.getvalue().count("[relayd.access#info] ") == 5
        # Twisted formatted the first access line of each second and the events it must: 5 of 7.
        assert len(calls) == 5


class WhatTheLogsLoad(TestCase):
    """C{--logger=relayd.logs.json.json_observer} loads the logs and the fence's twisted.logger half only:
    formatting a log line needs neither twisted.web nor autobahn (it loaded both through the fence's
    web module before the fence was split by library)."""

    timeout = 60

    def test_the_observers_load_no_web_and_no_autobahn(self) -> None:
        program = (
            "import sys; from relayd.logs import json, access, scrub; json.json_observer(); "
            "access.quicken_access_lines(); scrub.install_scrubber(); "
            "sys.stdout.write(' '.join(sorted(sys.modules)))"
        )
        root = os.path.dirname(os.path.dirname(os.path.abspath(scrub.__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(root), os.environ.get("PYTHONPATH", "")])}
        loaded = subprocess.run(
            [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=50, check=True
        ).stdout.split()
        self.assertIn("relayd.compat.logger", loaded)
        self.assertEqual([m for m in loaded if m.split(".")[0] == "autobahn" or m.startswith("twisted.web")], [])
        self.assertEqual(
            sorted(m for m in loaded if m.startswith("relayd.")),
            ["relayd.compat", "relayd.compat.detect", "relayd.compat.logger", "relayd.logs", "relayd.logs.access",
             "relayd.logs.json", "relayd.logs.scrub"],
        )

