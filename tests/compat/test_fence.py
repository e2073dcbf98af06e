"""No module outside relayd/compat/ reaches into Twisted's, autobahn's, txredisapi's or prometheus_client's private (or
undocumented) state; the fence imports nothing of relayd's above it."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Any

from twisted.trial.unittest import TestCase

import relayd
from relayd import compat
from relayd.compat import txredisapi as redis_fence

# -- nothing outside the fence touches a private attribute -----------------------------------------------

_PACKAGE = Path(relayd.__file__).parent
_FENCE = Path(compat.__file__).parent.resolve()
_FENCES = {*(p.resolve() for p in _FENCE.glob("*.py")), Path(redis_fence.__file__).resolve()}
_THIRD_PARTY = ("twisted", "autobahn", "txredisapi", "prometheus_client")

# Public but undocumented attributes of Twisted's and autobahn's objects: their state, which a release
# may rename or re-purpose without a deprecation (HTTPChannel's request queue and line-reader state,
# a Request's write state and finish list, a TCP transport's buffers, autobahn's parser and queue).
UNDOCUMENTED = frozenset({
    "requests", "line_mode", "paused", "length", "persistent", "chunked", "sentLength", "startedWriting",
    "notifications", "queued", "dataBuffer", "offset", "producerPaused", "send_queue", "current_frame",
    "inside_message",
})

# Our own objects whose private (or undocumented) names happen to be spelled like one of Twisted's or
# autobahn's. Each entry: (module under relayd/, attribute) -> why it is ours.
_OURS = {
    ("aep/http.py", "paused"): "SSEStream's own flow state",
    ("aep/core/index.py", "_scan"): "the subscription index's own scan",
    ("aep/core/index.py", "_buckets"): "the subscription index's own buckets (prometheus_client's histograms have theirs)",
    ("aep/websocket.py", "paused"): "AEPSocket's own flow state (autobahn has none of that name)",
    ("aep/websocket.py", "_open"): "AEPSocket's own state",
    ("aep/socket_flow.py", "paused"): "AEPSocket's own flow state, which its flow sets",
    ("mcp/endpoint/exchange.py", "requests"): "an MCP intake's own JSON-RPC requests",
    ("mcp/endpoint/legacy_sse.py", "requests"): "an MCP intake's own JSON-RPC requests",
    ("mcp/endpoint/stateless.py", "requests"): "an MCP intake's own JSON-RPC requests",
    ("mcp/endpoint/streamable.py", "requests"): "an MCP intake's own JSON-RPC requests",
    ("mcp/http.py", "_log"): "the MCP resource's own Logger",
    ("mcp/http.py", "paused"): "SSEStream's own flow state",
    ("storage/redis.py", "_message"): "the Redis bus's own handler",
}


def _third_party_private_names() -> frozenset[str]:
    """Every single-underscore name Twisted's, autobahn's, txredisapi's and prometheus_client's modules define or assign."""
    import autobahn
    import prometheus_client
    import txredisapi

    import twisted

    names: set[str] = set()
    pattern = re.compile(r"(?:self\.|def |class |^\s+)(_[A-Za-z][A-Za-z0-9_]*)\b", re.MULTILINE)
    for package in (twisted, autobahn, txredisapi, prometheus_client):
        root = Path(package.__file__).parent
        # txredisapi is one module, not a package
        files = root.rglob("*.py") if Path(package.__file__).name == "__init__.py" else [Path(package.__file__)]
        for path in files:
            if "test" in path.relative_to(root).parts[:-1] or path.name.startswith("test_"):
                continue
            names.update(m for m in pattern.findall(path.read_text(errors="replace")) if not m.endswith("__"))
    return frozenset(names)


def _third_party_bases(tree: ast.Module, module: Any) -> dict[str, list[type]]:
    """The third-party classes among the bases of each class in C{module}, and of a mixin (a class
    of C{module} that other classes of it combine with a third-party class) those of the classes using it."""
    classes = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            cls = getattr(module, node.name, None)
            if inspect.isclass(cls):
                classes[node.name] = cls
    found: dict[str, list[type]] = {}
    for name, cls in classes.items():
        users = [other for other in classes.values() if cls in other.__mro__]
        found[name] = [
            b
            for user in users
            for b in user.__mro__
            if (getattr(b, "__module__", "") or "").split(".")[0] in _THIRD_PARTY
        ]
    return found


def private_uses(source: str, relative: str, module: Any, private: frozenset[str]) -> list[str]:
    """Where C{source} (relayd/C{relative}, imported as C{module}) touches a private name of Twisted,
    autobahn or txredisapi, or one of their L{UNDOCUMENTED} attributes (other than our own)."""
    tree = ast.parse(source)
    bases = _third_party_bases(tree, module)
    uses: list[str] = []

    def flag(node: ast.AST, name: str) -> None:
        if (name in private or name in UNDOCUMENTED) and (relative, name) not in _OURS:
            uses.append(f"{relative}:{getattr(node, 'lineno', 0)}: {name}")

    def inherited(cls: str, name: str) -> bool:
        return any(name in vars(b) or _assigns(b, name) for b in bases.get(cls, ()))

    def reached(name: str) -> bool:
        return (name.startswith("_") and not name.startswith("__")) or name in UNDOCUMENTED

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and reached(node.attr):
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            own = own or (isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "super")
            if not own:
                flag(node, node.attr)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                if reached(node.args[1].value):
                    flag(node, node.args[1].value)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            # Rebuilding an object's dict (what the fence's slim_stream does to Twisted's request).
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr == "__dict__":
                    uses.append(f"{relative}:{node.lineno}: __dict__ rewritten")
        elif isinstance(node, (ast.ImportFrom,)) and node.module and node.module.split(".")[0] in _THIRD_PARTY:
            for alias in node.names:
                if alias.name.startswith("_") or any(p.startswith("_") for p in node.module.split(".")):
                    uses.append(f"{relative}:{node.lineno}: from {node.module} import {alias.name}")
    # In a subclass of a Twisted or autobahn class: its own private or undocumented state (read,
    # written, or given a value in the class body) and private methods.
    for cls_node in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls_node):
            names: list[str] = []
            if isinstance(node, ast.Attribute) and (
                (isinstance(node.value, ast.Name) and node.value.id == "self")
                or (isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "super")
            ):
                names = [node.attr]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_"):
                names = [node.name]
            for name in names:
                if reached(name) and inherited(cls_node.name, name):
                    uses.append(f"{relative}:{node.lineno}: {cls_node.name} uses inherited {name}")
        for statement in cls_node.body:  # class-body assignments: C{_x = ...}, C{_x: T = ...}
            targets: list[ast.expr] = []
            if isinstance(statement, ast.Assign):
                targets = statement.targets
            elif isinstance(statement, ast.AnnAssign):
                targets = [statement.target]
            for target in targets:
                for name_node in (n for n in ast.walk(target) if isinstance(n, ast.Name)):
                    name = name_node.id
                    if reached(name) and inherited(cls_node.name, name):
                        uses.append(f"{relative}:{statement.lineno}: {cls_node.name} assigns inherited {name}")
    return uses


def _assigns(cls: type, name: str) -> bool:
    """Whether C{cls}'s own methods assign or read C{self.<name>}."""
    for value in vars(cls).values():
        code = getattr(value, "__code__", None)
        if code is not None and name in code.co_names:
            return True
    return False


