"""A plugin module that fails at import, as a broken kernel library would."""
import attnsel_missing_kernel_lib  # noqa: F401

BACKEND = None
