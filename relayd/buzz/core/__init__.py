"""The broker's core: what it keeps and decides, without its HTTP door (relayd/buzz/http.py, service.py).

pyproject.toml's import contracts check that nothing here imports the broker's transports.
"""
