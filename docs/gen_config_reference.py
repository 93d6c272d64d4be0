"""Write docs/configuration.md from the config schema, so the reference cannot drift from the code.

    python docs/gen_config_reference.py > docs/configuration.md   # regenerate after changing a key
    python docs/gen_config_reference.py --check                    # exit 1 if the committed file is stale

Every key is declared once, as a dataclass field with its default, type, allowed values and doc
(`schema.key(...)`); this prints those declarations as one Markdown table per config section, in
the schema's order, the same facts `python -m april_jax.train --help` prints.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "configuration.md"

HEADER = """\
# Configuration reference

Generated from the config schema by `python docs/gen_config_reference.py > docs/configuration.md`;
do not edit by hand (`tests/test_docs.py` fails when this file and the schema disagree).

A run's config is a Python file whose `get_config()` starts from `default_config()` and changes
keys (`configs/*.py`); `--config.KEY=VALUE` on the command line overrides any key. A mistyped key,
a wrong type, a value outside its choices or bounds stops the run before it touches the workdir,
with one `error:` line naming the key. `python -m april_jax.train --help [KEY.PREFIX]` prints the
same reference in the terminal.
"""


def _schema_modules():
    """(the config module, the schema module), wherever the package keeps the schema machinery."""
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere: this checkout's package, not an installed one
    from april_jax import config

    try:
        from april_jax.config import schema
    except ImportError:
        from april_jax.config import schema
    return config, schema


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(value) -> str:
    return "`''`" if value == "" else f"`{value!r}`"


def render() -> str:
    config, schema = _schema_modules()
    specs = schema.specs(config.Config)
    sections = schema.section_docs(config.Config)
    out = [HEADER.rstrip("\n")]
    current = None
    for spec in specs.values():
        section = spec.name.rpartition(".")[0]
        if section != current:
            current = section
            title = f"`{section}`: {sections[section]}" if section else "Top level"
            level = "##" if "." not in section else "###"
            out.append(f"\n{level} {_cell(title)}\n")
            out.append("| key | type | default | allowed | what it does |")
            out.append("|---|---|---|---|---|")
        rule = spec.rule()
        out.append(
            f"| `{spec.name}` | {spec.type.__name__} | {_cell(_default(spec.default))} | "
            f"{_cell(rule) if rule else 'any'} | {_cell(spec.doc)} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"compare with {REFERENCE.relative_to(ROOT)} instead of printing; exit 1 when it is stale",
    )
    args = parser.parse_args(argv)
    text = render()
    if not args.check:
        sys.stdout.write(text)
        return 0
    committed = REFERENCE.read_text() if REFERENCE.exists() else ""
    if committed == text:
        return 0
    diff = difflib.unified_diff(
        committed.splitlines(True), text.splitlines(True), str(REFERENCE.relative_to(ROOT)), "generated from the schema"
    )
    sys.stderr.writelines(list(diff)[:60])
    print(
        f"error: {REFERENCE.relative_to(ROOT)} is stale: run python docs/gen_config_reference.py "
        f"> {REFERENCE.relative_to(ROOT)}",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