def _modules() -> list[tuple[Path, Any]]:
    import importlib

    found = []
    for path in sorted(_PACKAGE.rglob("*.py")):
        if path.resolve() in _FENCES:
            continue
        dotted = ".".join(("relayd", *path.relative_to(_PACKAGE).with_suffix("").parts))
        found.append((path, importlib.import_module(dotted.removesuffix(".__init__"))))
    return found


class Fence(TestCase):
    def test_no_private_use_outside_the_fence(self) -> None:
        private = _third_party_private_names()
        uses = [
            use
            for path, module in _modules()
            for use in private_uses(path.read_text(), path.relative_to(_PACKAGE).as_posix(), module, private)
        ]
        self.assertEqual(uses, [], "move these into relayd/compat/ (the module of the library they read)")

    def test_the_scan_sees_a_private_use(self) -> None:
        """A module reaching into a transport, a request, or an inherited private hook is caught."""
        private = _third_party_private_names()
        sample = (
            "from twisted.web.http import HTTPChannel\n"
            "from twisted.web.http import _GenericHTTPChannelProtocol\n"
            "def f(transport, request):\n"
            "    return transport._tempDataBuffer, getattr(request, '_disconnected', False)\n"
            "class C(HTTPChannel):\n"
            "    _mine = 0\n"
            "    def _respondToBadRequestAndDisconnect(self):\n"
            "        return self._networkProducer, self._mine\n"
        )
        namespace: dict[str, Any] = {}
        exec(compile(sample, "sample.py", "exec"), namespace)
        uses = private_uses(sample, "web/sample.py", type("M", (), namespace), private)
        self.assertEqual(
            sorted(u.split(": ", 1)[1] for u in uses),
            ["C uses inherited _networkProducer", "C uses inherited _respondToBadRequestAndDisconnect",
             "_disconnected", "_tempDataBuffer",
             "from twisted.web.http import _GenericHTTPChannelProtocol"],
        )

    def test_the_scan_sees_class_body_assignments_and_undocumented_state(self) -> None:
        """A private or undocumented attribute of Twisted's given a value in a subclass's body, read or
        set on a subclass's self, or read or changed on another object, and an object's dict
        rebuilt, are caught (our own attributes, and public documented ones, are not)."""
        private = _third_party_private_names()
        sample = (
            "from twisted.web.http import HTTPChannel\n"
            "from twisted.web.server import Request\n"
            "class R(Request):\n"
            "    _parsePOSTFormSubmission = False\n"
            "    queued: int = 0\n"
            "    defaultContentType = None\n"
            "    _mine = 1\n"
            "class C(HTTPChannel):\n"
            "    totalHeadersSize = 100\n"
            "    def requestDone(self, request):\n"
            "        if self.persistent:\n"
            "            self.paused = True\n"
            "        return self.line_mode, self.transport\n"
            "def held(channel, request):\n"
            "    channel.requests.remove(request)\n"
            "    return request.sentLength, request.chunked, getattr(request, 'startedWriting', 0), request.finished\n"
            "def slim(request):\n"
            "    request.__dict__ = {}\n"
        )
        namespace: dict[str, Any] = {}
        exec(compile(sample, "sample.py", "exec"), namespace)
        uses = private_uses(sample, "web/sample.py", type("M", (), namespace), private)
        self.assertEqual(
            sorted(u.split(": ", 1)[1] for u in uses),
            ["C uses inherited line_mode", "C uses inherited paused", "C uses inherited persistent",
             "R assigns inherited _parsePOSTFormSubmission", "R assigns inherited queued",
             "__dict__ rewritten", "chunked", "requests", "sentLength", "startedWriting"],
        )

    def test_the_scan_sees_a_txredisapi_private_use(self) -> None:
        """A pool's private factory, a private helper, and txredisapi's readiness state set in a mixin."""
        private = _third_party_private_names()
        sample = (
            "import txredisapi\n"
            "def pool(host):\n"
            "    p = txredisapi.lazyConnectionPool(host)\n"
            "    return p._factory, txredisapi._makeEndpoint(host, 6379)\n"
            "class Ready:\n"
            "    def connectionMade(self):\n"
            "        self._ready = True\n"
            "class P(Ready, txredisapi.RedisProtocol):\n"
            "    pass\n"
        )
        namespace: dict[str, Any] = {}
        exec(compile(sample, "sample.py", "exec"), namespace)
        uses = private_uses(sample, "sample.py", type("M", (), namespace), private)
        self.assertEqual(sorted(u.split(": ", 1)[1] for u in uses), ["Ready uses inherited _ready", "_factory", "_makeEndpoint"])

    def test_the_fences_import_no_wing(self) -> None:
        # The fence imports nothing of relayd's but itself; txredisapi's only the fence's detection.
        allowed = {path: {"relayd.compat.detect", "relayd.compat.tcp"} for path in _FENCE.glob("*.py")}
        allowed[Path(redis_fence.__file__).resolve()] = {"relayd.compat.detect"}
        for path, may in allowed.items():
            tree = ast.parse(path.read_text())
            imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            self.assertLessEqual({m for m in imported if m.startswith("relayd")}, may, path.name)
