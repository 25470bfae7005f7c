"""Exit 1, listing file:line for each hit, where attnsel's code or comments cite history: a date, a round number, an
issue number, a commit hash, a `bench/results` path or a named test machine ("H100 ...", "H200 ...").

Comments state what is true now and why; a measured figure behind a constant lives in bench/results/README.md (the
results file), which the comment points to without a folder name or date. Nothing is allowed by exception.
Usage: python scripts/check_history.py [PATH ...]   (files or directories; default: attnsel/)
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HISTORY = re.compile(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]|\b[Rr]ound [0-9]+|\b[Ii]ssue [0-9]+|\bcommit [0-9a-f]{7}"
                     r"|bench/results|H[12]00 ")


def python_files(paths: list[Path]) -> list[Path]:
    """The .py files of ``paths`` (a directory: every .py file under it), sorted; SystemExit naming a missing path."""
    files = []
    for path in paths:
        if path.is_dir():
            files += path.rglob("*.py")
        elif path.is_file():
            files.append(path)
        else:
            raise SystemExit(f"check_history: no such file or directory: {path}")
    return sorted(set(files))


def hits(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of every line of ``path`` that cites history."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [(n, line.strip()) for n, line in enumerate(lines, 1) if HISTORY.search(line)]


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or [ROOT / "attnsel"]
    found = 0
    for path in python_files(paths):
        name = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
        for number, line in hits(path):
            print(f"{name}:{number}: {line}")
            found += 1
    if found:
        print(f"{found} line(s) cite history: state what is true now and why; point figures to the results file "
              "(bench/results/README.md) without a folder name or date", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
