"""The fence's reactor entry (relayd/compat/reactor.py) on real sockets: an epoll reactor given
quick_dispatch logs what its events log with the same context as Twisted's own doPoll (the same
events, the same system, nested contexts kept), is installed once, on Twisted's EPollReactor only,
and leaves a reactor alone when its detection fails."""

from __future__ import annotations

import socket
from typing import Any, Callable

from twisted.internet import main, task
from twisted.internet.abstract import FileDescriptor
from twisted.internet.epollreactor import EPollReactor
from twisted.internet.protocol import Factory, Protocol
from twisted.python import context, log
from twisted.trial.unittest import TestCase

from relayd.compat import reactor as fence
from relayd.compat.logger import before_each_poll
from relayd.compat.reactor import QUICK_DISPATCH, quick_dispatch

SPINS = 200  # reactor turns before a test gives up (each waits up to 0.05 s for an event)


class Talking(Protocol):
    """Logs what it reads in three ways, and raises when told to."""

    def dataReceived(self, data: bytes) -> None:
        log.msg("read", mark="plain", outer=context.get("outer"))
        log.callWithContext({"nested": "yes"}, log.msg, "nested", mark="nested")
        # (Not "key": relayd's scrubber, observing the log once a test has made a relay, blanks a
        # field of that name; short values, which it never takes for a registered secret.)
        context.call({"inner": "in"}, lambda: log.msg("inner", mark="inner", inner=context.get("inner")))
        if b"raise" in data:
            raise ZeroDivisionError("in dataReceived")

    def connectionLost(self, reason: Any) -> None:
        self.factory.lost.append(reason)


class Odd(FileDescriptor):
    """One end of a socket pair as a reactor's reader: logs a read, then closes; its logPrefix
    and its connectionLost raise what they are given."""

    def __init__(self, reactor: Any, sock: socket.socket, name: str, prefix_error: Any = None, lost_error: Any = None):
        super().__init__(reactor)
        self.sock, self.name = sock, name
        self.prefix_error, self.lost_error = prefix_error, lost_error
        self.read = 0
        self.removes: Odd | None = None  # a reader this one's read removes from the reactor

    def fileno(self) -> int:
        return self.sock.fileno()

    def logPrefix(self) -> str:
        if self.prefix_error is not None:
            raise self.prefix_error
        return self.name

    def doRead(self) -> Any:
        self.read += 1
        if self.removes is not None and self.removes in self.reactor.getReaders():
            self.reactor.removeReader(self.removes)
        self.sock.recv(100)
        log.msg("odd read", mark=self.name)
        return main.CONNECTION_DONE

    def connectionLost(self, reason: Any) -> None:
        self.sock.close()
        if self.lost_error is not None:
            raise self.lost_error


def _seen(event: dict[str, Any]) -> tuple[Any, ...]:
    """What of a legacy log event the comparison looks at (not its time or traceback)."""
    failure = event.get("failure")
    return (
        event.get("system"),
        event.get("message"),
        event.get("isError"),
        type(failure.value).__name__ if failure is not None else None,
        tuple(sorted((k, v) for k, v in event.items() if k in ("mark", "outer", "nested", "inner", "extra"))),
    )


