"""relayd/process/settings.py: the process-wide tables and the typed values built from them."""

from __future__ import annotations

from twisted.trial.unittest import TestCase

from relayd.base.config import Resolved, resolve
from relayd.process.settings import (
    DEFAULT_REDIS_PREFIX,
    DEFAULT_SITE_SETTINGS,
    REDIS_SETTINGS,
    SETTINGS,
    RedisSettings,
    SiteSettings,
)


class SiteSettingsFromTheTable(TestCase):
    def test_the_table_defaults_are_the_default_site_settings(self) -> None:
        self.assertEqual(SiteSettings.from_settings(resolve(SETTINGS, {}, {})), DEFAULT_SITE_SETTINGS)

    def test_flags_and_environment_reach_the_site_settings(self) -> None:
        flags = {"header-timeout": "3", "no-access-log": True, "max-client-connections": "0"}
        environ = {"RELAYD_TRUST_FORWARDED_FOR": "2", "RELAYD_BODY_TIMEOUT": "7.5", "RELAYD_IDLE_TIMEOUT": "9"}
        self.assertEqual(
            SiteSettings.from_settings(resolve(SETTINGS, flags, environ)),
            SiteSettings(trust_forwarded_for=2, header_timeout=3.0, body_timeout=7.5, idle_timeout=9.0,
                         access_log=False, max_client_connections=0),
        )

    def test_without_the_table_the_defaults(self) -> None:
        self.assertEqual(SiteSettings.from_settings(Resolved()), DEFAULT_SITE_SETTINGS)


class RedisSettingsFromTheTable(TestCase):
    def test_no_redis_by_default(self) -> None:
        self.assertEqual(RedisSettings.from_settings(resolve(REDIS_SETTINGS, {}, {})), RedisSettings())
        self.assertEqual(RedisSettings.from_settings(Resolved()), RedisSettings(None, DEFAULT_REDIS_PREFIX))

    def test_url_and_prefix(self) -> None:
        settings = resolve(REDIS_SETTINGS, {"redis": "redis://127.0.0.1:6390/2"}, {"RELAYD_REDIS_PREFIX": "blue:"})
        self.assertEqual(RedisSettings.from_settings(settings), RedisSettings("redis://127.0.0.1:6390/2", "blue:"))
