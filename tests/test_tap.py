"""The twistd plugin's command line (relayd/tap.py)."""

from __future__ import annotations

import os
import subprocess

from twisted.trial.unittest import TestCase

import relayd
from tests.support.twistd import ROOT, twistd_argv


class Version(TestCase):
    def test_twistd_relayd_version_names_relayd(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        done = subprocess.run([*twistd_argv(), "relayd", "--version"], capture_output=True, text=True, env=env,
                              cwd=str(ROOT), timeout=60)
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertTrue(done.stdout.startswith(f"relayd {relayd.__version__} (Twisted "), done.stdout)
