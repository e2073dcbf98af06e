"""Tests for relayd.aep.core.capture: ceilings, downlevel (aep.md section 6), annotations (decision 13)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from twisted.trial.unittest import TestCase

from relayd.aep.core.capture import ANNOTATIONS, LEVELS, capture_error, downlevel, downlevel_target
from tests.support.cases import cases, expand

AEP_DATA = Path(__file__).resolve().parent / "data"  # vendored AEP conformance data (see its NOTICE.md)
FIXTURES = AEP_DATA / "fixtures"
SCHEMA_TYPES = AEP_DATA / "schemas" / "types"


def _ev(event_id: str, type_: str, capture: str | None, data: Any = None, **extra: Any) -> dict:
    """A relay-grade valid event; agent defaults to "a", session to "s1"."""
    agent = extra.pop("agent", "a")
    ev: dict[str, Any] = {
        "aep": "0.1",
        "id": event_id,
        "type": type_,
        "time": "2026-07-03T10:00:00Z",
        "source": f"aep://h/agent/{agent}",
        "agent": agent,
        "session": "s1",
    }
    ev.update(extra)
    if capture is not None:
        ev["capture"] = capture
    if data is not None:
        ev["data"] = data
    return ev


def _apply(ev: dict, ceiling: str | None) -> dict:
    """What a subscriber with this ceiling receives, as the relay composes the two calls."""
    target = downlevel_target(ev, ceiling)
    return ev if target is None else downlevel(ev, target)


def _check_downlevel(ceiling: str, ev: dict, expect_capture: str, expect_data: dict | None) -> None:
    before = copy.deepcopy(ev)
    out = _apply(ev, ceiling)
    assert ev == before, "the input event was mutated"
    assert out.get("capture") == expect_capture
    if expect_data is None:
        assert "data" not in out
    else:
        assert out["data"] == expect_data
    # Only capture and data may change; every other attribute rides through.
    strip = lambda e: {k: v for k, v in e.items() if k not in ("capture", "data")}  # noqa: E731
    assert strip(out) == strip(ev)


# aep.md section 9.3 B, transcribed from conformance/fixtures/downlevel (Apache-2.0).
DOWNLEVEL_CASES: list[tuple[str, dict, str, dict | None]] = [
    # DL1: attention.answered redacted->metadata
    (
        "metadata",
        _ev(
            "DL1", "attention.answered", "redacted",
            {"answer": {"option": "2",
                        "text": "SECRET free text",
                        "values": {"name": "billing-api",
                                   "staged": True,
                                   "replicas": 3,
                                   "regions": ["1", "3"],
                                   "db": "MariaDB"}},
             "via": "control"},
            subject="R1", seq=0,
        ),
        "metadata",
        {"answer": {"option": "2", "values": {"staged": True, "replicas": 3}}, "via": "control"},
    ),
    # DL2: control.attention.respond redacted->metadata
    (
        "metadata",
        _ev(
            "DL2", "control.attention.respond", "redacted",
            {"answer": {"text": "SECRET guidance", "values": {"db": "MariaDB", "staged": False}}},
            subject="R1", agent="mc",
        ),
        "metadata",
        {"answer": {"values": {"staged": False}}},
    ),
    # DL3: attention.requested kind=form redacted->metadata
    (
        "metadata",
        _ev(
            "DL3", "attention.requested", "redacted",
            {"kind": "form",
             "prompt": "Database: Which database should the new service use?",
             "fields": [{"id": "1",
                         "type": "select",
                         "label": "Database: Which database should the new service use?",
                         "required": True,
                         "other": True,
                         "choices": [{"id": "1", "label": "PostgreSQL"}, {"id": "2", "label": "SQLite"}]}],
             "respond_via": ["control"]},
            subject="AskUserQuestion", agent="claude-code", seq=1,
        ),
        "metadata",
        {"kind": "form",
         "prompt": "claude-code requests form: AskUserQuestion",
         "fields": [{"id": "1",
                     "type": "select",
                     "label": "1",
                     "required": True,
                     "other": True,
                     "choices": [{"id": "1", "label": "1"}, {"id": "2", "label": "2"}]}],
         "respond_via": ["control"]},
    ),
    # DL4: attention.requested kind=permission redacted->metadata
    (
        "metadata",
        _ev(
            "DL4", "attention.requested", "redacted",
            {"kind": "permission",
             "prompt": "Permission requested: Bash — rm -rf build/",
             "options": [{"id": "allow", "label": "Allow"}, {"id": "deny", "label": "Deny"}],
             "respond_via": ["control"]},
            subject="Bash", agent="claude-code", seq=2,
        ),
        "metadata",
        {"kind": "permission",
         "prompt": "claude-code requests permission: Bash",
         "options": [{"id": "allow", "label": "allow"}, {"id": "deny", "label": "deny"}],
         "respond_via": ["control"]},
    ),
    # DL5: tool.failed redacted->metadata
    (
        "metadata",
        _ev(
            "DL5", "tool.failed", "redacted",
            {"tool": {"name": "Bash", "call_id": "t_1"},
             "error": {"type": "ExecError", "message": "SECRET /home/user/path failed"}},
            subject="Bash", seq=3,
        ),
        "metadata",
        {"tool": {"name": "Bash", "call_id": "t_1"}, "error": {"type": "ExecError"}},
    ),
    # DL6: tool.completed full at a redacted ceiling
    (
        "redacted",
        _ev(
            "DL6", "tool.completed", "full",
            {"tool": {"name": "Bash"},
             "status": "success",
             "result": "SECRET verbatim output",
             "result_digest": "a3f9c2d1e8b7a6f5a3f9c2d1e8b7a6f5"},
            subject="Bash", seq=4,
        ),
        "metadata",
        {"tool": {"name": "Bash"}, "status": "success", "result_digest": "a3f9c2d1e8b7a6f5a3f9c2d1e8b7a6f5"},
    ),
    # DL7: ceiling not lower
    (
        "redacted",
        _ev(
            "DL7", "attention.answered", "metadata",
            {"answer": {"option": "1"}, "via": "control"},
            subject="R1", seq=5,
        ),
        "metadata",
        {"answer": {"option": "1"}, "via": "control"},
    ),
    # DL8: type without annotations
    (
        "redacted",
        _ev(
            "DL8", "x.acme.session.custom_blob", "full",
            {"anything": "SECRET"},
            seq=6,
        ),
        "metadata",
        None,
    ),
    # DL9: ceiling none
    (
        "none",
        _ev(
            "DL9", "attention.answered", "redacted",
            {"answer": {"values": {"staged": True}}},
            subject="R1", seq=7,
        ),
        "none",
        None,
    ),
    # DL10: tool.completed full w/ verbatim result_redacted at a redacted ceiling
    (
        "redacted",
        _ev(
            "DL10", "tool.completed", "full",
            {"tool": {"name": "Bash", "call_id": "t_2"},
             "status": "success",
             "result": "SECRET verbatim output",
             "result_redacted": "SECRET output that never passed the §9.4 pipeline",
             "result_digest": "b4e8d1c2a9f7b6e5b4e8d1c2a9f7b6e5"},
            subject="Bash", seq=8,
        ),
        "metadata",
        {"tool": {"name": "Bash", "call_id": "t_2"},
         "status": "success",
         "result_digest": "b4e8d1c2a9f7b6e5b4e8d1c2a9f7b6e5"},
    ),
    # DL11: session.started full w/ verbatim label+cwd at a redacted ceiling
    (
        "redacted",
        _ev(
            "DL11", "session.started", "full",
            {"label": "SECRET task title quoting the prompt verbatim",
             "cwd": "/home/user/secret-project",
             "client": {"name": "cli", "version": "1.0.0"}},
            seq=9,
        ),
        "metadata",
        {"client": {"name": "cli", "version": "1.0.0"}},
    ),
    # DL12: tool.failed redacted source through a redacted ceiling
    (
        "redacted",
        _ev(
            "DL12", "tool.failed", "redacted",
            {"tool": {"name": "Bash", "call_id": "t_3"},
             "error": {"type": "ExecError", "message": "command failed in [REDACTED:secret] context"}},
            subject="Bash", seq=10,
        ),
        "redacted",
        {"tool": {"name": "Bash", "call_id": "t_3"},
         "error": {"type": "ExecError", "message": "command failed in [REDACTED:secret] context"}},
    ),
    # DL13: resource.retrieval.returned full->metadata
    (
        "metadata",
        _ev(
            "DL13", "resource.retrieval.returned", "full",
            {"documents": [{"id": "doc-1",
                            "score": 0.91,
                            "content": "verbatim retrieved text with a secret",
                            "content_redacted": "verbatim retrieved text with a [REDACTED]",
                            "metadata": {"corpus": "kb", "rank": 1}},
                           {"id": "doc-2", "score": 0.42, "metadata": {"rank": 2}}],
             "count": 2,
             "corpus": "kb",
             "duration_ms": 120},
            seq=11,
        ),
        "metadata",
        {"documents": [{"id": "doc-1", "score": 0.91, "metadata": {"corpus": "kb", "rank": 1}},
                       {"id": "doc-2", "score": 0.42, "metadata": {"rank": 2}}],
         "count": 2,
         "corpus": "kb",
         "duration_ms": 120},
    ),
    # DL14: assessment.evaluation.recorded full->metadata
    (
        "metadata",
        _ev(
            "DL14", "assessment.evaluation.recorded", "full",
            {"gen_ai.evaluation.name": "faithfulness",
             "gen_ai.evaluation.score.value": 0.2,
             "gen_ai.evaluation.score.label": "fail",
             "gen_ai.evaluation.explanation": "the claim about the secret key is unsupported by the retrieved "
                                              "context",
             "evaluator": "llm-judge:v2"},
            seq=12,
        ),
        "metadata",
        {"gen_ai.evaluation.name": "faithfulness",
         "gen_ai.evaluation.score.value": 0.2,
         "gen_ai.evaluation.score.label": "fail",
         "evaluator": "llm-judge:v2"},
    ),
    # DL15: assessment.feedback.received full->metadata
    (
        "metadata",
        _ev(
            "DL15", "assessment.feedback.received", "full",
            {"rating": -1,
             "label": "thumbs_down",
             "comment": "the answer leaked my private key",
             "correction": "never echo the secret; summarize only",
             "source": "human"},
            seq=13,
        ),
        "metadata",
        {"rating": -1, "label": "thumbs_down", "source": "human"},
    ),
    # DL16: resource.retrieval.reranked full->metadata
    (
        "metadata",
        _ev(
            "DL16", "resource.retrieval.reranked", "full",
            {"query": "the secret rerank query",
             "query_digest": "sha256:ab12",
             "model": "cross-encoder:v2",
             "top_k": 2,
             "input_documents": [{"id": "doc-2",
                                  "score": 0.42,
                                  "content": "candidate text with a secret",
                                  "content_redacted": "candidate text with a [REDACTED]",
                                  "metadata": {"rank": 2}},
                                 {"id": "doc-1", "score": 0.91, "metadata": {"rank": 1}}],
             "output_documents": [{"id": "doc-1",
                                   "score": 0.97,
                                   "content": "top text with a secret",
                                   "content_redacted": "top text with a [REDACTED]",
                                   "metadata": {"rank": 1}},
                                  {"id": "doc-2", "score": 0.61, "metadata": {"rank": 2}}],
             "count": 2,
             "duration_ms": 80},
            seq=14,
        ),
        "metadata",
        {"query_digest": "sha256:ab12",
         "model": "cross-encoder:v2",
         "top_k": 2,
         "input_documents": [{"id": "doc-2", "score": 0.42, "metadata": {"rank": 2}},
                             {"id": "doc-1", "score": 0.91, "metadata": {"rank": 1}}],
         "output_documents": [{"id": "doc-1", "score": 0.97, "metadata": {"rank": 1}},
                              {"id": "doc-2", "score": 0.61, "metadata": {"rank": 2}}],
         "count": 2,
         "duration_ms": 80},
    ),
    # DL17: resource.citation.recorded full->metadata
    (
        "metadata",
        _ev(
            "DL17", "resource.citation.recorded", "full",
            {"citations": [{"source": {"id": "doc-1",
                                       "uri": "doc://spec/AEP-0003#6.4",
                                       "title": "Bindings and Lifecycle"},
                            "cited_text": "the relay holds a bounded replay buffer per session",
                            "cited_text_redacted": "the relay holds a bounded replay buffer per session",
                            "offset": {"char": {"start": 0, "end": 50}},
                            "document_index": 0},
                           {"source": {"id": "doc-2", "uri": "doc://spec/AEP-0001#8.2"},
                            "cited_text": "a slow consumer sheds a secret debug event first",
                            "cited_text_redacted": "a slow consumer sheds a [REDACTED] debug event first",
                            "offset": {"block": {"block": 3, "start": 10, "end": 40}},
                            "document_index": 1}],
             "count": 2},
            seq=15,
        ),
        "metadata",
        {"citations": [{"source": {"id": "doc-1"},
                        "offset": {"char": {"start": 0, "end": 50}},
                        "document_index": 0},
                       {"source": {"id": "doc-2"},
                        "offset": {"block": {"block": 3, "start": 10, "end": 40}},
                        "document_index": 1}],
         "count": 2},
    ),
    # DL18: assessment.guardrail.recorded full->metadata
    (
        "metadata",
        _ev(
            "DL18", "assessment.guardrail.recorded", "full",
            {"guardrail": {"stage": "output",
                           "verdict": "blocked",
                           "categories": [{"name": "self_harm", "score": 0.92},
                                          {"name": "violence", "score": 0.11}],
                           "detector": {"name": "guard-model:v3", "version": "3.1"},
                           "explanation": "the response described a secret method for self-harm"}},
            seq=16,
        ),
        "metadata",
        {"guardrail": {"stage": "output",
                       "verdict": "blocked",
                       "categories": [{"name": "self_harm", "score": 0.92},
                                      {"name": "violence", "score": 0.11}],
                       "detector": {"name": "guard-model:v3", "version": "3.1"}}},
    ),
]


@expand
class CaptureCorpus(TestCase):
    def test_inline_corpus_is_complete(self) -> None:
        assert len(DOWNLEVEL_CASES) == 18

    @cases(**dict(zip([f"DL{i}" for i in range(1, len(DOWNLEVEL_CASES) + 1)], DOWNLEVEL_CASES, strict=True)))
    def test_downlevel_inline(self, ceiling: str, ev: dict, expect_capture: str, expect_data: dict | None) -> None:
        _check_downlevel(ceiling, ev, expect_capture, expect_data)


def _fixture_cases() -> dict[str, tuple[dict]]:
    path = FIXTURES / "downlevel" / "cases.json"
    table = json.loads(path.read_text(encoding="utf-8"))["cases"]
    return {c["event"]["id"]: (c,) for c in table}


@expand
class DownlevelFixtures(TestCase):
    @cases(**_fixture_cases())
    def test_downlevel_fixture_corpus(self, case: dict) -> None:
        _check_downlevel(case["ceiling"], case["event"], case["expect_capture"], case["expect_data"])

    def test_fixture_corpus_size(self) -> None:
        path = FIXTURES / "downlevel" / "cases.json"
        assert len(json.loads(path.read_text(encoding="utf-8"))["cases"]) == 18


# --- downlevel_target --------------------------------------------------------------------------

# (event capture, ceiling) -> target; None = unchanged. Absent capture means metadata.
_TARGETS: dict[tuple[str | None, str], str | None] = {
    (None, "none"): "none", (None, "metadata"): None, (None, "redacted"): None, (None, "full"): None,
    ("none", "none"): None, ("none", "metadata"): None, ("none", "redacted"): None, ("none", "full"): None,
    ("metadata", "none"): "none", ("metadata", "metadata"): None,
    ("metadata", "redacted"): None, ("metadata", "full"): None,
    ("redacted", "none"): "none", ("redacted", "metadata"): "metadata",
    ("redacted", "redacted"): None, ("redacted", "full"): None,
    # A mechanical hop never mints `redacted`: full at a redacted ceiling lands on metadata.
    ("full", "none"): "none", ("full", "metadata"): "metadata",
    ("full", "redacted"): "metadata", ("full", "full"): None,
}  # fmt: skip


@expand
class DownlevelTargets(TestCase):
    @cases(*list(_TARGETS))
    def test_downlevel_target_matrix(self, ev_capture: str | None, ceiling: str) -> None:
        ev = _ev("T1", "tool.failed", ev_capture, {"error": {"type": "E", "message": "m"}}, seq=0)
        assert downlevel_target(ev, ceiling) == _TARGETS[(ev_capture, ceiling)]

    @cases(*[None, ""])
    def test_no_ceiling_means_unchanged(self, ceiling: str | None) -> None:
        ev = _ev("T2", "tool.completed", "full", {"result": "verbatim"}, seq=0)
        assert downlevel_target(ev, ceiling) is None

    def test_explicit_null_capture_counts_as_metadata(self) -> None:
        ev = _ev("T3", "run.started", None, {"prompt": "p"}, seq=0)
        ev["capture"] = None
        assert downlevel_target(ev, "metadata") is None
        assert downlevel_target(ev, "none") == "none"

    @cases(*["bogus", "FULL", 1, True, ["full"]])
    def test_downlevel_target_rejects_invalid_ceiling(self, ceiling: Any) -> None:
        with self.assertRaises(ValueError, match="unknown capture level"):
            downlevel_target(_ev("T4", "run.started", "full", {}, seq=0), ceiling)

    def test_downlevel_rejects_invalid_target(self) -> None:
        with self.assertRaises(ValueError, match="unknown capture level: loud"):
            downlevel(_ev("T5", "run.started", "full", {}, seq=0), "loud")

    # --- capture ceiling validation (decision 6) ---------------------------------------------------

    def test_levels_in_rank_order(self) -> None:
        assert LEVELS == ("none", "metadata", "redacted", "full")

    @cases(*[*LEVELS, None, ""])
    def test_capture_error_accepts(self, value: str | None) -> None:
        assert capture_error(value) is None

    @cases(*[
        ("bogus", "unknown capture level: bogus"),
        ("FULL", "unknown capture level: FULL"),
        (" full", "unknown capture level:  full"),
        (0, "unknown capture level: 0"),
        (2.5, "unknown capture level: 2.5"),
        (False, "unknown capture level: false"),
        (["full"], "unknown capture level: full"),
        ({"level": "full"}, "unknown capture level: [object Object]"),
    ])
    def test_capture_error_rejects(self, value: Any, message: str) -> None:
        assert capture_error(value) == message

    # --- downlevel details -------------------------------------------------------------------------

    def test_output_data_is_not_shared_with_input(self) -> None:
        ev = _ev(
            "N1", "attention.requested", "redacted",
            {"kind": "form", "prompt": "p", "fields": [{"id": "f", "label": "L", "choices": [{"id": 1, "label": "x"}]}]},
            seq=0,
        )  # fmt: skip
        before = copy.deepcopy(ev)
        out = downlevel(ev, "metadata")
        out["data"]["fields"][0]["choices"][0]["id"] = "changed"
        out["data"]["fields"].append({})
        assert ev == before
        assert out["data"]["fields"][0]["choices"][0]["label"] == "1"  # String(1)

    def test_capture_is_set_in_place_or_appended(self) -> None:
        with_capture = _ev("K1", "tool.failed", "redacted", {"error": {"message": "m"}}, seq=0)
        assert list(downlevel(with_capture, "metadata")) == list(with_capture)
        without = _ev("K2", "tool.failed", None, {"error": {"message": "m"}}, seq=0)
        out = downlevel(without, "none")
        assert list(out) == [k for k in without if k != "data"] + ["capture"]
        assert out["capture"] == "none"

    @cases(*["x.acme.session.blob", "log.emitted", "foo.bar"])
    def test_types_without_annotations_lose_data(self, type_: str) -> None:
        out = downlevel(_ev("U1", type_, "full", {"k": 1}, seq=0), "metadata")
        assert out["capture"] == "metadata" and "data" not in out

    def test_all_metadata_types_keep_their_data(self) -> None:
        # A type whose schema marks everything metadata is annotated (with nothing to drop),
        # so its data survives; unknown keys count as metadata.
        ev = _ev("M1", "agent.heartbeat", "full", {"tick": 1, "interval_ms": 30000, "extra": {"a": [1]}})
        del ev["session"]
        assert downlevel(ev, "metadata")["data"] == {"tick": 1, "interval_ms": 30000, "extra": {"a": [1]}}
        ack = _ev("M2", "control.accepted", "redacted", {"note": "x"}, seq=5)
        assert downlevel(ack, "metadata")["data"] == {"note": "x"}

    @cases(*[None, {}, "free text", ["a"], 0, False])
    def test_target_none_and_odd_data(self, data: Any) -> None:
        ev = _ev("O1", "progress.status", "redacted", seq=0)
        if data is not None:
            ev["data"] = data
        out = downlevel(ev, "none")
        assert out["capture"] == "none" and "data" not in out
        metadata = downlevel(ev, "metadata")
        if isinstance(data, dict):
            assert metadata["data"] == {}  # an empty object is truthy in JS: kept
        else:
            assert "data" not in metadata

    def test_full_gated_field_survives_a_redacted_target(self) -> None:
        # Target `redacted` is only reachable by calling downlevel directly; it drops full-only fields.
        ev = _ev("R1", "tool.completed", "full", {"result": "raw", "result_redacted": "r", "status": "ok"}, seq=0)
        out = downlevel(ev, "redacted")
        assert out["capture"] == "redacted"
        assert out["data"] == {"result_redacted": "r", "status": "ok"}

    def test_nested_arrays_and_dotted_property_names(self) -> None:
        ev = _ev(
            "P1", "resource.citation.recorded", "full",
            {"citations": [{"source": {"id": "d", "uri": "u", "title": "t"}, "cited_text": "c", "n": [1]}], "count": 1},
            seq=0,
        )  # fmt: skip
        assert downlevel(ev, "metadata")["data"] == {"citations": [{"source": {"id": "d"}, "n": [1]}], "count": 1}
        # The annotation path `gen_ai.evaluation.explanation` is one property name in the schema;
        # like the reference, a nested spelling of the same path is pruned too (never leaks).
        flat = _ev("P2", "assessment.evaluation.recorded", "full", {"gen_ai.evaluation.explanation": "x", "k": 1}, seq=0)
        nested = _ev(
            "P3", "assessment.evaluation.recorded", "full",
            {"gen_ai": {"evaluation": {"explanation": "x", "name": "n"}}}, seq=0,
        )  # fmt: skip
        assert downlevel(flat, "metadata")["data"] == {"k": 1}
        assert downlevel(nested, "metadata")["data"] == {"gen_ai": {"evaluation": {"name": "n"}}}

    @cases(*[
        ({"subject": "Bash"}, {"kind": "permission", "prompt": "x"}, "a requests permission: Bash"),
        ({}, {"kind": "permission", "prompt": "x"}, "a requests permission"),
        ({"subject": ""}, {"prompt": "x"}, "a requests attention"),
        ({"subject": "S"}, {"kind": None, "prompt": "x"}, "a requests attention: S"),
    ])
    def test_prompt_synthesis(self, extra: dict, data: dict, prompt: str) -> None:
        ev = _ev("Q1", "attention.requested", "redacted", data, seq=0, **extra)
        assert downlevel(ev, "metadata")["data"]["prompt"] == prompt

    def test_attention_requested_context_and_odd_items(self) -> None:
        ev = _ev(
            "Q2", "attention.requested", "full",
            {"prompt": 7, "context": "full transcript", "options": [{"label": "no id"}, "free text option", {"id": None}]},
            seq=0,
        )  # fmt: skip
        out = downlevel(ev, "metadata")["data"]
        assert "context" not in out
        assert out["prompt"] == 7  # only a string prompt is synthesised
        assert out["options"] == [{"label": "undefined"}, {"label": "undefined"}, {"id": None, "label": "null"}]

    def test_degrade_applies_only_below_redacted(self) -> None:
        ev = _ev("Q3", "attention.requested", "full", {"prompt": "keep", "context": "drop"}, seq=0)
        assert downlevel(ev, "redacted")["data"] == {"prompt": "keep"}

    @cases(*["attention.answered", "control.attention.respond"])
    def test_answer_values_keep_numbers_and_booleans(self, type_: str) -> None:
        values = {"s": "text", "i": 0, "f": 1.5, "b": False, "n": None, "l": ["1"], "o": {"k": 1}}
        ev = _ev("V1", type_, "redacted", {"answer": {"option": "1", "text": "t", "values": values}})
        if type_ == "attention.answered":
            ev["seq"] = 1
        out = downlevel(ev, "metadata")["data"]
        assert out == {"answer": {"option": "1", "values": {"i": 0, "f": 1.5, "b": False}}}

    def test_answer_without_values_untouched(self) -> None:
        ev = _ev("V2", "attention.answered", "redacted", {"answer": {"option": "1"}, "via": "control"}, seq=1)
        assert downlevel(ev, "metadata")["data"] == {"answer": {"option": "1"}, "via": "control"}


def _gating_cases() -> dict[str, tuple[dict]]:
    path = FIXTURES / "capture-gating" / "cases.json"
    table = json.loads(path.read_text(encoding="utf-8"))["cases"]
    return {c["name"][:40]: (c,) for c in table if c["ceiling"] == "metadata"}


@expand
class HopBounds(TestCase):
    @cases(**_gating_cases())
    def test_hop_never_keeps_more_values_than_the_emitter(self, case: dict) -> None:
        # The capture-gating corpus pins the emitter (which has the field_spec). A relay hop has no
        # field_spec, so it may drop more (closed multi-selects) but must never keep more.
        ev = _ev("G1", "attention.answered", "redacted", {"answer": {"values": case["values"]}}, seq=0)
        kept = downlevel(ev, "metadata")["data"]["answer"]["values"]
        assert kept.items() <= case["expect"].items()


# --- the annotation table (decision 13) --------------------------------------------------------

# aep.md section 6 "Non-metadata annotations in the schemas", transcribed independently.
_R, _F = "redacted", "full"
DOC_TABLE: dict[str, dict[str, str]] = {
    "run.started": {"prompt": _R},
    "run.finished": {"summary": _R},
    "run.failed": {"error.message": _R},
    "error.raised": {"error.message": _R},
    "tool.failed": {"error.message": _R},
    "run.cancelled": {"reason": _R},
    "control.cancel": {"reason": _R},
    "run.step.started": {"name": _R},
    "session.started": {"label": _R, "cwd": _R},
    "tool.requested": {"args": _F, "args_redacted": _R},
    "tool.completed": {"result": _F, "result_redacted": _R},
    "attention.requested": {"context": _F},
    "attention.answered": {"answer.text": _R},
    "control.attention.respond": {"answer.text": _R},
    "control.rejected": {"detail": _R},
    "progress.status": {"message": _R},
    "progress.task.planned": {"task.title": _R},
    "progress.task.completed": {"task.title": _R},
    "progress.artifact.produced": {"artifact.name": _R, "artifact.uri": _R},
    "state.snapshot": {"state": _R},
    "state.delta": {"delta": _R},
    "agent.health": {"detail": _R},
    "resource.retrieval.requested": {"query": _R},
    "resource.retrieval.returned": {"documents[].content": _F, "documents[].content_redacted": _R},
    "resource.retrieval.reranked": {
        "query": _R,
        "input_documents[].content": _F,
        "input_documents[].content_redacted": _R,
        "output_documents[].content": _F,
        "output_documents[].content_redacted": _R,
    },
    "resource.citation.recorded": {
        "citations[].cited_text": _F,
        "citations[].cited_text_redacted": _R,
        "citations[].source.uri": _R,
        "citations[].source.title": _R,
    },
    "assessment.evaluation.recorded": {"gen_ai.evaluation.explanation": _R},
    "assessment.feedback.received": {"comment": _R, "correction": _R},
    "assessment.guardrail.recorded": {"guardrail.explanation": _R},
}


@expand
class Annotations(TestCase):
    def test_annotations_match_the_doc_table(self) -> None:
        non_empty = {t: dict(paths) for t, paths in ANNOTATIONS.items() if paths}
        assert non_empty == DOC_TABLE
        assert all(level in ("redacted", "full") for paths in ANNOTATIONS.values() for level in paths.values())
        assert len(ANNOTATIONS) == 44

    def test_annotations_are_read_only(self) -> None:
        with self.assertRaises(TypeError):
            ANNOTATIONS["x.acme.thing.done"] = {}  # type: ignore[index]
        with self.assertRaises(TypeError):
            ANNOTATIONS["run.started"]["prompt"] = "metadata"  # type: ignore[index]


def _schema_annotations(node: Any, base: str, out: dict[str, str]) -> int:
    """Collect annotations with the reference loader's walk; return how many were explicit.

    Nested properties join with ".", array items add "[]"; unannotated properties are metadata.
    """
    explicit = 0
    for prop, sub in (node.get("properties") or {}).items():
        path = f"{base}.{prop}" if base else prop
        out[path] = sub.get("x-aep-capture", "metadata")
        explicit += "x-aep-capture" in sub
        explicit += _schema_annotations(sub, path, out)
        items = sub.get("items")
        if isinstance(items, dict):
            # The loader ignores an annotation on the items node itself; that is only safe
            # while such annotations add nothing beyond metadata.
            if "x-aep-capture" in items:
                assert items["x-aep-capture"] == "metadata", path
                explicit += 1
            explicit += _schema_annotations(items, path + "[]", out)
    return explicit


def _count_key(node: Any, key: str) -> int:
    if isinstance(node, dict):
        return (key in node) + sum(_count_key(v, key) for v in node.values())
    if isinstance(node, list):
        return sum(_count_key(v, key) for v in node)
    return 0


@expand
class AnnotationSchemas(TestCase):
    def test_annotations_match_the_schemas(self) -> None:
        from_schemas: dict[str, dict[str, str]] = {}
        for f in sorted(SCHEMA_TYPES.glob("*.schema.json")):
            schema = json.loads(f.read_text(encoding="utf-8"))
            paths: dict[str, str] = {}
            reached = _schema_annotations(schema, "", paths)
            # An annotation hidden where the walk does not go (oneOf, $defs...) would be missed.
            assert reached == _count_key(schema, "x-aep-capture"), f.name
            from_schemas[f.name.removesuffix(".schema.json")] = {p: lv for p, lv in paths.items() if lv != "metadata"}
        assert len(from_schemas) == 44
        assert {t: dict(p) for t, p in ANNOTATIONS.items()} == from_schemas
