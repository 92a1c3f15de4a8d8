"""User content quoted in a message, kept short: a binary file's line or a pasted blob is not a message."""
from __future__ import annotations

import re

QUOTE_LIMIT = 80  # characters of quoted content a message shows, then an ellipsis
# a quoted span as repr() writes it ('...' or "...", with its escapes), not an apostrophe of the prose (model's)
_QUOTED = re.compile(r"""(?<!\w)(?:'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")(?!\w)""")


def _cut(span: str, limit: int) -> str:
    """A quoted span (its quotes included) cut to ``limit`` characters inside them, with an ellipsis and the count
    of characters left out."""
    if len(span) <= limit + 2:
        return span
    return f"{span[:limit + 1]}…{span[-1]} ({len(span) - limit - 2} more characters)"


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """repr() of a user's value (a line of a file, a label, an option's text), at most ``limit`` characters of it."""
    text = repr(value)
    return _cut(text, limit) if text[:1] in "'\"" else (text if len(text) <= limit else f"{text[:limit]}…")


def clip_quotes(message: str, limit: int = QUOTE_LIMIT) -> str:
    """A message with every quoted span longer than ``limit`` characters cut as ``quote`` cuts it: the last guard
    before a line reaches the user, whatever raised it."""
    return _QUOTED.sub(lambda m: _cut(m.group(0), limit), message)
