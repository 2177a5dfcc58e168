"""Value rules for config keys: small functions ``value -> None`` (fine) or what was expected.

Shared by the untyped keys' table (:mod:`configs.schema`) and the typed config groups' ``__post_init__``
checks (e.g. :class:`fleet.fert.learner_config.LearnerConfig`), so every config problem reads the same:
``key: expected ..., given ...``. No heavy imports: a config module of any package may use it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any


class ConfigError(ValueError):
    """One or more config values break their rule; the message lists each as ``key: expected ..., given ...``."""

    def lines(self) -> list[str]:
        """The problem lines of the message (below its heading; the whole message when it is one line)."""
        return [line.strip() for line in str(self).splitlines()[1:]] or [str(self)]


Rule = Callable[[Any], str | None]   # value -> None (fine) or what was expected


def integer(lo: int | None = None) -> Rule:
    def rule(v):
        if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
            return "an integer" + (f" >= {lo}" if lo is not None else "")
        return None
    return rule


def number(lo: float | None = None, hi: float | None = None, open_lo: bool = False, finite: bool = False) -> Rule:
    def rule(v):
        ok = not isinstance(v, bool) and isinstance(v, int | float) and not math.isnan(v)
        ok = ok and (not finite or math.isfinite(v))
        if ok and lo is not None:
            ok = v > lo if open_lo else v >= lo
        if ok and hi is not None:
            ok = v <= hi
        if ok:
            return None
        rng = (f" > {lo}" if open_lo else f" >= {lo}") if lo is not None else ""
        return ("a finite number" if finite else "a number") + rng + (f" and <= {hi}" if hi is not None else "")
    return rule


def one_of(*choices: str) -> Rule:
    return lambda v: None if v in choices else f"one of {list(choices)}"


def boolean(v) -> str | None:
    return None if isinstance(v, bool) else "true or false"


def optional(rule: Rule) -> Rule:
    return lambda v: None if v is None else (None if rule(v) is None else f"null or {rule(v)}")


def int_list(lo: int = 0, empty: bool = False) -> Rule:
    """A list of integers >= ``lo``; non-empty unless ``empty``."""
    def rule(v):
        if isinstance(v, list | tuple) and (v or empty) and all(integer(lo)(x) is None for x in v):
            return None
        return f"a {'' if empty else 'non-empty '}list of integers >= {lo}"
    return rule


def names(v) -> str | None:
    """A non-empty list of non-empty strings (task, arm or variant names)."""
    return None if isinstance(v, list | tuple) and v and all(isinstance(x, str) and x for x in v) \
        else "a non-empty list of names"


def xyz(v) -> str | None:
    """None or three finite numbers (a point, e.g. a workspace box corner in metres)."""
    if v is None or (isinstance(v, list | tuple) and len(v) == 3 and all(number(finite=True)(x) is None for x in v)):
        return None
    return "null or [x, y, z] metres"


POS = integer(1)
POS_NUMBER = number(0, open_lo=True)
FINITE_POS = number(0, open_lo=True, finite=True)
"""A positive, finite number: a limit that ``inf`` must not switch off (an explicit null does, with its warning)."""


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


class TypedConfig:
    """The checks every typed config dataclass shares (``configs.typed``): a subclass is a ``@dataclass`` with
    the class attributes ``_group`` (its Hydra group, the prefix of its messages) and ``_rules`` (``{field:
    Rule}``). Building one runs the rules; :meth:`from_dict` also refuses unknown keys.

    Raises:
        ConfigError: on construction, every field out of its range (``<group>.<field>: expected ..., given ...``).
    """

    _group: str = "config"
    _rules: Mapping[str, Rule] = {}
    _nested: Mapping[str, type] = {}   # {field: TypedConfig subclass}: a mapping given for it is built by from_dict

    def __post_init__(self) -> None:
        bad = self.problems()
        if bad:
            raise ConfigError(f"invalid {self._group} config:\n  " + "\n  ".join(bad))

    def problems(self, prefix: str | None = None) -> list[str]:
        """Every field out of its range, one line each: ``<prefix or group>.<field>: expected ..., given ...``."""
        return check_fields(self, self._rules, prefix or self._group)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None):
        """``d`` (a plain mapping, e.g. the composed config's group as a dict, or part of it) -> the config; a key
        ``d`` leaves out takes the field's default. Raises :class:`ConfigError` naming an unknown key or a value out
        of range."""
        import dataclasses

        if isinstance(d, cls):
            return d
        if type(d).__module__.startswith("omegaconf"):   # a DictConfig: plain values (lists, nested mappings)
            from omegaconf import OmegaConf

            d = OmegaConf.to_container(d, resolve=True)
        given = dict(d or {})
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ConfigError(f"{cls._group}: unknown keys {unknown}; expected keys from {names}")
        bad: list[str] = []
        for name, sub in cls._nested.items():   # a partial mapping takes the nested defaults for the rest
            if name in given and (given[name] is None or isinstance(given[name], Mapping)):
                try:
                    given[name] = sub.from_dict(given[name])
                except ConfigError as e:
                    bad += e.lines()
                    del given[name]
        try:
            out = cls(**given)
        except ConfigError as e:
            bad += e.lines()
        if bad:
            raise ConfigError(f"invalid {cls._group} config:\n  " + "\n  ".join(bad))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The plain dict (JSON-able), as the composed config's group reads."""
        import dataclasses

        return dataclasses.asdict(self)
