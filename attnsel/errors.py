"""The base of attnsel's own errors: what a caller got wrong or what attnsel refuses, each message naming it and what
is allowed. The CLI shows these as one line (exit 2; SelectionError and CannotRun: exit 3); any other exception is a
bug and keeps its traceback (exit 1)."""


class AttnselError(Exception):
    """An error attnsel raises on purpose, with a message that names the cause and what is allowed."""


class InvalidArgument(AttnselError, ValueError):
    """An argument, option or path attnsel refuses (select's policy, mode, timeouts, device; a cache directory that
    cannot be one; a model directory that is none)."""


class SpecError(AttnselError, ValueError):
    """A spec field or config file is invalid; the message names the field and what is allowed.

    ``field``: the AttentionSpec field the error is about, when there is one (the CLI names the flag that
    overrides it)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class CannotRun(AttnselError, RuntimeError):
    """The input is fine but this machine or installation cannot do it (CLI exit 3): a device it lacks (CUDA for
    `bench`, `--mode graph` or `--device cuda`), a missing optional extra (`attnsel serve`)."""


class UsageError(AttnselError, ValueError):
    """A command-line flag's value the command refuses (exit 2)."""
