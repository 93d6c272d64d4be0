"""Config keys declared once, as dataclass fields: default, type, allowed values and a one-line doc.

A config section is a dataclass whose fields are made with `key(...)` (a setting a user may change)
or `internal(...)` (filled in by the code, not a config key). `april_jax/config/keys.py` nests the
sections into one schema; from it come the ml_collections ConfigDict that `configs/*.py` edit, the
per-key checks (type, choices, bounds; unknown keys with the nearest one suggested), the parsing
of `--config.a.b=value` strings, and `python -m april_jax.train --help`. The runtime dataclasses
(`LossConfig`, `OptimizerConfig`, `RolloutConfig`) declare their own keys the same way, so their
`validate()` runs the same generated checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing

SCALARS = (bool, int, float, str)


class ConfigError(ValueError):
    """A bad config key or value; the message names it."""


def key(default, doc: str, *, choices=None, gt=None, ge=None, le=None, finite: bool = False):
    """A config key. `choices`: the allowed values; `gt`/`ge`/`le`: bounds; `finite`: no inf/nan."""
    meta = dict(doc=doc, choices=tuple(choices) if choices is not None else None, gt=gt, ge=ge, le=le, finite=finite)
    return dataclasses.field(default=default, metadata=meta)


def internal(default, doc: str):
    """A field the code fills in (e.g. from another key or the task): not a config key."""
    return dataclasses.field(default=default, metadata=dict(doc=doc, internal=True))


def section(cls, doc: str):
    """A nested group of keys (`model.tiny`, or a top-level section of the schema)."""
    return dataclasses.field(default_factory=cls, metadata=dict(doc=doc, section=cls))


@dataclasses.dataclass(frozen=True)
class Spec:
    """One config key, flattened: `name` is dotted (`rollout.max_staleness`)."""

    name: str
    type: type
    default: object
    doc: str
    choices: tuple | None = None
    gt: float | None = None
    ge: float | None = None
    le: float | None = None
    finite: bool = False

    def bounds(self) -> str:
        """The numeric range in words ('' when unbounded)."""
        if self.le is not None:
            low = f"({self.gt}" if self.gt is not None else f"[{self.ge}"
            return f"in {low}, {self.le}]"
        return f"> {self.gt}" if self.gt is not None else f">= {self.ge}" if self.ge is not None else ""

    def rule(self) -> str:
        """The allowed values in words ('' when any value of the type goes)."""
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        return " ".join(filter(None, ["finite" if self.finite else "", self.bounds()]))

    def problem(self, value) -> str | None:
        """Why `value` is not allowed for this key, or None."""
        t = self.type
        ok = isinstance(value, t) and not (t is int and isinstance(value, bool))
        ok = ok or (t is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            return f"expects {t.__name__}, got {value!r} ({type(value).__name__})"
        if self.choices is not None and value not in self.choices:
            return f"expected one of {self.choices}"
        if t in (int, float):
            bad = (
                (self.finite and not math.isfinite(value))
                or (self.gt is not None and not value > self.gt)
                or (self.ge is not None and not value >= self.ge)
                or (self.le is not None and not value <= self.le)
            )
            if bad:
                return (
                    f"must be a finite number {self.bounds()}".rstrip() if self.finite else f"must be {self.bounds()}"
                )
        return None

    def parse(self, text: str):
        """A `--config.KEY=text` string as this key's type; ConfigError naming the key if it is not one."""
        if self.type is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ConfigError(f"config key {self.name!r} expects bool, got {text!r}")
            return text.lower() in ("true", "1")
        if self.type in (int, float):
            try:
                return self.type(text)
            except ValueError:
                raise ConfigError(f"config key {self.name!r} expects {self.type.__name__}, got {text!r}") from None
        return text


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


