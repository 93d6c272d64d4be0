"""The documentation stays true to the code: the configuration reference is the schema's, links resolve,
and the prose speaks of the product."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "docs" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_equals_what_the_schema_generates():
    from april_jax import config

    generated = _generator().render()
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == generated, (
        "docs/configuration.md is stale: python docs/gen_config_reference.py > docs/configuration.md"
    )
    for name in ("rollout.max_staleness", "loss.kl_coef", "model.path"):  # the table rows come from the schema's keys
        assert f"| `{name}` |" in generated
    assert generated.count("\n| `") == len(config.SPECS)


def test_relative_links_in_the_docs_point_at_files_that_exist():
    missing = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue
            if not (doc.parent / target.split("#")[0]).exists():
                missing.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not missing, missing


def test_docs_describe_the_product_not_how_it_was_built():
    history = re.compile(r"session [0-9]|issue #?[0-9]|helper h[0-9]", re.IGNORECASE)
    found = [
        f"{doc.relative_to(ROOT)}:{n}: {line.strip()}"
        for doc in DOCS
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        if history.search(line)
    ]
    assert not found, found
