"""The one request layer (relayd/web/routes.py), served by a real RelaySite on 127.0.0.1."""

from __future__ import annotations

import gc
from types import CellType
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, fail, succeed
from twisted.logger import LogEvent, Logger
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.server import Request
from twisted.web.test.requesthelper import DummyRequest

from relayd.base.errors import StoreUnavailable
from relayd.web.answers import INTERNAL_ERROR, Answer, Refusals, finish, gone, json_answer
from relayd.web.routes import TAKEN, RoutedResource, RouteTable, answer_when
from relayd.web.site import RelaySite
from tests.support.http import HttpClient


class _Refused(Exception):
    pass


def _table(pending: list[tuple[Request, Deferred[Answer]]]) -> RouteTable:
    refusals = Refusals(
        [
            (_Refused, lambda e: json_answer(409, b'{"error":"refused"}')),
            (StoreUnavailable, lambda e: json_answer(503, b'{"error":"store_unavailable","store":"%s"}' % e.store.encode())),
        ]
    )
    table = RouteTable(refusals=refusals, not_found=json_answer(404, b'{"error":"nowhere"}'))

    def later(request: Request) -> Deferred[Answer]:
        d: Deferred[Answer] = Deferred()
        pending.append((request, d))
        return d

    def taken(request: Request) -> Any:
        request.setHeader(b"content-type", b"text/plain")
        request.write(b"mine")
        request.finish()
        return TAKEN

    table.add("/now", {"GET": lambda request: json_answer(200, b'{"now":true}'), "POST": later})
    table.add("/sessions/{session}/inbox", {"POST": lambda request, session: json_answer(200, session.encode())})
    table.add("/fired", {"GET": lambda request: succeed(json_answer(201, b"{}"))})
    table.add("/refused", {"GET": lambda request: fail(_Refused())})
    table.add("/raises", {"GET": lambda request: (_ for _ in ()).throw(_Refused())})
    table.add("/store", {"GET": lambda request: fail(StoreUnavailable("aep"))})
    table.add("/bug", {"GET": lambda request: 1 / 0})
    table.add("/taken", {"GET": taken})
    table.add("/empty", {"DELETE": lambda request: Answer(204)})
    return table


