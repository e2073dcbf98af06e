"""The live event viewer: a page, its script and its style, served at C{/} and C{/viewer} (docs/aep.md).

The files are package data (C{static/}), plain HTML, JavaScript and CSS with no build step. They
carry nothing of the relay's, so they are served without the token; the page reads C{/stream} with
the token its user types in, as any other consumer does.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Final

from relayd.web.answers import Answer

# The page loads its script and style from the relay and talks to nothing else: no inline script or
# style, no other origin, no frames (so a value from an event that reached the DOM as markup could
# still run nothing; the script writes none as markup).
_POLICY: Final = (
    b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    b"base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

_FILES: Final = {
    "/viewer": ("viewer.html", b"text/html; charset=utf-8"),
    "/viewer.js": ("viewer.js", b"text/javascript; charset=utf-8"),
    "/viewer.css": ("viewer.css", b"text/css; charset=utf-8"),
}

VIEWER_PATHS: Final = ("/", *_FILES)
"""The viewer's paths: the page at C{/} too (what a newcomer opens first), its script and style."""


def viewer_answers() -> dict[str, Answer]:
    """Each path of the viewer and its answer, read once from the package."""
    static = files("relayd.aep").joinpath("static")
    answers = {}
    for path, (name, media_type) in _FILES.items():
        headers = (
            (b"content-type", media_type),
            (b"cache-control", b"no-cache"),
            (b"x-content-type-options", b"nosniff"),
            (b"referrer-policy", b"no-referrer"),
            (b"content-security-policy", _POLICY),
        )
        answers[path] = Answer(200, static.joinpath(name).read_bytes(), headers)
    answers["/"] = answers["/viewer"]
    return answers
