"""The headers of a client session's JSON answers, made once per client session (kept on it): each
session's answers name that session, and the stateless revision's name none."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from twisted.trial.unittest import TestCase

from relayd.mcp.endpoint.exchange import json_only, session_header


def client(client_id: str) -> Any:
    return cast(Any, SimpleNamespace(id=client_id, answer_headers=None))


class AnswerHeaders(TestCase):
    def test_each_client_sessions_answers_name_it(self) -> None:
        first, second = client("first-session-id"), client("second-session-id")
        for _ in range(2):
            self.assertEqual(
                session_header(first),
                ((b"content-type", b"application/json"), (b"mcp-session-id", b"first-session-id")),
            )
            self.assertEqual(session_header(second)[1], (b"mcp-session-id", b"second-session-id"))
        self.assertIs(session_header(first), first.answer_headers)  # (made once, kept on the client session)

    def test_a_stateless_answer_names_no_client_session(self) -> None:
        self.assertEqual(json_only(), ((b"content-type", b"application/json"),))
