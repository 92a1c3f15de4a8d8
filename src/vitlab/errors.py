"""vitlab's own error types. A refusal of what the user gave (an option, a file, an array, a set-up) raises
`VitlabError` with one line that names the problem and what is accepted; the command line prints that line and
exits 2. Any other exception is a fault in vitlab or beneath it and keeps its traceback."""


class VitlabError(ValueError):
    """A refusal of the user's input: the message says what was wrong, with the value, and what is accepted.

    A ValueError, so callers' ``except ValueError`` still catches it."""


class NotFoundError(VitlabError, FileNotFoundError):
    """A refusal of a path, folder or Hub id that names nothing vitlab can read (also a FileNotFoundError)."""
