"""Packaging: a regular (non-editable) ``pip install .`` into a fresh venv gives a twistd that lists the
``relayd`` plugin and a working ``relayd-admin``; the plugin cache is regenerated as Twisted's plugin
docs advise. Slow-ish (a wheel build, about 15 s)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from twisted.trial.unittest import TestCase

ROOT = Path(__file__).resolve().parents[1]
PROJECT_FILES = ("setup.cfg", "pyproject.toml", "README.md", "LICENSE")


def _run(argv: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


class PackagingTests(TestCase):
    @pytest.mark.slow
    def test_pip_install_then_twistd_lists_relayd_and_relayd_admin_runs(self) -> None:
        tmp_path = Path(tempfile.mkdtemp(prefix="relayd-packaging-"))
        self.addCleanup(shutil.rmtree, tmp_path, ignore_errors=True)
        # Build from a copy: an in-tree build would leave build/ and *.egg-info in the checkout.
        src = tmp_path / "src"
        src.mkdir()
        for name in PROJECT_FILES:
            shutil.copy2(ROOT / name, src / name)
        shutil.copytree(ROOT / "relayd", src / "relayd", ignore=shutil.ignore_patterns("__pycache__"))
        (src / "twisted" / "plugins").mkdir(parents=True)
        shutil.copy2(ROOT / "twisted" / "plugins" / "relayd_plugin.py", src / "twisted" / "plugins")

        venv = tmp_path / "venv"
        made = _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], tmp_path)
        assert made.returncode == 0, made.stderr
        python, bin_dir = venv / "bin" / "python", venv / "bin"
        installed = _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(src)], tmp_path, 120)
        if installed.returncode != 0 and "No matching distribution found" in installed.stderr:
            message = "pip cannot reach an index for the build requirements: " + installed.stderr.strip()[-300:]
            if os.environ.get("CI") == "true":
                self.fail(message)
            self.skipTest(message)
        assert installed.returncode == 0, installed.stderr

        # The installed copy is what the venv imports (not this checkout), with its plugin beside Twisted's.
        site = _run([str(python), "-c", "import relayd, sysconfig; print(relayd.__file__); print(sysconfig.get_path('purelib'))"], tmp_path)
        module, purelib = site.stdout.split()
        assert module.startswith(str(venv)), module
        plugin_dir = Path(purelib) / "twisted" / "plugins"
        assert (plugin_dir / "relayd_plugin.py").exists()
        # relayd must not ship twisted/plugins/__init__.py: it would replace Twisted's own (which is there
        # when Twisted is installed into the same venv) and hide every other plugin.
        record = _run([str(python), "-c", "import importlib.metadata as m; print(*m.files('relayd'), sep=chr(10))"], tmp_path)
        shipped = record.stdout.split()
        assert "twisted/plugins/relayd_plugin.py" in shipped, shipped
        assert "twisted/plugins/__init__.py" not in shipped, shipped
        # Package data: the broker's schema files (relayd/storage/sqlite_schema.py reads them at start).
        assert "relayd/buzz/schema/001-initial.sql" in shipped, shipped
        assert "relayd/buzz/schema/002-receipt-counts.sql" in shipped, shipped
        # The Redis scripts are package data (docs/decisions.md REDIS-1): every one is installed.
        scripts = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "relayd").rglob("*.lua"))
        assert scripts and not set(scripts) - set(shipped), sorted(set(scripts) - set(shipped))
        loaded = _run([str(python), "-c", "import relayd.mcp.redis.store, relayd.aep.redis.store, relayd.buzz.redis.state"], tmp_path)
        assert loaded.returncode == 0, loaded.stderr

        # Twisted's plugin docs: regenerate the cache after installing (read-only site-packages later).
        cache = _run([str(python), "-c", "from twisted.plugin import IPlugin, getPlugins; list(getPlugins(IPlugin))"], tmp_path)
        assert cache.returncode == 0, cache.stderr
        assert (plugin_dir / "dropin.cache").exists()

        # twistd: the venv's own script when Twisted was installed into it, else the same entry point.
        twistd = [str(bin_dir / "twistd")] if (bin_dir / "twistd").exists() else [
            str(python), "-c", "import sys; from twisted.scripts.twistd import run; sys.argv[0] = 'twistd'; run()",
        ]
        listed = _run([*twistd, "--help"], tmp_path)
        assert listed.returncode == 0, listed.stderr
        assert "relayd" in listed.stdout and "Relay for AI agents" in listed.stdout
        options = _run([*twistd, "relayd", "--help"], tmp_path)
        assert options.returncode == 0, options.stderr
        assert "--metrics-listen" in options.stdout and "--aep-listen" in options.stdout

        # The `relayd` command (twistd -n --pidfile= relayd in one word).
        command = _run([str(bin_dir / "relayd"), "--version"], tmp_path)
        assert command.returncode == 0 and command.stdout.startswith("relayd "), (command.stdout, command.stderr)

        admin = _run([str(bin_dir / "relayd-admin"), "--help"], tmp_path)
        assert admin.returncode == 0, admin.stderr
        for command in ("aep", "mcp", "status", "broker"):
            assert command in admin.stdout

        # The installed package creates a broker state from its own schema files.
        state = tmp_path / "state"
        state.mkdir()
        listed = _run([str(bin_dir / "relayd-admin"), "broker", "list", "--state-dir", str(state)], tmp_path)
        assert listed.returncode == 0, listed.stderr
        version = _run([str(python), "-c", "import sqlite3, sys; print(sqlite3.connect(sys.argv[1]).execute("
                        "'PRAGMA user_version').fetchone()[0])", str(state / "broker.sqlite3")], tmp_path)
        assert version.stdout.strip() == "2", (version.stdout, version.stderr)  # the last schema file