class QuickDispatch(TestCase):
    def reactor(self, fenced: bool) -> EPollReactor:
        """A reactor of the test's own, given the fence or not, cleaned up after the test."""
        reactor = EPollReactor()
        if fenced:
            self.assertTrue(quick_dispatch(reactor))

        def clean() -> None:
            for reader in list(getattr(reactor, "_internalReaders", ())):
                reactor.removeReader(reader)
                reader.connectionLost(None)
            reactor.disconnectAll()
            reactor._poller.close()

        self.addCleanup(clean)
        return reactor

    def spin(self, reactor: EPollReactor, done: Callable[[], bool], around: Callable[..., Any] | None = None) -> None:
        """Turn C{reactor} (inside C{around}, when given) until C{done()}."""
        for _ in range(SPINS):
            if done():
                return
            if around is None:
                reactor.iterate(0.05)
            else:
                around(reactor.iterate, 0.05)
        self.fail("the reactor never got there")

    def logged(self, scenario: Callable[[EPollReactor], None], fenced: bool) -> list[tuple[Any, ...]]:
        """The log events C{scenario} makes on a reactor given the fence or not."""
        reactor = self.reactor(fenced)
        events: list[dict[str, Any]] = []
        log.addObserver(events.append)
        try:
            scenario(reactor)
        finally:
            log.removeObserver(events.append)
        return [_seen(e) for e in events if "mark" in e or e.get("isError")]

    def same_with_and_without(self, scenario: Callable[[EPollReactor], None]) -> list[tuple[Any, ...]]:
        twisted = self.logged(scenario, fenced=False)
        fenced = self.logged(scenario, fenced=True)
        self.assertEqual(fenced, twisted)
        return fenced

    def tcp(self, reactor: EPollReactor, sent: bytes, around: Callable[..., Any] | None = None) -> None:
        """A loopback TCP connection to a L{Talking} server on C{reactor}; C{sent} goes to it,
        read by the server (inside C{around}) until it is closed."""
        factory = Factory.forProtocol(Talking)
        factory.lost = []  # type: ignore[attr-defined]
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")  # (closed with the reactor)
        client = socket.create_connection(("127.0.0.1", port.getHost().port))
        self.addCleanup(client.close)
        client.sendall(sent)
        client.shutdown(socket.SHUT_WR)
        self.spin(reactor, lambda: bool(factory.lost), around)  # type: ignore[attr-defined]

    def test_detected(self) -> None:
        """The installed Twisted dispatches as the fence knows."""
        self.assertTrue(QUICK_DISPATCH)

    def test_the_same_system_on_a_connection(self) -> None:
        """What a protocol logs while it reads carries its connection's logPrefix as system, and a
        context pushed inside keeps it; an exception it raises is logged with it, as Twisted does."""
        seen = self.same_with_and_without(lambda r: self.tcp(r, b"raise"))
        self.flushLoggedErrors(ZeroDivisionError)
        system = "Talking,0,127.0.0.1"
        self.assertEqual(
            seen,
            [
                (system, ("read",), 0, None, (("mark", "plain"), ("outer", None))),
                (system, ("nested",), 0, None, (("mark", "nested"), ("nested", "yes"))),
                (system, ("inner",), 0, None, (("inner", "in"), ("mark", "inner"))),
                (system, (), 1, "ZeroDivisionError", ()),
            ],
        )

    def test_contexts_around_the_reactor_stay_visible(self) -> None:
        """A context the reactor runs in (its log context, or another key) is seen by what an
        event's handler logs, under the event's system."""

        def outer(f: Any, *a: Any) -> Any:
            return context.call({"outer": "o"}, f, *a)

        def extra(f: Any, *a: Any) -> Any:
            return log.callWithContext({"extra": "x", "system": "around"}, f, *a)

        seen = self.same_with_and_without(lambda r: self.tcp(r, b"hello", outer))
        self.assertEqual(seen[0], ("Talking,0,127.0.0.1", ("read",), 0, None, (("mark", "plain"), ("outer", "o"))))
        seen = self.same_with_and_without(lambda r: self.tcp(r, b"hello", extra))
        self.assertEqual(
            seen[0], ("Talking,0,127.0.0.1", ("read",), 0, None, (("extra", "x"), ("mark", "plain"), ("outer", None)))
        )

    def odd(self, reactor: EPollReactor, **errors: Any) -> Odd:
        """An L{Odd} reader on C{reactor}, its peer written to and closed."""
        ours, theirs = socket.socketpair()
        self.addCleanup(theirs.close)
        self.addCleanup(ours.close)
        theirs.sendall(b"x")
        reader = Odd(reactor, ours, "odd", **errors)
        reactor.addReader(reader)
        return reader

    def test_a_buggy_log_prefix(self) -> None:
        """A logPrefix that raises is logged, and the event then handled under
        "(buggy logPrefix method)"."""

        def scenario(reactor: EPollReactor) -> None:
            reader = self.odd(reactor, prefix_error=ValueError("no prefix"))
            self.spin(reactor, lambda: reader.read > 0)

        seen = self.same_with_and_without(scenario)
        self.assertEqual(len(self.flushLoggedErrors(ValueError)), 2)
        buggy = "(buggy logPrefix method)"
        self.assertEqual(
            seen, [(buggy, (), 1, "ValueError", ()), (buggy, ("odd read",), 0, None, (("mark", "odd"),))]
        )

    def test_an_exception_out_of_the_dispatch(self) -> None:
        """An exception out of C{_doReadOrWrite} (here a connectionLost's) is logged under the
        selectable's system, and the reactor goes on."""

        def scenario(reactor: EPollReactor) -> None:
            reader = self.odd(reactor, lost_error=ValueError("lost badly"))
            self.spin(reactor, lambda: reader.read > 0)

        seen = self.same_with_and_without(scenario)
        self.assertEqual(len(self.flushLoggedErrors(ValueError)), 2)
        self.assertEqual(seen, [("odd", ("odd read",), 0, None, (("mark", "odd"),)), ("odd", (), 1, "ValueError", ())])

    def test_keyboard_interrupt_goes_through(self) -> None:
        """C{KeyboardInterrupt} from a logPrefix, or out of the dispatch, is raised out of the reactor."""
        for fenced in (False, True):
            for errors in ({"prefix_error": KeyboardInterrupt()}, {"lost_error": KeyboardInterrupt()}):
                reactor = self.reactor(fenced)
                reader = self.odd(reactor, **errors)
                with self.assertRaises(KeyboardInterrupt):
                    self.spin(reactor, lambda: False)
                if reader in reactor.getReaders():
                    reactor.removeReader(reader)  # (before its socket closes; its logPrefix raised)

    def test_a_reader_gone_before_its_event(self) -> None:
        """An event of a selectable that an earlier event of the same poll removed is skipped."""
        reactor = self.reactor(fenced=True)
        first, second = self.odd(reactor), self.odd(reactor)
        # (Each removes the other: whichever epoll reports first is handled; the other's event,
        # in the same poll, finds no selectable.)
        first.removes, second.removes = second, first
        self.spin(reactor, lambda: first not in reactor.getReaders() and second not in reactor.getReaders())
        self.assertEqual(sorted([first.read, second.read]), [0, 1])

    def test_installed_once_under_a_hook(self) -> None:
        """Installed again, nothing changes: a hook put over it since (the log writers') is kept."""
        reactor = self.reactor(fenced=True)
        installed = reactor.doIteration
        self.assertIs(installed.__func__, fence._do_poll)
        self.assertTrue(quick_dispatch(reactor))
        self.assertIs(reactor.doIteration, installed)
        self.assertTrue(before_each_poll(reactor, lambda: None))
        hooked = reactor.doIteration
        self.assertTrue(quick_dispatch(reactor))
        self.assertIs(reactor.doIteration, hooked)
        self.assertIs(reactor.doPoll, installed)

    def test_not_under_another_s_hook(self) -> None:
        """A reactor whose poll another already hooked is left alone (the hook calls Twisted's)."""
        reactor = self.reactor(fenced=False)
        self.assertTrue(before_each_poll(reactor, lambda: None))
        hooked = reactor.doIteration
        self.assertFalse(quick_dispatch(reactor))
        self.assertIs(reactor.doIteration, hooked)
        self.assertNotIn("doPoll", vars(reactor))

    def test_another_reactor_is_left_alone(self) -> None:
        """Not Twisted's EPollReactor itself (a subclass, a clock): nothing changed."""

        class Mine(EPollReactor):
            pass

        mine = Mine.__new__(Mine)
        clock = task.Clock()
        for reactor in (mine, clock):
            self.assertFalse(quick_dispatch(reactor))
            self.assertNotIn("doIteration", vars(reactor))

    def test_undetected_leaves_twisted_s(self) -> None:
        """When the detection fails, the reactor keeps Twisted's doPoll."""
        self.patch(fence, "QUICK_DISPATCH", False)
        reactor = self.reactor(fenced=False)
        self.assertFalse(quick_dispatch(reactor))
        self.assertNotIn("doIteration", vars(reactor))

    def test_patched_log_goes_back_to_twisted_s(self) -> None:
        """Once C{log.callWithLogger} is not the one the fence stands in for (a test patched it),
        events go through it, as Twisted's doPoll sends them."""
        called: list[Any] = []
        original = log.callWithLogger

        def recording(logger: Any, f: Any, *a: Any, **kw: Any) -> Any:
            called.append(logger)
            return original(logger, f, *a, **kw)

        self.patch(log, "callWithLogger", recording)
        reactor = self.reactor(fenced=True)
        reader = self.odd(reactor)
        self.spin(reactor, lambda: reader.read > 0)
        self.assertIn(reader, called)