class RoutedResourceOverHTTP(TestCase):
    def setUp(self) -> None:
        self.pending: list[tuple[Request, Deferred[Answer]]] = []
        self.port = reactor.listenTCP(0, RelaySite(RoutedResource(_table(self.pending))), interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)
        self.client = HttpClient.on_port(self, self.port.getHost().port)

    async def test_an_answer_now_and_head_by_get(self) -> None:
        reply = await self.client.request("GET", "/now")
        self.assertEqual((reply.code, reply.body), (200, b'{"now":true}'))
        self.assertEqual(reply.header("content-type"), "application/json")
        head = await self.client.request("HEAD", "/now")
        self.assertEqual((head.code, head.body, head.header("content-length")), (200, b"", "12"))

    async def test_named_parts_reach_the_handler(self) -> None:
        reply = await self.client.request("POST", "/sessions/abc/inbox", b"")
        self.assertEqual((reply.code, reply.body), (200, b"abc"))
        # A part is one non-empty segment.
        for path in ("/sessions//inbox", "/sessions/a/b/inbox", "/sessions/abc/inbox/"):
            self.assertEqual((await self.client.request("POST", path, b"")).code, 404, path)

    async def test_unknown_path_is_the_wings_404_and_known_path_405_with_allow(self) -> None:
        missing = await self.client.request("GET", "/nowhere")
        self.assertEqual((missing.code, missing.body), (404, b'{"error":"nowhere"}'))
        wrong = await self.client.request("PUT", "/now", b"")
        self.assertEqual((wrong.code, wrong.body), (405, b'{"error":"method_not_allowed"}'))
        self.assertEqual(wrong.header("allow"), "GET, HEAD, POST")
        self.assertEqual((await self.client.request("GET", "/empty")).header("allow"), "DELETE")

    async def test_an_answer_later(self) -> None:
        reply_d = Deferred.fromCoroutine(self.client.request("POST", "/now", b""))
        while not self.pending:
            await _turn()
        self.pending[0][1].callback(json_answer(202, b'{"later":1}'))
        reply = await reply_d
        self.assertEqual((reply.code, reply.body), (202, b'{"later":1}'))

    async def test_a_deferred_already_fired_and_a_204(self) -> None:
        self.assertEqual((await self.client.request("GET", "/fired")).code, 201)
        empty = await self.client.request("DELETE", "/empty")
        self.assertEqual((empty.code, empty.body, empty.header("content-length")), (204, b"", None))

    async def test_refusals_map_to_their_answers_raised_or_failed(self) -> None:
        for path in ("/refused", "/raises"):
            reply = await self.client.request("GET", path)
            self.assertEqual((reply.code, reply.body), (409, b'{"error":"refused"}'), path)
        store = await self.client.request("GET", "/store")
        self.assertEqual((store.code, store.body), (503, b'{"error":"store_unavailable","store":"aep"}'))

    async def test_a_bug_is_logged_and_answered_500(self) -> None:
        reply = await self.client.request("GET", "/bug")
        self.assertEqual((reply.code, reply.body), (500, b'{"error":"internal_error"}'))
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)

    async def test_a_taken_request_is_left_to_its_handler(self) -> None:
        reply = await self.client.request("GET", "/taken")
        self.assertEqual((reply.code, reply.body, reply.header("content-type")), (200, b"mine", "text/plain"))

    async def test_an_answer_after_the_client_left_is_dropped(self) -> None:
        reply_d = Deferred.fromCoroutine(self.client.request("POST", "/now", b"", timeout=30))
        while not self.pending:
            await _turn()
        request, d = self.pending[0]
        self.assertFalse(gone(request))
        lost: Deferred[None] = Deferred()
        request.notifyFinish().addErrback(lambda _: lost.callback(None))
        reply_d.cancel()
        await lost
        self.assertTrue(gone(request))
        d.callback(json_answer(200, b"{}"))  # no write to a closed request: no error logged
        finish(request, json_answer(200, b"{}"))
        self.assertTrue(gone(request))
        reply_d.addErrback(lambda _: None)


class RefusalsOfBugs(TestCase):
    def test_a_bug_is_logged_on_the_wings_logger_when_given_one(self) -> None:
        # The wing's logger: its records carry the wing's namespace, hence its relay in JSON logs.
        events: list[LogEvent] = []
        refusals = Refusals(log=Logger(namespace="the.wing.http", observer=events.append))
        self.assertEqual(refusals.answer(Failure(ZeroDivisionError())), INTERNAL_ERROR)
        (event,) = events
        self.assertEqual(event["log_namespace"], "the.wing.http")
        self.assertTrue(event["log_failure"].check(ZeroDivisionError))
        self.assertEqual(self.flushLoggedErrors(), [])  # not on the global log as well

    def test_else_on_the_routes_own(self) -> None:
        self.assertEqual(Refusals().answer(Failure(ZeroDivisionError())), INTERNAL_ERROR)
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)


class ParkedRequests(TestCase):
    def test_an_answer_later_holds_no_closure(self) -> None:
        # A long-poll may stay parked for minutes, thousands at once: what the layer adds to its
        # Deferred is two module functions and their argument tuples, not two closures.
        d: Deferred[Answer] = Deferred()
        table = RouteTable()
        table.add("/poll", {"GET": lambda request: d})
        request: Any = DummyRequest([b"poll"])
        request.path = b"/poll"
        request.method = b"GET"
        RoutedResource(table).render(request)
        self.assertEqual([r for r in gc.get_referrers(request) if isinstance(r, CellType)], [])
        d.callback(json_answer(200, b"{}"))
        self.assertEqual((request.responseCode, request.written, request.finished), (200, [b"{}"], 1))


