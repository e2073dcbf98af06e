"""The MCP HTTP suite against a wing running with --redis (issue 5, acceptance 4).

The same test bodies as the in-memory runs; only the wing's state lives in a real redis-server (skipped
locally without one, failing under CI=true).
"""

from __future__ import annotations

from tests.mcp import test_cors_http, test_http, test_interop


class RegisterOnRedis(test_http.RegisterTests):
    with_redis = True


class InboxOutboxOnRedis(test_http.InboxOutboxTests):
    with_redis = True


class UnregisterOnRedis(test_http.UnregisterTests):
    with_redis = True


class EventsOnRedis(test_http.EventsTests):
    with_redis = True


class PollOnRedis(test_http.PollTests):
    with_redis = True


class SessionCapOnRedis(test_http.SessionCapTests):
    with_redis = True


class SseAgentPollPageOnRedis(test_interop.SseAgentPollPage):
    with_redis = True


class PollAgentSsePageOnRedis(test_interop.PollAgentSsePage):
    with_redis = True


class RoutingOnRedis(test_http.RoutingTests):
    with_redis = True


class PrefixOnRedis(test_http.PrefixTests):
    with_redis = True


class SlowReaderOnRedis(test_http.SlowReaderTests):
    with_redis = True


class SseAgentSsePageOnRedis(test_interop.SseAgentSsePage):
    with_redis = True


class PollAgentPollPageOnRedis(test_interop.PollAgentPollPage):
    with_redis = True


class ListPolicyOnRedis(test_cors_http.ListPolicyTests):
    with_redis = True


class NormalisedListOnRedis(test_cors_http.NormalisedListTests):
    with_redis = True


class DefaultPolicyOnRedis(test_cors_http.DefaultPolicyTests):
    with_redis = True


class ExplicitStarOnRedis(test_cors_http.ExplicitStarTests):
    with_redis = True


class RepeatedFlagOnRedis(test_cors_http.RepeatedFlagTests):
    with_redis = True


class FlagOverEnvOnRedis(test_cors_http.FlagOverEnvTests):
    with_redis = True
