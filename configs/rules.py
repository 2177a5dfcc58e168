"""Value rules for config keys: small functions ``value -> None`` (fine) or what was expected.

Shared by the untyped keys' table (:mod:`configs.schema`) and the typed config groups' ``__post_init__``
checks (e.g. :class:`fleet.learner_config.LearnerConfig`), so every config problem reads the same:
``key: expected ..., given ...``. No heavy imports: a config module of any package may use it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any


class ConfigError(ValueError):
    """One or more config values break their rule; the message lists each as ``key: expected ..., given ...``."""


Rule = Callable[[Any], str | None]   # value -> None (fine) or what was expected


def integer(lo: int | None = None) -> Rule:
    def rule(v):
        if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
            return "an integer" + (f" >= {lo}" if lo is not None else "")
        return None
    return rule


def number(lo: float | None = None, hi: float | None = None, open_lo: bool = False) -> Rule:
    def rule(v):
        ok = not isinstance(v, bool) and isinstance(v, int | float) and not math.isnan(v)
        if ok and lo is not None:
            ok = v > lo if open_lo else v >= lo
        if ok and hi is not None:
            ok = v <= hi
        if ok:
            return None
        rng = (f" > {lo}" if open_lo else f" >= {lo}") if lo is not None else ""
        return "a number" + rng + (f" and <= {hi}" if hi is not None else "")
    return rule


def one_of(*choices: str) -> Rule:
    return lambda v: None if v in choices else f"one of {list(choices)}"


def boolean(v) -> str | None:
    return None if isinstance(v, bool) else "true or false"


def optional(rule: Rule) -> Rule:
    return lambda v: None if v is None else (None if rule(v) is None else f"null or {rule(v)}")


def int_list(lo: int = 0) -> Rule:
    def rule(v):
        if isinstance(v, list | tuple) and v and all(integer(lo)(x) is None for x in v):
            return None
        return f"a non-empty list of integers >= {lo}"
    return rule


POS = integer(1)


def check_fields(obj: Any, rules: Mapping[str, Rule], prefix: str) -> list[str]:
    """The rule each attribute of ``obj`` named in ``rules`` breaks, one line each (``prefix.name: expected
    ..., given ...``); interpolation strings (``${...}``) are skipped (they are checked once resolved)."""
    out = []
    for name, rule in rules.items():
        v = getattr(obj, name)
        if isinstance(v, str) and "${" in v:
            continue
        why = rule(v)
        if why is not None:
            out.append(f"{prefix}.{name}: expected {why}, given {v!r}")
    return out
