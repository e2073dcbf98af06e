"""Redis over TLS (C{rediss://}): a real redis-server with a TLS port, its certificate issued by a
throwaway CA (tests/support/tls.py), trusted through C{?tls_ca=PATH} or refused with the reason in
the log; and the query parameters every form of the URL takes or refuses."""

from __future__ import annotations

import io
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.logger import globalLogPublisher
from twisted.trial.unittest import TestCase

from relayd.base.clock import Timekeeper
from relayd.base.errors import StoreUnavailable
from relayd.storage.redis import Redis, parse_redis_url
from relayd.tap import Options
from tests.support.redis import RedisServer, connected_redis, free_port
from tests.support.tls import make_pki


class TLSServer:
    """A redis-server answering TLS on C{tls_port} with a certificate for C{hostname} and 127.0.0.1
    (and plain TCP on its own port, which the fixture's start-up check uses)."""

    def __init__(self, case: TestCase, hostname: str = "localhost") -> None:
        directory = temporary_directory(case)
        pki = make_pki(directory, hostname)
        self.ca = directory / "ca.pem"
        self.ca.write_bytes(pki.ca_pem)
        self.tls_port = free_port()
        server = RedisServer.start(
            "--tls-port", str(self.tls_port), "--tls-cert-file", str(pki.cert), "--tls-key-file", str(pki.key),
            "--tls-ca-cert-file", str(self.ca), "--tls-auth-clients", "no",
        )  # fmt: skip
        case.addCleanup(server.cleanup)


def temporary_directory(case: TestCase) -> Path:
    """A directory of its own, removed after the test (absolute: redis-server reads it after changing
    directory)."""
    directory = Path(tempfile.mkdtemp(prefix="relayd-tls-"))
    case.addCleanup(shutil.rmtree, directory, True)
    return directory


def handshake_failures(case: TestCase) -> Deferred[str]:
    """Fires with the first "handshake failed" log line's error."""
    seen: Deferred[str] = Deferred()

    def observe(event: dict[str, Any]) -> None:
        if "handshake failed" in event.get("log_format", "") and not seen.called:
            seen.callback(str(event["error"]))

    globalLogPublisher.addObserver(observe)
    case.addCleanup(globalLogPublisher.removeObserver, observe)
    return seen


class RedissWithItsCA(TestCase):
    async def test_trusted_through_tls_ca_it_connects_and_runs_commands(self) -> None:
        server = TLSServer(self)
        redis = await connected_redis(f"rediss://localhost:{server.tls_port}/0?tls_ca={server.ca}")
        self.addCleanup(redis.close)
        await redis.execute("aep", "SET", b"tls-probe", b"1")
        self.assertEqual(await redis.execute("aep", "GET", b"tls-probe"), b"1")

    async def test_without_the_ca_every_connection_is_refused_and_the_log_says_why(self) -> None:
        server = TLSServer(self)
        failed = handshake_failures(self)
        redis = Redis(f"rediss://localhost:{server.tls_port}/0", Timekeeper(reactor))
        self.addCleanup(redis.close)
        self.assertEqual(await failed, "TLS: certificate verify failed")
        with self.assertRaises(StoreUnavailable):
            await redis.execute("aep", "PING")

    async def test_a_certificate_for_another_name_is_refused(self) -> None:
        server = TLSServer(self, hostname="redis.example")  # its names: redis.example and 127.0.0.1
        failed = handshake_failures(self)
        redis = Redis(f"rediss://localhost:{server.tls_port}/0?tls_ca={server.ca}", Timekeeper(reactor))
        self.addCleanup(redis.close)
        self.assertIn("TLS: the certificate does not name the host", await failed)
        with self.assertRaises(StoreUnavailable):
            await redis.execute("aep", "PING")


