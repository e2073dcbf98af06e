"""The contract's fixed terms: versions, the nine action names, verdict codes and statuses, limits.

docs/broker.md ("HTTP", "The nine actions", "Verdict codes", "Limits") is the reference;
tests/buzz/test_broker_doc.py holds the two to the same numbers.
"""

from __future__ import annotations

PROTOCOL_VERSION = 1
ACTION_VERSION = 1

ACTIONS: tuple[str, ...] = (
    "channel.read",
    "message.post",
    "message.reply",
    "reaction.add",
    "profile.set",
    "storage.address",
    "agents.create",
    "agents.update",
    "agents.delete",
)
PUBLISHING_ACTIONS = frozenset({"message.post", "message.reply", "reaction.add", "profile.set"})
BEST_EFFORT_ACTIONS = frozenset({"reaction.add"})

CODES: tuple[str, ...] = (
    "invalid_request",
    "unsupported_protocol_version",
    "unknown_action",
    "unsupported_action_version",
    "unsupported",
    "unauthenticated",
    "unauthorized",
    "request_id_conflict",
    "action_failed",
    "outcome_unknown",
    "internal",
)
# The status/code table of docs/broker.md, "Verdict codes".
CODE_STATUSES: dict[str, frozenset[str]] = {c: frozenset({"failed"}) for c in CODES}
CODE_STATUSES["outcome_unknown"] = frozenset({"indeterminate"})
CODE_STATUSES["internal"] = frozenset({"failed", "indeterminate"})

STATUSES = ("succeeded", "failed", "indeterminate")

DEFAULT_LIMIT = 100
MAX_LIMIT = 500
MAX_CONTENT_BYTES = 65_536
MAX_MENTIONS = 50
MAX_NAME = 120
MAX_ABOUT = 2_000
MAX_PICTURE = 300
MAX_PROMPT = 20_000
MAX_SCALAR = 300
MAX_REACTION = 66
MAX_SLUG = 255
MAX_CHANNEL_TEXT = 128
MAX_REQUEST_ID = 128
MAX_CURSOR = 256
# Containers nested in one payload: the contract's deepest is a read outcome's tag (6 levels).
MAX_DEPTH = 32
# Characters of a member name (chosen by whoever sent the payload) an error message quotes.
MAX_ECHO = 64
# Longest error message: whatever a message quotes, a verdict never grows with the request.
MAX_ERROR = 512
RESPOND_TO = ("owner-only", "anyone")
STORAGE_KIND = 30174
