"""Shared contract fixtures (docs/buzz-broker.md section 1.7)."""

from __future__ import annotations

import copy
from typing import Any, Iterator

from relayd.buzz import nostr

CHANNEL = "b2c38ca8-9ec3-411e-bab5-f9deab34d52e"
PUBKEY = "a02c4e0850e5e612b4ddf95dbe2f5c56467cf27c6552203bc833ff438fb31971"
EVENT = "78d47c4f36a2d048f45b57a31d964a3ce239f0fc46162c5d7c90db2b5aa52bc6"
RID = "a9f3c2e1-0b5d-4e8a-9c71-3f2b6d8e4a10"

_FIXTURE_SIGNER = nostr.Signer((7).to_bytes(32, "big"))


def read_event() -> dict[str, Any]:
    """The read fixture: kind 9, 'hello', h/e-root/p tags, really signed."""
    return _FIXTURE_SIGNER.sign(
        9, [["h", CHANNEL], ["e", EVENT, "", "root"], ["p", PUBKEY]], "hello", 1787675388
    )


READ_EVENT = read_event()

ARGS: dict[str, dict[str, Any]] = {
    "channel.read": {
        "channelId": CHANNEL,
        "rootEventId": EVENT,
        "mentionsOnly": True,
        "cursor": "c1",
        "limit": 50,
    },
    "message.post": {"channelId": CHANNEL, "content": "hello", "mentions": [PUBKEY]},
    "message.reply": {
        "channelId": CHANNEL,
        "replyToEventId": EVENT,
        "content": "On it.",
        "mentions": [PUBKEY],
    },
    "reaction.add": {"channelId": CHANNEL, "targetEventId": EVENT, "reaction": "👍"},
    "profile.set": {"displayName": "Helper", "about": "I help.", "picture": "https://example.com/a.png"},
    "storage.address": {"slug": "mem/slice-c"},
    "agents.create": {
        "channelId": CHANNEL,
        "displayName": "helper",
        "systemPrompt": "Be helpful.",
        "runtime": "buzz-acp",
        "provider": "anthropic",
        "model": "claude-sonnet-4-5",
        "respondTo": "owner-only",
    },
    "agents.update": {
        "target": {"pubkey": PUBKEY},
        "displayName": "helper2",
        "systemPrompt": "Be brief.",
        "runtime": "buzz-acp",
        "provider": "anthropic",
        "model": "claude-sonnet-4-5",
        "respondTo": "anyone",
    },
    "agents.delete": {"target": {"name": "helper"}},
}

OUTCOMES: dict[str, dict[str, Any]] = {
    "channel.read": {"messages": [READ_EVENT], "nextCursor": "c2"},
    "message.post": {"eventId": EVENT, "kind": 9, "createdAt": 1787675471},
    "message.reply": {"eventId": EVENT, "kind": 9, "createdAt": 1787675471},
    "reaction.add": {"eventId": EVENT, "kind": 7, "createdAt": 1787675471},
    "profile.set": {"eventId": EVENT, "kind": 0, "createdAt": 1787675471},
    "storage.address": {"authorPubkey": PUBKEY, "kind": 30174, "dTag": EVENT},
    "agents.create": {"agentPubkey": PUBKEY, "displayName": "helper", "channelId": CHANNEL},
    "agents.update": {"agentPubkey": PUBKEY, "displayName": "helper2", "updatedFields": ["displayName"]},
    "agents.delete": {"agentPubkey": PUBKEY, "displayName": "helper"},
}


def request_wire(action: str, args: dict[str, Any] | None = None, rid: str = RID) -> dict[str, Any]:
    return {
        "type": "broker_request",
        "protocolVersion": 1,
        "requestId": rid,
        "actionVersion": 1,
        "action": action,
        "args": copy.deepcopy(ARGS[action] if args is None else args),
    }


def success_wire(action: str, replayed: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "broker_result",
        "protocolVersion": 1,
        "requestId": RID,
        "status": "succeeded",
        "action": action,
        "outcome": copy.deepcopy(OUTCOMES[action]),
    }
    if replayed:
        out["replayed"] = True
    return out


def error_wire(status: str, code: str, replayed: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "broker_result",
        "protocolVersion": 1,
        "requestId": RID,
        "status": status,
        "error": {"code": code, "message": "nope"},
    }
    if replayed:
        out["replayed"] = True
    return out


def member_paths(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every object-member path at any depth (including inside arrays)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield path + (k,)
            yield from member_paths(v, path + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from member_paths(v, path + (i,))


def set_path(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    tree = copy.deepcopy(tree)
    node = tree
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return tree