class QueryParameters(TestCase):
    def ca_file(self) -> str:
        directory = temporary_directory(self)
        (directory / "ca.pem").write_bytes(make_pki(directory).ca_pem)
        return str(directory / "ca.pem")

    def test_every_tls_form_takes_tls_ca(self) -> None:
        ca = self.ca_file()
        for text in (
            f"rediss://h:6380/1?tls_ca={ca}",
            f"rediss+sentinel://s1,s2/main/0?sentinel_password=x&tls_ca={ca}",
            f"rediss+cluster://n1:7000,n2:7001?tls_ca={ca}",
        ):
            url = parse_redis_url(text)
            self.assertEqual((url.tls, url.tls_ca), (True, ca), text)
            self.assertNotIn("tls_ca", str(url))
        self.assertIsNone(parse_redis_url("rediss://h:6380/1").tls_ca)

    def test_the_sentinels_use_tls_with_rediss_unless_sentinel_tls_no(self) -> None:
        for text, sentinel_tls in [
            ("rediss+sentinel://s1/main", True),
            ("rediss+sentinel://s1/main?sentinel_tls=yes", True),
            ("rediss+sentinel://s1/main?sentinel_tls=no", False),
            ("redis+sentinel://s1/main", False),
        ]:
            url = parse_redis_url(text)
            self.assertEqual(url.sentinel_tls, sentinel_tls, text)
        self.assertEqual(
            str(parse_redis_url("rediss+sentinel://s1/main?sentinel_tls=no")),
            "rediss+sentinel://s1:26379/main/0?sentinel_tls=no",
        )

    def test_refused_with_what_to_write(self) -> None:
        ca = self.ca_file()
        not_pem = Path(ca).with_name("not.pem")
        not_pem.write_bytes(b"hello\n")
        for text, says in [
            (f"redis://h/0?tls_ca={ca}", "tls_ca needs TLS: use rediss://"),
            (f"redis+cluster://n1:7000?tls_ca={ca}", "tls_ca needs TLS"),
            ("rediss://h/0?tls_ca=/nonexistent/ca.pem", "tls_ca: cannot read '/nonexistent/ca.pem' (No such file"),
            (f"rediss://h/0?tls_ca={not_pem}", "is not a PEM file of CA certificates"),
            (f"rediss://h/0?tls_ca={ca}&tls_ca={ca}", "gives a query parameter twice"),
            # Once ignored: a setting the URL seems to make and relayd would not apply.
            ("redis://h/0?db=3", "unknown query parameter 'db' (known: tls_ca)"),
            ("redis+cluster://n1:7000?password=x", "unknown query parameter 'password' (known: tls_ca)"),
            ("redis+sentinel://s1/main?tls=1", "(known: sentinel_username, sentinel_password, sentinel_tls, tls_ca)"),
            ("redis+sentinel://s1/main?sentinel_tls=no", "sentinel_tls needs TLS: use rediss+sentinel://"),
            ("redis+sentinel://s1/main?sentinel_tls=yes", "sentinel_tls needs TLS"),
            ("rediss+sentinel://s1/main?sentinel_tls=off", "sentinel_tls must be yes or no; got 'off'"),
            ("rediss+sentinel://s1/main?sentinel_tls=", "sentinel_tls must be yes or no; got ''"),
        ]:
            with self.assertRaises(ValueError) as caught:
                parse_redis_url(text)
            self.assertIn(says, str(caught.exception), text)

    def test_a_bad_ca_file_stops_the_start_in_one_line(self) -> None:
        out, err = io.StringIO(), io.StringIO()
        self.patch(sys, "stdout", out)
        self.patch(sys, "stderr", err)
        with self.assertRaises(SystemExit) as exit:
            Options(environ={}).parseOptions(["--redis", "rediss://h/0?tls_ca=/nonexistent/ca.pem", "--check-config"])
        self.assertEqual(
            (exit.exception.code, err.getvalue()),
            (2, "relayd: error: --redis: tls_ca: cannot read '/nonexistent/ca.pem' (No such file or directory)\n"),
        )
