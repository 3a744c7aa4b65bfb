"""User-facing errors.

Everything the CLI should report as a one-line message (and a non-zero exit) instead of a
traceback is raised as :class:`KVStreamsError`.
"""


class KVStreamsError(Exception):
    """An error caused by bad input (model, trace, config, CLI value); the message says what to fix."""


class TraceFormatError(KVStreamsError):
    """A trace file is corrupt, incomplete or internally inconsistent."""
