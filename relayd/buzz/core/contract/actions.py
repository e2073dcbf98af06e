"""The nine actions' argument and outcome shapes (docs/broker.md "The nine actions")."""

from __future__ import annotations

from typing import Any

from relayd.buzz.core.contract.errors import ContractError
from relayd.buzz.core.contract.validators import (
    CheckedEvents,
    Shape,
    boolean,
    bounded_text,
    channel_id,
    content,
    cursor,
    hex64,
    integer,
    json_object,
    pubkey,
    respond_to,
    signed_event,
    slug,
)
from relayd.buzz.core.contract.vocabulary import (
    MAX_ABOUT,
    MAX_LIMIT,
    MAX_MENTIONS,
    MAX_NAME,
    MAX_PICTURE,
    MAX_PROMPT,
    MAX_REACTION,
    MAX_SCALAR,
)


def _limit(v: Any, path: str) -> int:
    return integer(v, path, 1, MAX_LIMIT)


def _mentions(v: Any, path: str) -> list[str]:
    if type(v) is not list:
        raise ContractError(f"{path} must be an array")
    if not v:
        raise ContractError(f"{path} must be omitted when empty")
    if len(v) > MAX_MENTIONS:
        raise ContractError(f"{path} has too many entries (limit {MAX_MENTIONS})")
    return [pubkey(x, f"{path}[{i}]") for i, x in enumerate(v)]


def _target(v: Any, path: str) -> dict[str, str]:
    obj = json_object(v, path)
    if set(obj) == {"pubkey"}:
        return {"pubkey": pubkey(obj["pubkey"], f"{path}.pubkey")}
    if set(obj) == {"name"}:
        return {"name": bounded_text(MAX_NAME)(obj["name"], f"{path}.name")}
    raise ContractError(f"{path} must have exactly one of pubkey or name")


_name = bounded_text(MAX_NAME)
_scalar = bounded_text(MAX_SCALAR)

ARGS: dict[str, Shape] = {
    "channel.read": Shape(
        {"channelId": channel_id},
        {
            "rootEventId": hex64,
            "mentionsOnly": boolean,
            "cursor": cursor,
            "limit": _limit,
        },
    ),
    "message.post": Shape({"channelId": channel_id, "content": content}, {"mentions": _mentions}),
    "message.reply": Shape(
        {"channelId": channel_id, "replyToEventId": hex64, "content": content},
        {"mentions": _mentions},
    ),
    "reaction.add": Shape(
        {"channelId": channel_id, "targetEventId": hex64, "reaction": bounded_text(MAX_REACTION)}
    ),
    "profile.set": Shape(
        {}, {"displayName": _name, "about": bounded_text(MAX_ABOUT), "picture": bounded_text(MAX_PICTURE)}
    ),
    "storage.address": Shape({"slug": slug}),
    "agents.create": Shape(
        {"channelId": channel_id, "displayName": _name, "systemPrompt": bounded_text(MAX_PROMPT)},
        {"runtime": _scalar, "provider": _scalar, "model": _scalar, "respondTo": respond_to},
    ),
    "agents.update": Shape(
        {"target": _target},
        {
            "displayName": _name,
            "systemPrompt": bounded_text(MAX_PROMPT),
            "runtime": _scalar,
            "provider": _scalar,
            "model": _scalar,
            "respondTo": respond_to,
        },
    ),
    "agents.delete": Shape({"target": _target}),
}


def _messages(v: Any, path: str) -> list[dict[str, Any]]:
    if type(v) is CheckedEvents:
        if len(v) > MAX_LIMIT:
            raise ContractError(f"{path} holds more than {MAX_LIMIT} events")
        return v
    if type(v) is not list:
        raise ContractError(f"{path} must be an array")
    if len(v) > MAX_LIMIT:
        raise ContractError(f"{path} holds more than {MAX_LIMIT} events")
    return [signed_event(e, f"{path}[{i}]") for i, e in enumerate(v)]


def _updated_fields(v: Any, path: str) -> list[str]:
    if type(v) is not list or any(type(x) is not str for x in v):
        raise ContractError(f"{path} must be an array of strings")
    return list(v)


_published = Shape(
    {
        "eventId": hex64,
        "kind": lambda v, p: integer(v, p, 0, 2**32 - 1),
        "createdAt": lambda v, p: integer(v, p, 0, 2**64 - 1),
    }
)

OUTCOMES: dict[str, Shape] = {
    "channel.read": Shape({"messages": _messages}, {"nextCursor": cursor}),
    "message.post": _published,
    "message.reply": _published,
    "reaction.add": _published,
    "profile.set": _published,
    "storage.address": Shape(
        {"authorPubkey": pubkey, "kind": lambda v, p: integer(v, p, 0, 2**32 - 1), "dTag": hex64}
    ),
    "agents.create": Shape({"agentPubkey": pubkey, "displayName": _name, "channelId": channel_id}),
    "agents.update": Shape(
        {"agentPubkey": pubkey, "displayName": _name, "updatedFields": _updated_fields}
    ),
    "agents.delete": Shape({"agentPubkey": pubkey, "displayName": _name}),
}


def check_args_semantics(action: str, args: dict[str, Any]) -> None:
    """What a shape cannot say: the members an action needs at least one of."""
    if action == "profile.set" and not args:
        raise ContractError("profile.set needs at least one of displayName, about, picture")
    if action == "agents.update" and len(args) < 2:
        raise ContractError("agents.update needs at least one field to change besides target")
