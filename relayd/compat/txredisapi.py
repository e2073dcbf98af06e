"""The one place relayd reaches into txredisapi's private state (relayd/storage/redis.py and sharded.py use it).

Which parser reads replies is txredisapi's choice, made once at its import: hiredis's C reader when
hiredis imports (setup.cfg requires it), else its Python line reader; L{HIREDIS_REPLIES} says which,
and the reliances below that touch the parser are detected on the one in use.

Eight times relayd replaces what txredisapi does inside its protocol or its pool, and each time it must know how
txredisapi does it. Each reliance is detected once, at import, on the installed txredisapi (the
names it relies on must appear in the txredisapi methods that use them); when a release drops them
the flag is off and relayd takes txredisapi's own path, plainer but working. The pool, its factory
and their endpoints are built from txredisapi's public classes in relayd/storage/redis.py and need no
fence. tests/compat/test_txredisapi.py checks each detection against a real redis-server, checks each
fallback, and (with the fence's scan, tests/compat/) fails any other module
that touches a txredisapi private attribute. setup.cfg bounds txredisapi's version so that a new
release is admitted only once those tests pass on it.
"""

from __future__ import annotations

import inspect
import random
from typing import Any, Sequence

import txredisapi

from relayd.compat.detect import code_uses

# -- readiness: relayd's own handshake -------------------------------------------------------------

READY_STATE = code_uses(txredisapi.BaseRedisProtocol.whenConnected, "_ready", "_waiting_for_connect") and code_uses(
    inspect.unwrap(txredisapi.BaseRedisProtocol.connectionMade), "_ready", "_waiting_for_connect"  # inlineCallbacks
)
"""A protocol is usable once its handshake sets C{_ready} and fires the Deferreds C{whenConnected}
queued in C{_waiting_for_connect}: the pool hands out a connection only then. With it relayd runs its
own AUTH and SELECT and L{mark_ready} declares the connection usable: txredisapi's handshake stops
the whole pool from ever reconnecting when AUTH or SELECT fails, which is what happens when Redis
closes a connection mid-handshake while it restarts, and one unlucky reconnect would leave relayd
without Redis until it is restarted. Without it relayd runs txredisapi's handshake and checks the
keyspace version after it (the pool may hand the connection out while the check runs; a mismatch
still refuses the whole client)."""


def mark_ready(protocol: Any) -> None:
    """Declare C{protocol} usable after relayd's handshake, as txredisapi's own handshake would."""
    protocol.connected = 1
    protocol._ready = True
    waiting, protocol._waiting_for_connect = protocol._waiting_for_connect, []
    for d in waiting:
        d.callback(protocol)


# -- replies: which parser ------------------------------------------------------------------------------

HIREDIS_REPLIES = code_uses(txredisapi.RedisProtocol.dataReceived, "_reader", "gets", "replyReceived")
"""txredisapi's C{RedisProtocol} (and so its C{SubscriberProtocol}, and relayd's connections) parses
replies with hiredis's C reader (its C{HiredisProtocol}: txredisapi picks it when C{import hiredis}
works) instead of its Python line reader (C{BaseRedisProtocol}): each reply is parsed whole within
the read, in C. The replies are the same (bytes, C{int}, C{None}, nested lists, C{ResponseError} with
the server's message) but for a status reply (C{+OK}, C{+PONG}), which hiredis gives as bytes like a
bulk string and the line reader as str (L{status}); relayd reads none but the PONG (L{HearsReplies})."""


def status(text: str) -> str | bytes:
    """A status reply (C{+text}) as relayd's connections hand it over: see L{HIREDIS_REPLIES}."""
    return text.encode() if HIREDIS_REPLIES else text


# -- replies: a whole read in one go ----------------------------------------------------------------

SPLIT_READS = code_uses(txredisapi.LineReceiver.setLineMode, "pauseProducing", "callLater") and code_uses(
    txredisapi.LineReceiver.dataReceived, "line_mode", "paused", "resumeProducing"
)
"""txredisapi's line receiver, back in line mode after a bulk string, pauses the transport and feeds
itself the rest of the read on the next reactor turn (C{dataReceived(rest, unpause=True)}). (hiredis's
reader, L{HIREDIS_REPLIES}, parses a whole read in one call: there L{WholeReads} finds nothing to do.)"""