class RouteTableResolution(TestCase):
    def test_exact_paths_win_and_allow_lists_the_methods(self) -> None:
        table = RouteTable()
        handler = lambda request: Answer(200)  # noqa: E731
        table.add("/a/{x}", {"GET": handler})
        table.add("/a/exact", {"POST": handler})
        self.assertEqual(table.resolve(b"POST", b"/a/exact"), (handler, {}))
        self.assertEqual(table.resolve(b"GET", b"/a/other"), (handler, {"x": "other"}))
        self.assertEqual(table.allowed(b"/a/exact"), b"POST")
        self.assertEqual(table.allowed(b"/a/other"), b"GET, HEAD")
        self.assertIsNone(table.allowed(b"/b"))
        self.assertEqual(table.resolve(b"GET", b"/b"), table.not_found)

    def test_a_path_looked_up_before_a_route_is_added_finds_it_after(self) -> None:
        table = RouteTable()
        handler = lambda request, x: Answer(200)  # noqa: E731
        table.add("/a/{x}", {"GET": handler})
        self.assertEqual(table.resolve(b"GET", b"/b/y"), table.not_found)
        self.assertEqual(table.resolve(b"GET", b"/a/y"), (handler, {"x": "y"}))
        table.add("/b/{x}", {"GET": handler})
        table.add("/a/y", {"POST": handler})
        self.assertEqual(table.resolve(b"GET", b"/b/y"), (handler, {"x": "y"}))
        self.assertEqual(table.allowed(b"/a/y"), b"POST")

    def test_only_short_paths_are_kept_and_at_most_so_many(self) -> None:
        table = RouteTable()
        handler = lambda request, x: Answer(200)  # noqa: E731
        table.add("/a/{x}", {"GET": handler})
        long = b"/a/" + b"x" * 300
        self.assertEqual(table.resolve(b"GET", long), (handler, {"x": "x" * 300}))
        self.assertNotIn(long, table._found)
        for n in range(5000):
            table.resolve(b"GET", b"/a/%d" % n)
        self.assertLessEqual(len(table._found), 4096)

    def test_a_prefix_is_literal_braces_and_all(self) -> None:
        table = RouteTable()
        table.add("/{x}/in", {"POST": lambda request, x: Answer(200)}, prefix="/p{y}.z")
        table.add("/health", {"GET": lambda request: Answer(200)}, prefix="/p{y}.z")
        self.assertEqual(table.resolve(b"POST", b"/p{y}.z/abc/in")[1], {"x": "abc"})  # type: ignore[index]
        self.assertNotIsInstance(table.resolve(b"GET", b"/p{y}.z/health"), Answer)
        self.assertIsInstance(table.resolve(b"POST", b"/pq.z/abc/in"), Answer)
        self.assertIsInstance(table.resolve(b"POST", b"/p{y}xz/abc/in"), Answer)

    def test_a_route_without_head_and_a_405_body_per_path(self) -> None:
        table = RouteTable(not_allowed=lambda allow: b'{"allow":"%s"}' % allow)
        handler = lambda request: Answer(200)  # noqa: E731
        table.add("/stream", {"GET": handler, "OPTIONS": handler}, head=False)
        table.add("/doc", {"GET": handler})
        self.assertEqual(table.allowed(b"/stream"), b"GET, OPTIONS")
        refused = table.resolve(b"HEAD", b"/stream")
        self.assertEqual(refused, json_answer(405, b'{"allow":"GET, OPTIONS"}', ((b"allow", b"GET, OPTIONS"),)))
        self.assertEqual(table.resolve(b"PUT", b"/doc"), json_answer(405, b'{"allow":"GET, HEAD"}', ((b"allow", b"GET, HEAD"),)))
        self.assertEqual(table.resolve(b"HEAD", b"/doc"), (handler, {}))

    def test_literal_parts_are_not_patterns(self) -> None:
        table = RouteTable()
        table.add("/v1.0/{x}", {"GET": lambda request, x: Answer(200)})
        self.assertIsInstance(table.resolve(b"GET", b"/v1x0/y"), Answer)
        self.assertNotIsInstance(table.resolve(b"GET", b"/v1.0/y"), Answer)

    def test_a_part_may_be_held_to_a_pattern(self) -> None:
        table = RouteTable(parts={"session": "[a-z]{4,8}"})
        handler = lambda request, session: Answer(200)  # noqa: E731
        table.add("/{session}/inbox", {"POST": handler})
        self.assertEqual(table.resolve(b"POST", b"/abcd/inbox"), (handler, {"session": "abcd"}))
        # A part that does not match is an unknown path (404), whatever the method.
        for path in (b"/abc/inbox", b"/abcdefghi/inbox", b"/ab-d/inbox"):
            self.assertEqual(table.resolve(b"GET", path), table.not_found, path)
        self.assertEqual(table.resolve(b"GET", b"/abcd/inbox").status, 405)  # type: ignore[union-attr]

    def test_a_handler_for_every_other_method(self) -> None:
        table = RouteTable()
        get = lambda request: Answer(200)  # noqa: E731
        other = lambda request: Answer(405)  # noqa: E731
        table.add("/mcp", {"GET": get, "HEAD": other, "*": other})
        self.assertEqual(table.resolve(b"GET", b"/mcp"), (get, {}))
        for method in (b"HEAD", b"PUT", b"BREW"):
            self.assertEqual(table.resolve(method, b"/mcp"), (other, {}), method)
        self.assertEqual(table.allowed(b"/mcp"), b"GET, HEAD")