@functools.cache
def specs(cls, prefix: str = "") -> dict[str, Spec]:
    """{dotted key: Spec} of every config key under the dataclass `cls` (internal fields left out).
    Cached (every validate() asks): treat it as read-only."""
    hints = _hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        if f.metadata.get("section"):
            out.update(specs(f.metadata["section"], name + "."))
            continue
        if f.metadata.get("internal"):
            continue
        if "doc" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name}: declare it with schema.key(...) or schema.internal(...)")
        t = hints[f.name]
        if t not in SCALARS:
            raise TypeError(f"{cls.__name__}.{f.name}: a config key is one of {SCALARS}, not {t}")
        m = f.metadata
        out[name] = Spec(name, t, f.default, m["doc"], m["choices"], m["gt"], m["ge"], m["le"], m["finite"])
    return out


def section_docs(cls, prefix: str = "") -> dict[str, str]:
    """{dotted section name: its doc} of every nested section under `cls`."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("section"):
            out[prefix + f.name] = f.metadata["doc"]
            out.update(section_docs(f.metadata["section"], prefix + f.name + "."))
    return out


def to_configdict(cls):
    """The ml_collections ConfigDict of `cls`'s keys at their defaults (nested sections nested).

    Not type-safe: ml_collections would reject a config file's `c.train.total_steps = "10"` inside
    get_config with a traceback that names neither the key's section nor the file; let through,
    `check_values` names the key (`config key 'train.total_steps' expects int, got '10'`)."""
    import ml_collections

    c = ml_collections.ConfigDict(type_safe=False)
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("section"):
            setattr(c, f.name, to_configdict(f.metadata["section"]))
        elif not f.metadata.get("internal"):
            setattr(c, f.name, float(f.default) if hints[f.name] is float else f.default)
    return c


def flat(c, prefix: str = "") -> dict:
    """{dotted key: value} of a (nested) ConfigDict."""
    out = {}
    for name, value in c.items():
        if hasattr(value, "items"):
            out.update(flat(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


def nearest(name: str, known) -> str | None:
    found = difflib.get_close_matches(name, list(known), n=1, cutoff=0.5)
    return found[0] if found else None


def check_values(values: dict, known: dict[str, Spec], skip=frozenset()) -> None:
    """Every key known, and (unless in `skip`) of its type, within its choices and bounds; else a
    ConfigError naming it: `config key 'a.b'=value: why`."""
    for name, value in values.items():
        if name not in known:
            near = nearest(name, known)
            raise ConfigError(f"unknown config key {name!r}" + (f"; did you mean {near!r}?" if near else ""))
        why = None if name in skip else known[name].problem(value)
        if why is not None:
            raise ConfigError(
                f"config key {name!r}" + (f" {why}" if why.startswith("expects") else f"={value!r}: {why}")
            )


def check_fields(obj, prefix: str) -> None:
    """The generated per-key checks of one section dataclass instance, for its own `validate()`
    (also used without a config, so the message names the field as `prefix.field=value: why`)."""
    for name, spec in specs(type(obj), prefix + ".").items():
        value = getattr(obj, name.rsplit(".", 1)[1])
        why = spec.problem(value)
        if why is not None:
            raise ConfigError(f"{name}" + (f" {why}" if why.startswith("expects") else f"={value!r}: {why}"))


def help_text(cls, prefix: str = "") -> str:
    """Every key under `prefix` ('' for all) with its type, default, allowed values and doc."""
    known, sections = specs(cls), section_docs(cls)
    chosen = [s for s in known.values() if not prefix or s.name == prefix or s.name.startswith(prefix + ".")]
    lines, shown = [], set()
    for s in chosen:
        parts = s.name.split(".")
        for depth in range(1, len(parts)):
            name = ".".join(parts[:depth])
            if name in sections and name not in shown:
                shown.add(name)
                lines.append(f"\n{name}: {sections[name]}")
        rule = s.rule()
        lines.append(f"  {s.name} ({s.type.__name__}, default {s.default!r}{'; ' + rule if rule else ''})")
        lines.append(f"      {s.doc}")
    return "\n".join(lines).lstrip("\n")