class WholeReads:
    """Mixed into relayd's txredisapi protocols: parse a whole read within the one C{dataReceived}.

    With L{SPLIT_READS} a reply of N bulk strings (a pub/sub message is three) takes N reactor turns,
    and a busy relay falls seconds behind its bus. Here the rest is kept and fed back in a loop within
    the same read. Without it (a txredisapi that no longer splits reads) this does nothing.
    """

    _rest = b""

    def setLineMode(self, extra: bytes = b"") -> None:
        if not SPLIT_READS:
            return super().setLineMode(extra)  # type: ignore[misc]
        self.line_mode = 1
        if extra:
            self._rest += extra
        return None

    def dataReceived(self, data: bytes, unpause: bool = False) -> Any:
        result = super().dataReceived(data, unpause)  # type: ignore[misc]
        while self._rest and not self.paused:  # type: ignore[attr-defined]
            rest, self._rest = self._rest, b""
            result = super().dataReceived(rest)  # type: ignore[misc]
        return result


# -- replies: sharded pub/sub, which txredisapi does not know ---------------------------------------

OWN_REPLIES = (
    code_uses(txredisapi.RedisProtocol.dataReceived, "replyReceived")
    if HIREDIS_REPLIES
    else code_uses(txredisapi.BaseRedisProtocol.multiBulkDataReceived, "replyReceived")
    and code_uses(txredisapi.BaseRedisProtocol.lineReceived, "replyReceived")
)
"""txredisapi's parser (either, L{HIREDIS_REPLIES}) hands every complete reply, a server's unasked push too, to the protocol's
C{replyReceived}: relayd's sharded subscriber (relayd/storage/sharded.py) takes them there, once its
handshake is done, and sends its commands on the transport itself. txredisapi's SubscriberProtocol
knows neither C{SSUBSCRIBE}'s replies nor C{smessage} (it would queue them as answers nobody asked
for). Without it relayd's Redis Cluster client keeps pub/sub classic (one channel, forwarded by the
cluster to every node), as it did before sharded pub/sub."""


class OwnReplies:
    """Mixed into a txredisapi protocol: once C{own_replies} is set, every reply goes to
    C{own_reply(reply)} (a list, bytes, an int, or a C{ResponseError} for an error reply) instead of
    txredisapi's reply queue."""

    own_replies = False

    def own_reply(self, reply: Any) -> None:
        raise NotImplementedError

    def replyReceived(self, reply: Any) -> None:
        if self.own_replies:
            self.own_reply(reply)
            return
        super().replyReceived(reply)  # type: ignore[misc]


# -- replies: a subscriber's liveness ---------------------------------------------------------------

PONGS = OWN_REPLIES
"""The same reliance as L{OWN_REPLIES}: every reply, a message too, passes the protocol's
C{replyReceived}, where L{HearsReplies} notes it and takes the answer to a PING. relayd's subscriber
connections then PING when idle and drop a node that stops answering (relayd/storage/heartbeat.py
L{Heartbeat}). Without it they send no PING (txredisapi would queue the answer for the next command)
and a node that hangs is noticed only when TCP gives up, as before."""


_PONG = status("PONG")


class HearsReplies:
    """Mixed into a txredisapi subscriber protocol: with L{PONGS}, every reply calls C{heard()} first,
    and the answer to a PING goes no further: C{[b"pong", b""]} in subscribed mode, the status C{PONG}
    on a connection subscribed to nothing yet (L{status}: bytes or str, as the parser gives it)."""

    def heard(self) -> None:
        raise NotImplementedError

    def replyReceived(self, reply: Any) -> None:
        if PONGS:
            self.heard()
            if reply == _PONG or (isinstance(reply, list) and len(reply) == 2 and reply[0] == b"pong"):
                return
        super().replyReceived(reply)  # type: ignore[misc]


# -- commands: built in one pass --------------------------------------------------------------------

ONE_PASS_COMMANDS = code_uses(txredisapi.BaseRedisProtocol.execute_command, "_build_command") and code_uses(
    txredisapi.BaseRedisProtocol._encode_value, "charset", "isinstance"
)
"""txredisapi writes every command its C{execute_command} sends as C{_build_command} builds it, each
argument encoded by C{_encode_value}: bytes as they are, an C{int} by C{str}, a C{str} by the
protocol's C{charset} (UTF-8 when it is C{None})."""


