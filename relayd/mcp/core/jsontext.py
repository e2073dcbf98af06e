"""JSON text as the Node relay reads and writes it (C{JSON.parse} and C{JSON.stringify}).

orjson does the work; the json module takes over for what orjson refuses and JSON allows (numbers
beyond the double range, lone-surrogate escapes, nesting deeper than orjson's limit): the mechanism
is L{relayd.base.jsoncodec}'s, the choices are these. No I/O.
"""

from __future__ import annotations

from relayd.base import jsoncodec

# loads_json(data): parse JSON text; ValueError (a jsoncodec.JSONError) for anything that is not
# JSON, invalid UTF-8 included. As JSON.parse reads it: every refusal of orjson's is read again by
# the json module, integers beyond 64 bits are the nearest double, lone surrogates are kept.
loads_json = jsoncodec.Reader(read_int=jsoncodec.int_or_double, fallback="any").loads

# dumps(value): compact JSON of a parsed value; ValueError if it is nested too deep to write.
# Non-ASCII stays as it is unless a lone surrogate (which JSON carries as an escape and UTF-8
# cannot) forces escapes.
dumps = jsoncodec.Writer(surrogates="escape").dumps
