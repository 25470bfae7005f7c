"""`python -m attnsel ...`: the same as the `attnsel` command."""
import sys

from .cli import main

sys.exit(main())