class Framed:
    """Arguments (bytes) written once as the protocol writes them (C{$<length>\r\n<bytes>\r\n} each),
    standing for them in a command: a command sent again and again with the same ones (an AEP append's
    key names) does not frame them again. L{OnePassCommands} writes the bytes as they are; txredisapi's
    own build (without L{ONE_PASS_COMMANDS}) is given the arguments themselves."""

    __slots__ = ("args", "data")

    def __init__(self, args: Sequence[bytes]) -> None:
        self.args = tuple(args)
        if any(type(arg) is not bytes for arg in self.args):
            raise TypeError("Framed takes bytes only")
        self.data = b"".join(b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in self.args)


def unframed(args: Sequence[Any]) -> list[Any]:
    """C{args} with every L{Framed} replaced by the arguments it stands for."""
    out: list[Any] = []
    for arg in args:
        if type(arg) is Framed:
            out += arg.args
        else:
            out.append(arg)
    return out


class OnePassCommands:
    """Mixed into relayd's txredisapi pool protocol: a command's bytes built in one pass.

    txredisapi builds each command through a bytearray and two C{_encode_value} calls per argument
    (the argument and its length), each a chain of C{isinstance} tests: about a tenth of a relayd's CPU
    per event on C{--redis} (an append script has some twenty arguments). Here bytes, C{int} and
    C{str} arguments are written directly, byte for byte as txredisapi writes them; any other kind, or a
    C{str} the charset cannot encode, goes through txredisapi's C{_encode_value} (its value and its
    error). Without L{ONE_PASS_COMMANDS} txredisapi builds its commands itself.
    """

    def _build_command(self, *args: Any, **kwargs: Any) -> bytes:
        if not ONE_PASS_COMMANDS:
            return super()._build_command(*unframed(args), **kwargs)  # type: ignore[misc]
        charset = self.charset  # type: ignore[attr-defined]
        count = len(args)
        parts = [b""]  # (the count, once L{Framed} arguments are counted)
        append = parts.append
        for arg in args:
            kind = type(arg)
            if kind is not bytes:
                if kind is Framed:
                    count += len(arg.args) - 1
                    append(arg.data)
                    continue
                if kind is int:
                    arg = b"%d" % arg
                elif kind is str and charset is None:
                    try:
                        arg = arg.encode()
                    except UnicodeError:
                        arg = self._encode_value(arg)  # type: ignore[attr-defined]  # (txredisapi's error)
                else:
                    arg = self._encode_value(arg)  # type: ignore[attr-defined]
            append(b"$%d\r\n" % len(arg))
            append(arg)
            append(b"\r\n")
        parts[0] = b"*%d\r\n" % count
        return b"".join(parts)


# -- commands: one Deferred each ----------------------------------------------------------------------

ONE_DEFERRED = code_uses(
    txredisapi.BaseRedisProtocol.execute_command,
    "connected", "_build_command", "pipelining", "transport", "write", "replyQueue", "get", "handle_reply",
    "replyTimeout", "callLater", "inMulti",
) and code_uses(txredisapi.ReplyQueue._cancelGet, "waiting")  # fmt: skip
"""txredisapi's C{execute_command} writes the command, takes its reply from the protocol's
C{replyQueue} (a C{DeferredQueue}: C{get()} waits in C{waiting}, each reply C{put} fires the first;
a cancelled C{get} leaves a stand-in there, C{ReplyQueue._cancelGet}), raises an error reply
(C{handle_reply}) and, with C{replyTimeout}, sets a reply timer with the protocol's C{callLater} that
fails every waiting reply with C{TimeoutError} and aborts the connection."""


