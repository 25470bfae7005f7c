"""attnsel: one attention API over several kernel libraries, with validated automatic backend selection."""
__version__ = "0.1.0"
