"""The config schema (april_jax/config/keys.py) is the one source of every key: each has a type and a
doc, `--help` lists them all, the ConfigDict and the checks come from it, and no key is dead (each
is read by the code that it configures)."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from april_jax import config as config_lib
from april_jax.config import SPECS, ConfigError, schema
from april_jax.models import qwen3, sharding
from april_jax.rl.losses import LossConfig
from april_jax.rl.train_step import OptimizerConfig
from april_jax.rollout.config import RolloutConfig

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "april_jax"
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


def set_key(c, name: str, value) -> None:
    *path, leaf = name.split(".")
    for part in path:
        c = c[part]
    c[leaf] = value


def other_value(spec: schema.Spec, current=None):
    """A valid value different from the default (or from `current`, a choice)."""
    if spec.choices is not None:
        return next(v for v in spec.choices if v not in (spec.default, current))
    if spec.type is bool:
        return not spec.default
    if spec.type is int:
        return spec.default + 1
    if spec.type is float:
        value = spec.default + 0.5 if spec.le is None else (spec.default + (spec.ge or spec.gt or 0)) / 2
        return value if value != spec.default else spec.default / 2
    return spec.default + "_x"


# ---- every key documented, typed, and listed by --help ----


def test_every_key_has_a_type_a_doc_and_a_valid_default():
    assert len(SPECS) > 90
    for spec in SPECS.values():
        assert spec.type in schema.SCALARS, spec.name
        assert spec.doc.strip() and "\n" not in spec.doc, f"{spec.name}: a one-line doc"
        assert spec.problem(spec.default) is None, f"{spec.name}: its default {spec.default!r} breaks its own rule"
    for cls in (LossConfig, OptimizerConfig, RolloutConfig):  # runtime-only fields carry a doc too
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc", "").strip(), f"{cls.__name__}.{f.name}"


def test_default_config_is_generated_from_the_schema():
    flat = schema.flat(config_lib.default_config())
    assert sorted(flat) == sorted(SPECS)
    for name, value in flat.items():
        assert value == SPECS[name].default and type(value) is SPECS[name].type, name


def test_help_lists_every_key_with_type_default_and_doc():
    proc = subprocess.run(
        [sys.executable, "-m", "april_jax.train", "--help"],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for spec in SPECS.values():
        head = f"  {spec.name} ({spec.type.__name__}, default {spec.default!r}"
        [i] = [i for i, line in enumerate(lines) if line.startswith(head)]
        assert lines[i + 1].strip() == spec.doc, spec.name
        if spec.choices:
            assert all(repr(choice) in lines[i] for choice in spec.choices), lines[i]
    assert "usage: python -m april_jax.train --config FILE" in proc.stdout


def test_help_of_a_prefix_is_that_subtree_and_a_bad_prefix_is_named():
    text = config_lib.help_text("rollout")
    listed = {line.split()[0] for line in text.splitlines() if line.startswith("  ") and not line.startswith("   ")}
    assert listed == {name for name in SPECS if name.startswith("rollout.")}
    assert config_lib.help_text("loss.kl_coef").count("\n  loss.") == 1
    assert set(
        line.split()[0]
        for line in config_lib.help_text("model.tiny").splitlines()
        if line.startswith("  ") and not line.startswith("   ")
    ) == {n for n in SPECS if n.startswith("model.tiny.")}
    with pytest.raises(ConfigError, match="no config key 'rollout.engin'; did you mean 'rollout.engine'"):
        config_lib.help_text("rollout.engin")


@pytest.mark.parametrize(
    "argv",
    [
        ["april_jax.cli.ckpt", "--help"],
        ["april_jax.cli.ckpt", "inspect", "--help"],
        ["april_jax.cli.ckpt", "export-hf", "--help"],
        ["april_jax.cli.plot", "--help"],
    ],
)
def test_ckpt_and_plot_help(argv, capsys):
    import importlib

    module = importlib.import_module(argv[0])
    with pytest.raises(SystemExit) as exit_:
        module.main(argv[1:])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith(f"usage: python -m {argv[0]}")
    for arg in {"inspect": ["path", "--json"], "export-hf": ["path", "out", "--force"]}.get(argv[1], []):
        assert arg in out
    if argv[1] == "--help" and argv[0].endswith("ckpt"):
        assert "inspect" in out and "export-hf" in out


# ---- the checks come from the schema: every rule names its key ----


def test_every_typed_key_rejects_a_value_of_another_type_by_name():
    for spec in SPECS.values():
        if spec.type is str:
            continue
        with pytest.raises(ConfigError, match=f"config key '{spec.name}' expects {spec.type.__name__}, got 'x7'"):
            config_lib.check_overrides(["prog", f"--config.{spec.name}=x7"])
        config_lib.check_overrides(["prog", f"--config.{spec.name}={str(other_value(spec)).lower()}"])


def test_every_choice_and_bound_is_checked_and_names_the_key():
    base = config_lib.default_config()
    base.model.arch, base.data.task = "tiny", "reverse"
    config_lib.validate(base)
    for spec in SPECS.values():
        bad = (
            "no-such-choice"
            if spec.choices
            else spec.gt
            if spec.gt is not None
            else spec.ge - 1
            if spec.ge is not None
            else spec.le + 1
            if spec.le is not None
            else float("inf")
            if spec.finite
            else None
        )
        if bad is None:
            continue
        c = config_lib.default_config()
        c.model.arch, c.data.task = "tiny", "reverse"
        set_key(c, spec.name, bad)
        with pytest.raises(ConfigError) as err:
            config_lib.validate(c)
        assert spec.name in str(err.value) and repr(bad) in str(err.value), (spec.name, str(err.value))


def test_unknown_key_suggests_the_nearest():
    with pytest.raises(
        ConfigError, match="unknown config key 'optimizer.weight_decy'; did you mean --config.optimizer.weight_decay"
    ):
        config_lib.check_overrides(["prog", "--config.optimizer.weight_decy=0.1"])
    c = config_lib.default_config()
    with c.unlocked():
        c.train.totl_steps = 3
    with pytest.raises(ConfigError, match="unknown config key 'train.totl_steps'; did you mean 'train.total_steps'"):
        config_lib.validate(c)


# ---- no dead key ----

RUNTIME = {
    "loss": (LossConfig, config_lib.loss_cfg, ["rl/losses.py", "rl/train_step.py"]),
    "optimizer": (OptimizerConfig, config_lib.optimizer_cfg, ["rl/train_step.py"]),
    "rollout": (RolloutConfig, config_lib.rollout_cfg, ["rollout/april.py"]),
}


def attribute_reads(files) -> set[tuple[str, ...]]:
    """Every attribute chain read in `files` (`c.rollout.engine` -> ('c', 'rollout', 'engine')),
    outside `validate` functions: a key only checked is not a key used."""
    chains = set()

    class Reads(ast.NodeVisitor):
        def visit_FunctionDef(self, node):
            if node.name != "validate":
                self.generic_visit(node)

        def visit_Attribute(self, node):
            parts, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name):
                chains.add(tuple([value.id, *reversed(parts)]))
            self.generic_visit(node)

    for f in files:
        Reads().visit(ast.parse(Path(f).read_text()))
    return chains


def test_every_key_is_read_by_the_code_it_configures():
    """A config-only key must be read as `<cfg>.section.key` somewhere in the package (or its section
    handed over whole with `.to_dict()` to a consumer that takes exactly those names). A key of a
    runtime dataclass (LossConfig, OptimizerConfig, RolloutConfig) must reach it (setting it to
    another valid value changes the resolved object) and be read as a field where that object is used."""
    package = [p for p in PACKAGE.rglob("*.py") if p.name != "schema.py"]
    reads = attribute_reads(package)
    suffixes = {chain[i:] for chain in reads for i in range(len(chain))}
    base = config_lib.default_config()
    base.loss.tis = "sequence"  # so that loss.policy_loss may become 'gspo'
    fields_read = {
        part: {chain[-1] for chain in attribute_reads([PACKAGE / p for p in consumers])}
        for part, (_, _, consumers) in RUNTIME.items()
    }
    dead = []
    for name, spec in SPECS.items():
        *section, field = name.split(".")
        runtime = RUNTIME.get(section[0]) if len(section) == 1 else None
        if runtime and field in {f.name for f in dataclasses.fields(runtime[0])}:
            cls, resolve, consumers = runtime
            c = config_lib.default_config()
            c.loss.tis = "sequence"
            set_key(c, name, other_value(spec, schema.flat(base)[name]))
            assert getattr(resolve(c), field) != getattr(resolve(base), field), f"{name} does not reach {cls.__name__}"
            if field not in fields_read[section[0]]:
                dead.append(f"{name} ({cls.__name__}.{field} is never read)")
        elif (*section, field) not in suffixes and (*section, "to_dict") not in suffixes:
            dead.append(name)
    assert not dead, f"keys nothing reads: {dead}"
    # sections handed over whole: their consumers take exactly these names
    tiny = {n.split(".")[-1] for n in SPECS if n.startswith("model.tiny.")}
    assert tiny <= {f.name for f in dataclasses.fields(qwen3.Qwen3Config)}
    assert {n.split(".")[-1] for n in SPECS if n.startswith("mesh.")} == set(sharding.MESH_AXES)


def test_the_dead_key_check_catches_an_unused_key(monkeypatch):
    """The check above fails for a key nobody reads (a schema with one more key)."""
    extra = dict(SPECS)
    extra["train.unused_knob"] = schema.Spec("train.unused_knob", int, 0, "read by nothing")
    monkeypatch.setattr(config_lib, "SPECS", extra)
    monkeypatch.setattr(sys.modules[__name__], "SPECS", extra)
    with pytest.raises(AssertionError, match=r"keys nothing reads: \['train.unused_knob'\]"):
        test_every_key_is_read_by_the_code_it_configures()


# ---- the task supplies the warm-up examples ----


def test_warmup_examples_come_from_the_task_and_a_task_without_them_is_a_config_error(tmp_path):
    import json

    from april_jax import assets
    from april_jax.data import reverse
    from april_jax.training.task import build_task

    c = config_lib.default_config()
    c.data.task, c.warmup.steps, c.warmup.reverse_frac = "reverse", 5, 0.35
    task = build_task(c, None)
    try:
        assert task.warmup_examples(3, 50) == reverse.sft_examples(3, 50, reverse_frac=0.35)
    finally:
        task.reward.close()
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "What is 1 + 1?", "answer": "2"}) + "\n")
    c = config_lib.default_config()
    c.data.train_path, c.data.tokenizer_path = str(rows), str(assets.smollm2_135m_instruct())
    c.warmup.steps = 2
    with pytest.raises(ConfigError, match="config key 'warmup.steps'=2: data.task='file' has no supervised warm-up"):
        build_task(c, None)
    c.warmup.steps = 0
    task = build_task(c, None)
    try:
        assert task.warmup_examples is None and task.stop_ids and len(task.train.rows) == 1
    finally:
        task.reward.close()