class OneDeferredCommands:
    """Mixed into relayd's txredisapi pool protocol: a command's answer is the reply queue's own Deferred.

    txredisapi hands each command a second Deferred fed from the queue's, through three callbacks
    (C{handle_reply}, one that feeds it unless it already fired, one that cancels the reply timer) and
    three closures made per command. Here the queue's Deferred is the answer, with one callback that
    cancels the timer and raises an error reply; the timer fails the same replies and drops the
    connection the same way (the answer waiting in the queue gets the C{TimeoutError} as its reply), and
    cancelling the answer leaves the queue's stand-in as txredisapi's cancel does. Pipelining,
    C{MULTI}, or any keyword (C{apply_timeout}, C{post_proc}) go to txredisapi's own, as does every
    command without L{ONE_DEFERRED} or on a connection whose reply timers are not on relayd's clock.
    """

    reply_clock: Any = None  # (L{time_replies_with}: the clock its reply timers are deadlines of)

    def send_command(self, data: bytes) -> None:
        """Write a command's bytes as txredisapi does (relayd's pool connections send at once:
        relayd/storage/redis.py)."""
        self.transport.write(data)  # type: ignore[attr-defined]

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        clock = self.reply_clock
        if kwargs or clock is None or not ONE_DEFERRED or self.pipelining or self.inMulti:  # type: ignore[attr-defined]
            return super().execute_command(*args, **kwargs)  # type: ignore[misc]
        if self.connected == 0:  # type: ignore[attr-defined]
            raise txredisapi.ConnectionError("Not connected")
        self.send_command(self._build_command(*args))  # type: ignore[attr-defined]
        queue = self.replyQueue  # type: ignore[attr-defined]
        answer = queue.get()
        seconds = self.replyTimeout  # type: ignore[attr-defined]
        if not seconds:
            return answer.addCallback(_raise_error_reply)
        transport = self.transport  # type: ignore[attr-defined]

        def expired() -> None:
            error_text = f"Not received Redis response in {seconds} seconds"  # (txredisapi's text)
            while queue.waiting:
                queue.put(txredisapi.TimeoutError(error_text))
            transport.abortConnection()

        timer = clock.deadline(seconds, expired)  # (what txredisapi's timer is: L{time_replies_with})

        def answered(reply: Any) -> Any:
            if timer.active():
                timer.cancel()
            return _raise_error_reply(reply)

        return answer.addBoth(answered)


def _raise_error_reply(reply: Any) -> Any:
    """txredisapi's C{handle_reply}: an error reply fails the command."""
    if isinstance(reply, Exception):
        raise reply
    return reply


# -- commands: their reply timers -------------------------------------------------------------------

REPLY_TIMERS = code_uses(txredisapi.BaseRedisProtocol.execute_command, "callLater", "replyTimeout")
"""txredisapi times each command's reply (C{replyTimeout} seconds) with the protocol's C{callLater},
and uses only the returned call's C{active} and C{cancel}."""


def time_replies_with(protocol: Any, clock: Any) -> None:
    """Have C{protocol} set its reply timers as C{clock}'s deadlines (L{Timekeeper.give_deadlines}:
    one reactor call for every reply of one timeout pending, where txredisapi sets a reactor call
    per command and cancels it when the reply comes). Without L{REPLY_TIMERS} nothing changes."""
    if REPLY_TIMERS:
        clock.give_deadlines(protocol)
        protocol.reply_clock = clock  # (for L{OneDeferredCommands} and L{reply_timer_first})


def reply_timer_first(protocol: Any, clock: Any, seconds: float) -> bool:
    """Whether a command written now on C{protocol} (without keywords) fails by its own reply timer
    before a C{clock} deadline of C{seconds} set after it would fire: the timer is a deadline of the
    same length on the same clock (L{time_replies_with}), and deadlines of one length expire in the
    order they were set. Such a deadline would never fire: the caller can go without it."""
    return REPLY_TIMERS and getattr(protocol, "reply_clock", None) is clock and protocol.replyTimeout == seconds


# -- commands: a connection without a Deferred -------------------------------------------------------

IDLE_CONNECTIONS = code_uses(txredisapi.RedisFactory.addConnection, "connectionQueue") and code_uses(
    txredisapi.PeekableQueue.peek, "pending", "random"
)
"""A txredisapi pool keeps the connections it hands out (each once its handshake is done) in its
C{connectionQueue}'s C{pending} list, where C{getConnection(peek=True)} picks one at random; a lost
connection stays there until a pick finds it no longer C{connected}."""


def idle_connection(factory: Any) -> Any:
    """A connection of C{factory}'s pool to send a command on now, picked as txredisapi picks one
    (at random among those handed out), or C{None}: none yet, the one picked lost, or no
    L{IDLE_CONNECTIONS} (then the caller asks the pool as before). txredisapi's own way is a
    generator (C{getConnection}) and two Deferreds per command, whatever the pool holds."""
    if not IDLE_CONNECTIONS:
        return None
    pending = factory.connectionQueue.pending
    if not pending:
        return None
    connection = pending[0] if len(pending) == 1 else random.choice(pending)
    return connection if connection.connected else None
