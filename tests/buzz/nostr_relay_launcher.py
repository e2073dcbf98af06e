"""Run PyPI nostr-relay on an already-listening socket inherited from the test (no readiness polling).

usage: python nostr_relay_launcher.py CONFIG FD
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    conf, fd = sys.argv[1], int(sys.argv[2])
    from nostr_relay.config import Config

    Config.load(conf)
    from alembic import config as alembic_config

    import nostr_relay

    ini = os.path.join(os.path.dirname(nostr_relay.__file__), "alembic.ini")
    alembic_config.main([f"-c{ini}", "upgrade", "head"])
    from nostr_relay import monkeypatch

    monkeypatch.monkey()
    import uvicorn

    from nostr_relay.web import create_app

    app = create_app(conf)
    uvicorn.run(app, fd=fd, log_level="warning", lifespan="on")


if __name__ == "__main__":
    main()