class _Counting(Deferred[object]):
    """A Deferred that counts the callback pairs added to it."""

    pairs = 0

    def addCallbacks(self, *args: Any, **kwargs: Any) -> Any:
        self.pairs += 1
        return super().addCallbacks(*args, **kwargs)


class AnswerWhen(TestCase):
    """answer_when: the answer at once for a Deferred that has fired, else a Deferred of it."""

    ok = json_answer(202, b"{}")
    refused = json_answer(503, b'{"error":"down"}')

    def _answer(self, d: Deferred[object]) -> Answer | Deferred[Answer]:
        return answer_when(d, lambda _: self.ok, lambda f: self.refused)

    def test_fired_already_is_answered_at_once_with_one_callback_pair(self) -> None:
        d: Deferred[object] = succeed(None)
        self.assertEqual(self._answer(d), self.ok)
        self.assertEqual(self._answer(fail(RuntimeError("down"))), self.refused)
        waiting = _Counting()
        self._answer(waiting)
        self.assertEqual(waiting.pairs, 1)

    def test_fired_later_answers_through_a_deferred(self) -> None:
        d: Deferred[object] = Deferred()
        later = self._answer(d)
        self.assertIsInstance(later, Deferred)
        d.callback(None)
        self.assertEqual(self.successResultOf(later), self.ok)  # type: ignore[arg-type]
        d2: Deferred[object] = Deferred()
        later2 = self._answer(d2)
        d2.errback(Failure(RuntimeError("down")))
        self.assertEqual(self.successResultOf(later2), self.refused)  # type: ignore[arg-type]

    def test_a_bug_making_the_answer_is_a_failure_for_the_refusals(self) -> None:
        broken = answer_when(succeed(None), lambda _: 1 / 0, lambda f: self.refused)  # type: ignore[arg-type, return-value]
        self.failureResultOf(broken, ZeroDivisionError)  # type: ignore[arg-type]
        d: Deferred[object] = Deferred()
        later = answer_when(d, lambda _: 1 / 0, lambda f: self.refused)  # type: ignore[arg-type, return-value]
        d.callback(None)
        self.failureResultOf(later, ZeroDivisionError)  # type: ignore[arg-type]


def _turn() -> Deferred[None]:
    d: Deferred[None] = Deferred()
    reactor.callLater(0, d.callback, None)
    return d
