"""The shipped systemd units and the deployment docs use flags relayd has (they drift otherwise)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from twisted.trial.unittest import TestCase

from relayd.tap import all_settings
from tests.support.cases import cases, expand

ROOT = Path(__file__).resolve().parents[1]
UNITS = sorted((ROOT / "contrib" / "systemd").rglob("*.service")) + sorted(
    (ROOT / "contrib" / "systemd").rglob("*.conf")
)
TWISTD_OPTIONS = {"--nodaemon", "-n", "--pidfile", "--logger", "--logfile"}


def _exec_starts(path: Path) -> list[list[str]]:
    text = path.read_text().replace("\\\n", " ")
    return [shlex.split(m.group(1)) for m in re.finditer(r"^ExecStart=(.+)$", text, re.M) if m.group(1).strip()]


@expand
class ContribTests(TestCase):
    @cases(**{p.name: p for p in UNITS})
    def test_exec_start_uses_known_options(self, unit: Path) -> None:
        known = {f"--{s.name}" for s in all_settings()}
        starts = _exec_starts(unit)
        assert starts, f"{unit.name} has no ExecStart"
        for argv in starts:
            assert argv[0].endswith("/twistd")
            split = argv.index("relayd")
            for option in argv[1:split]:
                assert option.split("=", 1)[0] in TWISTD_OPTIONS, option
            assert "--logger=relayd.logs.json.json_observer" in argv[1:split]
            for option in argv[split + 1 :]:
                if option.startswith("--"):
                    assert option in known, f"{unit.name}: unknown relayd option {option}"

    def test_socket_names_match_the_drop_in(self) -> None:
        names = {
            m.group(1)
            for socket in (ROOT / "contrib" / "systemd").glob("*.socket")
            for m in re.finditer(r"^FileDescriptorName=(\S+)", socket.read_text(), re.M)
        }
        drop_in = (ROOT / "contrib" / "systemd" / "relayd.service.d" / "socket-activation.conf").read_text()
        used = set(re.findall(r"systemd:domain=INET:name=(\S+)", drop_in))
        assert names == used == {"relayd-aep", "relayd-mcp"}

    def test_operator_docs_are_linked_from_the_readme(self) -> None:
        readme = (ROOT / "README.md").read_text()
        for page in ("deployment.md", "scaling.md", "security.md", "troubleshooting.md"):
            assert f"(docs/{page})" in readme
            assert (ROOT / "docs" / page).exists()
