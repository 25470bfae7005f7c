"""The command line's backend flags (--PHASE-backend and LightLLM's aliases, --PHASE-priority): each value taken from
its flag, else its environment variable, else auto, and checked against the registered backends, an error naming
where the value came from. The commands in cli and `attnsel serve` both check their flags here first."""
from __future__ import annotations

import argparse

from . import settings
from .errors import UsageError

# phase -> its flag, then LightLLM's name for it (an alias)
BACKEND_FLAGS = {"prefill": ("--prefill-backend", "--llm_prefill_att_backend"),
                 "decode": ("--decode-backend", "--llm_decode_att_backend"), "extend": ("--extend-backend",)}


def _backend_choice(args: argparse.Namespace, phase: str) -> tuple[str, str]:
    """(value, where it came from in words): the flag, else the environment variable, else auto."""
    from .selection import AUTO

    flag = BACKEND_FLAGS[phase][0]
    value = getattr(args, phase)
    if value is not None:  # argparse takes unambiguous prefixes too: name the flag they stand for
        typed = [f for a in getattr(args, "argv", []) if a.startswith("--") and len(a.split("=", 1)[0]) > 2
                 for f in BACKEND_FLAGS[phase] if f.startswith(a.split("=", 1)[0])]
        return value, (typed[-1] if typed else flag)  # the last one given wins in argparse
    env, value = settings.ENV[f"{phase}_backend"], settings.read(f"{phase}_backend")
    if value != AUTO:
        return value, f"{env}={value} (environment variable)"
    return AUTO, flag


def _check_backend_choice(where: str, value: str, allow_auto: bool = True) -> None:
    """UnknownBackendError naming ``where`` (a flag or an environment variable) when value is not a backend."""
    from . import backends
    from .selection import AUTO

    valid = ([AUTO] if allow_auto else []) + backends.names()
    if value not in valid:
        raise backends.UnknownBackendError(f"{where}: unknown backend {value!r}; valid: {', '.join(valid)}")


def check_backend_args(args: argparse.Namespace) -> None:
    """Resolve --prefill-backend etc. from the environment and check every backend name given, naming its source."""
    for phase in ("prefill", "decode", "extend"):
        value, where = _backend_choice(args, phase)
        _check_backend_choice(where, value)
        setattr(args, phase, value)
        if value != "auto" and getattr(args, f"{phase}_priority") is not None:  # select() refuses the pair too
            raise UsageError(f"--{phase}-priority sets {phase}'s auto candidates, but {where} names {value}: give "
                             "the backend or the list, not both")
    priority_args(args)


def priority_args(args: argparse.Namespace) -> dict:
    """The --PHASE-priority lists given, as select()'s keyword arguments, every name checked."""
    given = {f"{p}_priority": getattr(args, f"{p}_priority") for p in ("prefill", "decode", "extend")
             if getattr(args, f"{p}_priority") is not None}
    for flag, names in given.items():
        check_names(f"--{flag.replace('_', '-')}", names)
    return given


def check_names(flag: str, names: list[str]) -> None:
    """A list flag of backend names (--backends, --PHASE-priority): at least one name, each a backend."""
    if not names:  # "" or ",": the command would go on with its default silently
        raise UsageError(f"{flag} names no backend; give A,B,..., or leave the flag out for the default")
    for name in names:
        _check_backend_choice(flag, name, allow_auto=False)
