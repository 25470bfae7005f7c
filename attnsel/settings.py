"""Every ATTNSEL_* environment variable in one place: its name, default and allowed values, read and validated here.

``Settings.from_env()`` reads them all and raises ``SettingsError`` (naming the variable, its value and what is
allowed) for the first bad one. ``select()``, the CLI's main and the integrations' ``register()`` call it at
start-up, so a bad value is named at once; each module reads the setting it needs through it when it needs it (the
environment may change between calls: launchers and tests set variables per run). An empty value counts as unset.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from types import MappingProxyType

from .errors import AttnselError


class SettingsError(AttnselError, ValueError):
    """An ATTNSEL_* variable whose value attnsel refuses. ``variable``: its name."""

    def __init__(self, variable: str, value: str, allowed: str):
        super().__init__(f"{variable}={value!r}: expected {allowed}")
        self.variable = variable


def _seconds(raw: str) -> float:
    value = float(raw)
    if not value > 0:  # NaN too
        raise ValueError(raw)
    return value


def _whole(least: int):
    def parse(raw: str) -> int:
        value = int(raw)
        if value < least:
            raise ValueError(raw)
        return value
    return parse


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(raw)


_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _plugins(raw: str) -> tuple[str, ...]:
    targets = tuple(t.strip() for t in raw.split(",") if t.strip())
    if not all(_TARGET.match(t) for t in targets):
        raise ValueError(raw)
    return targets


def _json_object(raw: str) -> dict:
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError(raw)
    return value


def _var(env: str, default, parse, allowed: str):
    return dataclasses.field(default=default, metadata={"env": env, "parse": parse, "allowed": allowed})


def _seconds_var(env: str, default: float):
    return _var(env, default, _seconds, f"a positive number of seconds (inf: no limit; default {default:g})")


_BACKEND = "'auto' or a backend name (`attnsel report` lists them; default auto)"


@dataclasses.dataclass(frozen=True)
class Settings:
    """The values of attnsel's environment variables (the defaults where unset)."""

    prefill_backend: str = _var("ATTNSEL_PREFILL_BACKEND", "auto", str, _BACKEND)
    decode_backend: str = _var("ATTNSEL_DECODE_BACKEND", "auto", str, _BACKEND)
    extend_backend: str = _var("ATTNSEL_EXTEND_BACKEND", "auto", str, _BACKEND)
    backends: tuple[str, ...] = _var("ATTNSEL_BACKENDS", (), _plugins,
                                     "plugin backends as module:object entries separated by commas")
    cache_dir: str | None = _var("ATTNSEL_CACHE_DIR", None, str, "a directory for the result cache")
    validation_timeout_s: float = _seconds_var("ATTNSEL_VALIDATION_TIMEOUT", 600.0)  # per candidate, in the worker
    check_timeout_s: float = _seconds_var("ATTNSEL_CHECK_TIMEOUT_S", 10.0)  # a plugin's checks in this process
    timing_budget_s: float = _seconds_var("ATTNSEL_TIMING_BUDGET_S", 75.0)  # bucket timing per selection,
    # shared by the timed phases (25 s each of prefill, decode and extend)
    flashinfer_workspace_mb: int = _var("ATTNSEL_FLASHINFER_WORKSPACE_MB", 128, _whole(8),
                                        "a whole number of MiB, at least 8 (default 128; a spec whose FlashInfer "
                                        "plans may need more gets more)")
    check_metadata: bool = _var("ATTNSEL_CHECK_METADATA", False, _flag,
                                "1/true/yes/on (check plan metadata values, one host copy per plan) or "
                                "0/false/no/off (trust them, the default)")
    dist_timeout_s: float = _seconds_var("ATTNSEL_DIST_TIMEOUT_S", 600.0)  # every rank must ask within this
    dist_decide_timeout_s: float = _seconds_var("ATTNSEL_DIST_DECIDE_TIMEOUT_S", 3600.0)  # rank 0 decides within
    kernel_options: dict | None = _var("ATTNSEL_KERNEL_OPTIONS", None, _json_object,
                                       "a JSON object of selection options (hf_kernels.register_kernel writes it)")
    canary: int = _var("ATTNSEL_CANARY", 0, _whole(0), "a whole number >= 0 (0: off, the default)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings from ``environ`` (default: os.environ); SettingsError for the first bad value."""
        env = os.environ if environ is None else environ
        return cls(**{f.name: _read(f, env) for f in _FIELDS})

    @property
    def flashinfer_workspace_bytes(self) -> int:
        return self.flashinfer_workspace_mb << 20


def _read(field: dataclasses.Field, env: Mapping[str, str]):
    raw = env.get(field.metadata["env"])
    if raw is None or not raw.strip():
        return field.default
    try:
        return field.metadata["parse"](raw.strip())
    except ValueError:  # json.JSONDecodeError too
        raise SettingsError(field.metadata["env"], raw, field.metadata["allowed"]) from None


def read(name: str, environ: Mapping[str, str] | None = None):
    """One setting (a Settings field name) from ``environ`` (default: os.environ), validated as ``from_env`` does:
    for the hot paths that need one value per call (a plan, a registry lookup)."""
    return _read(_BY_NAME[name], os.environ if environ is None else environ)


_FIELDS = tuple(dataclasses.fields(Settings))
_BY_NAME = MappingProxyType({f.name: f for f in _FIELDS})
ENV = MappingProxyType({f.name: f.metadata["env"] for f in _FIELDS})  # field -> variable name, for messages
