"""Capture levels, relayd's own field annotations, and fan-out downlevel (docs/aep.md).

The relay asks L{downlevel_target} once per (event, subscriber) -- a few dict lookups -- and calls
L{downlevel} at most once per (event, target level), sharing the result among subscribers.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Final, Iterable, Mapping

from relayd.aep.core.envelope import CAPTURE_LEVELS, js_str

__all__ = ["ANNOTATIONS", "LEVELS", "capture_error", "downlevel", "downlevel_target"]

LEVELS: Final = CAPTURE_LEVELS  # ("none", "metadata", "redacted", "full"), in rank order
_RANK: Final = {name: rank for rank, name in enumerate(LEVELS)}
_REDACTED: Final = _RANK["redacted"]

_R: Final = "redacted"
_F: Final = "full"

# docs/decisions.md AEP-13: the schemas' `x-aep-capture` annotations are relayd's own data, transcribed here
# from the schema files (tests/aep/test_capture.py checks the transcription against them when
# they are available). Only non-metadata fields are listed, because an unlisted path counts as
# metadata. Every type that has a payload schema has an entry, even when all its fields are
# metadata: the reference keeps (and prunes) `data` for such types but strips `data` wholesale
# for types it has no schema for (x.* and unknown types). Paths are dotted, `[]` marks array
# items; some schema property names themselves contain dots (`gen_ai.evaluation.explanation`),
# which the string paths match exactly as the reference does.
_TABLE: Final[dict[str, dict[str, str]]] = {
    "agent.health": {"detail": _R},
    "agent.heartbeat": {},
    "agent.idle": {},
    "agent.presence": {},
    "assessment.evaluation.recorded": {"gen_ai.evaluation.explanation": _R},
    "assessment.feedback.received": {"comment": _R, "correction": _R},
    "assessment.guardrail.recorded": {"guardrail.explanation": _R},
    "attention.answered": {"answer.text": _R},
    "attention.requested": {"context": _F},
    "attention.resolved": {},
    "attention.routed": {},
    "attention.timeout": {},
    "control.accepted": {},
    "control.attention.respond": {"answer.text": _R},
    "control.cancel": {"reason": _R},
    "control.pause": {},
    "control.rejected": {"detail": _R},
    "control.resume": {},
    "delegation.subagent.started": {},
    "delegation.subagent.stopped": {},
    "error.raised": {"error.message": _R},
    "progress.artifact.produced": {"artifact.name": _R, "artifact.uri": _R},
    "progress.status": {"message": _R},
    "progress.task.completed": {"task.title": _R},
    "progress.task.planned": {"task.title": _R},
    "resource.citation.recorded": {
        "citations[].cited_text": _F,
        "citations[].cited_text_redacted": _R,
        "citations[].source.uri": _R,
        "citations[].source.title": _R,
    },
    "resource.retrieval.requested": {"query": _R},
    "resource.retrieval.reranked": {
        "query": _R,
        "input_documents[].content": _F,
        "input_documents[].content_redacted": _R,
        "output_documents[].content": _F,
        "output_documents[].content_redacted": _R,
    },
    "resource.retrieval.returned": {"documents[].content": _F, "documents[].content_redacted": _R},
    "run.cancelled": {"reason": _R},
    "run.failed": {"error.message": _R},
    "run.finished": {"summary": _R},
    "run.started": {"prompt": _R},
    "run.step.finished": {},
    "run.step.started": {"name": _R},
    "session.compacted": {},
    "session.ended": {},
    "session.started": {"label": _R, "cwd": _R},
    "state.delta": {"delta": _R},
    "state.snapshot": {"state": _R},
    "tool.completed": {"result": _F, "result_redacted": _R},
    "tool.denied": {},
    "tool.failed": {"error.message": _R},
    "tool.requested": {"args": _F, "args_redacted": _R},
}

ANNOTATIONS: Final[Mapping[str, Mapping[str, str]]] = MappingProxyType(
    {t: MappingProxyType(paths) for t, paths in _TABLE.items()}
)

# Per type and target rank: (paths to drop, proper ancestors of those paths). A subtree whose
# path is not an ancestor holds nothing to drop and is copied without building path strings.
_Plan = tuple[frozenset[str], frozenset[str]]


def _plan(paths: Mapping[str, str], target_rank: int) -> _Plan:
    drop = frozenset(p for p, level in paths.items() if _RANK[level] > target_rank)
    ancestors = frozenset(p[:i] for p in drop for i, ch in enumerate(p) if ch in ".[")
    return drop, ancestors


_PLANS: Final[dict[str, tuple[_Plan, ...]]] = {
    t: tuple(_plan(paths, rank) for rank in range(len(LEVELS))) for t, paths in ANNOTATIONS.items()
}


def capture_error(value: object) -> str | None:
    """Validate a subscription capture ceiling (docs/decisions.md AEP-6); None when valid.

    None and "" mean "no ceiling" (the reference treats any falsy ceiling that way on both bindings).
    """
    if value is None or value == "" or (isinstance(value, str) and value in _RANK):
        return None
    return f"unknown capture level: {js_str(value)}"


def downlevel_target(ev: dict, ceiling: str | None) -> str | None:
    """The capture level C{ev} must be rewritten to for a subscriber with C{ceiling}.

    None means the event goes out unchanged (no ceiling, or ceiling not below the event's level).
    A mechanical hop never mints ``redacted``: a ``redacted`` ceiling on a ``full`` event yields
    ``metadata``. Raises ValueError for an invalid ceiling (validate with L{capture_error} first).
    """
    return capture_target(ev.get("capture"), ceiling)


def capture_target(ev_cap: object, ceiling: str | None) -> str | None:
    """L{downlevel_target} for an event whose C{capture} attribute is C{ev_cap} (C{None}: absent)."""
    if ceiling is None or ceiling == "":
        return None
    ceiling_rank = _RANK.get(ceiling) if isinstance(ceiling, str) else None
    if ceiling_rank is None:
        raise ValueError(f"unknown capture level: {js_str(ceiling)}")
    if ev_cap is None:
        ev_cap = "metadata"
    # An unvalidated level ranks -1 like JS indexOf, so it always passes unchanged.
    ev_rank = _RANK.get(ev_cap, -1) if isinstance(ev_cap, str) else -1
    if ceiling_rank >= ev_rank:
        return None
    if ceiling == "redacted" and ev_cap == "full":
        return "metadata"
    return ceiling


def _copy(value: object) -> object:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _prune(value: object, path: str, drop: frozenset[str], ancestors: frozenset[str]) -> object:
    if path not in ancestors:
        return _copy(value)
    if isinstance(value, list):
        item_path = path + "[]"
        return [_prune(v, item_path, drop, ancestors) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            child = f"{path}.{k}"
            if child not in drop:
                out[k] = _prune(v, child, drop, ancestors)
        return out
    return value


def _js_truthy(value: object) -> bool:
    if value is None or value is False:
        return False
    if isinstance(value, str):
        return value != ""
    if isinstance(value, (int, float)):
        return value == value and value != 0  # NaN and 0 are falsy
    return True


def _label_by_id(item: object) -> dict:
    # The reference spreads the item (`{...o, label: String(o.id)}`). A non-object item would
    # spread into index keys that can carry free text, so it is reduced to the label alone.
    if isinstance(item, dict):
        item["label"] = js_str(item.get("id")) if "id" in item else "undefined"
        return item
    return {"label": "undefined"}


def _degrade_request(ev: dict, data: dict) -> None:
    """Structural degrade of attention.requested's [metadata*] fields, in place on the pruned copy."""
    if isinstance(data.get("prompt"), str):
        kind = data.get("kind")
        subject = ev.get("subject")
        prompt = f"{js_str(ev.get('agent'))} requests {'attention' if kind is None else js_str(kind)}"
        if _js_truthy(subject):
            prompt += f": {js_str(subject)}"
        data["prompt"] = prompt
    options = data.get("options")
    if isinstance(options, list):
        data["options"] = [_label_by_id(o) for o in options]
    fields = data.get("fields")
    if isinstance(fields, list):
        degraded = []
        for f in fields:
            f = _label_by_id(f)
            choices = f.get("choices")
            if isinstance(choices, list):
                f["choices"] = [_label_by_id(c) for c in choices]
            degraded.append(f)
        data["fields"] = degraded


def _degrade_answer(data: dict) -> None:
    """Keep only number/boolean answer.values entries: strings and arrays may be free text."""
    answer = data.get("answer")
    if not isinstance(answer, dict):
        return
    values = answer.get("values")
    items: Iterable[tuple[str, Any]]
    if isinstance(values, dict):
        items = values.items()
    elif isinstance(values, list):
        items = ((str(i), v) for i, v in enumerate(values))  # JS Object.entries on an array
    else:
        return
    # bool is an int subclass, so this keeps exactly JS numbers and booleans.
    answer["values"] = {k: v for k, v in items if isinstance(v, (int, float))}


def downlevel(ev: dict, target: str) -> dict:
    """A new event rewritten to capture level C{target}; C{ev} is never mutated.

    ``data`` is rebuilt (never shared with the input): fields annotated above C{target} are
    pruned, the [metadata*] fields degrade structurally below ``redacted``, and ``data`` is
    removed for target ``none``, for types without annotations (``x.*``, unknown) and when it is
    not a JSON object. Other attributes are copied shallowly with ``capture`` set to C{target}.
    """
    rank = _RANK.get(target) if isinstance(target, str) else None
    if rank is None:
        raise ValueError(f"unknown capture level: {js_str(target)}")
    out = dict(ev)
    out["capture"] = target
    data = ev.get("data")
    t = ev.get("type")
    plans = _PLANS.get(t) if isinstance(t, str) else None
    # A non-object `data` is dropped too: the reference would spread a string into
    # index-keyed characters, and dropping more than required is always legal.
    if rank == 0 or plans is None or not isinstance(data, dict):
        out.pop("data", None)
        return out
    drop, ancestors = plans[rank]
    pruned: dict = {}
    for k, v in data.items():
        if k not in drop:
            pruned[k] = _prune(v, k, drop, ancestors)
    if rank < _REDACTED:
        if t == "attention.requested":
            _degrade_request(ev, pruned)
        elif t == "attention.answered" or t == "control.attention.respond":
            _degrade_answer(pruned)
    out["data"] = pruned
    return out
