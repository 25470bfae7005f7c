"""The CLI's stdout while a command runs: a write or flush that fails (full disk, I/O error) is told apart from the
command's own OS errors."""


class StdoutError(OSError):
    """Writing the command's output to stdout failed (full disk, I/O error); a closed pipe stays BrokenPipeError."""


class MarkedStdout:
    """sys.stdout while a command runs: an OSError from writing or flushing it becomes StdoutError, so that main()
    can tell it from the command's own OS errors (those keep their tracebacks)."""

    def __init__(self, stream):
        self._stream = stream

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def write(self, text: str) -> int:
        return self._marked(self._stream.write, text)

    def flush(self) -> None:
        self._marked(self._stream.flush)

    @staticmethod
    def _marked(call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise StdoutError(exc.errno, exc.strerror) from exc
