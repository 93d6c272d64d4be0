"""Inputs that must not run code or train on nothing, through the real CLI: a tokenizer whose chat
template reaches for `os.system`, a reward function that does not exist on the synthetic task, a
`rollout.max_model_len` the prompts fill, a FIFO as the training file. Each is exit 2, one
`error:` line naming the bad thing, no workdir, and (the template) no trace of what it asked for.
The other bad values (reward.fn typos, a wrong type inside a config file, out-of-range numbers)
are checked where they are caught, at the function level.

The CLI cases fail before JAX compiles anything; they start together from one module fixture
(two at a time: the CI machine has two cores) and each test waits for its own.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from april_jax import assets, config as config_lib
from april_jax.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs/tiny.py")
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS="--xla_force_host_platform_device_count=1")
FAST = [
    "--config.warmup.steps=0",
    "--config.train.total_steps=1",
    "--config.eval.every=0",
    "--config.log.tensorboard=false",
    "--config.log.progress=false",
]
HOSTILE = "{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}"


def train(workdir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "april_jax.train", "--config", TINY, f"--config.workdir={workdir}", *FAST, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout)


def assert_one_error_line(proc: subprocess.CompletedProcess, *names: str) -> str:
    """Exit 2, no traceback, exactly one `error:` line, the last one, naming each of `names`."""
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1 and proc.stderr.strip().splitlines()[-1] == errors[0], proc.stderr[-3000:]
    for name in names:
        assert name in errors[0], (name, errors[0])
    return errors[0]


def file_task(tokenizer: Path, data: Path) -> list[str]:
    return [
        "--config.data.task=file",
        f"--config.data.tokenizer_path={tokenizer}",
        f"--config.data.train_path={data}",
        "--config.data.max_prompt_len=64",
    ]


def hostile_tokenizer(folder: Path, marker: Path) -> Path:
    """The real SmolLM2 tokenizer, its chat template replaced by one that runs a shell command."""
    smol = assets.smollm2_135m_instruct()
    folder.mkdir()
    shutil.copy(smol / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((smol / "tokenizer_config.json").read_text())
    config["chat_template"] = HOSTILE.format(marker=marker)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """Builds the inputs, starts every CLI case; {name: Future} and the paths the tests check."""
    base = tmp_path_factory.mktemp("bad_inputs_config")
    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
    data = base / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    marker = base / "template_ran_this"
    hostile = hostile_tokenizer(base / "hostile_tokenizer", marker)
    fifo = base / "prompts.jsonl"
    os.mkfifo(fifo)
    smol = assets.smollm2_135m_instruct()
    cases = {
        "hostile_template": file_task(hostile, data),
        "missing_reward_module_on_reverse": ["--config.reward.fn=no_such_reward_module:score"],
        "max_model_len_under_reverse_prompts": ["--config.rollout.max_model_len=20"],
        "max_model_len_under_file_prompts": file_task(smol, data) + ["--config.rollout.max_model_len=16"],
        "train_path_fifo": file_task(smol, fifo),
    }
    pool = cf.ThreadPoolExecutor(max_workers=2)
    jobs = {name: pool.submit(train, base / name, *args, timeout=120) for name, args in cases.items()}
    yield dict(jobs=jobs, base=base, marker=marker, hostile=hostile, data=data, fifo=fifo)
    pool.shutdown(wait=True)


def test_a_chat_template_that_reaches_for_os_runs_nothing_and_fails_with_one_line(cli):
    proc = cli["jobs"]["hostile_template"].result()
    line = assert_one_error_line(proc, str(cli["hostile"] / "tokenizer_config.json"), "unsafe", "'__init__'")
    assert "rows.jsonl:1" in line, "the first prompt rendered names its row"
    assert not cli["marker"].exists(), "the template's shell command ran"
    assert not (cli["base"] / "hostile_template").exists(), "a refused template must not create the workdir"


def test_reward_fn_on_the_reverse_task_is_imported_not_ignored(cli):
    proc = cli["jobs"]["missing_reward_module_on_reverse"].result()
    assert_one_error_line(proc, "config key 'reward.fn'='no_such_reward_module:score'", "no module")
    assert not (cli["base"] / "missing_reward_module_on_reverse").exists()


def test_reward_fn_on_the_reverse_task_is_the_one_that_scores():
    from april_jax.training.task import build_task

    c = config_lib.default_config()
    c.model.arch, c.data.task, c.reward.workers = "tiny", "reverse", 1
    for spec, scores_with in [
        ("", "reverse"),
        ("reverse", "reverse"),
        ("tests.reward_fns:text_answer", "tests.reward_fns:text_answer"),
    ]:
        c.reward.fn = spec
        task = build_task(c, None)
        try:
            assert task.reward.spec == scores_with, spec
        finally:
            task.reward.close()
    c.reward.fn = "math_verify"  # math answers, not digit lists: a mistake, not a choice to honour silently
    with pytest.raises(ConfigError, match="config key 'reward.fn'='math_verify': data.task='reverse' answers"):
        config_lib.validate(c)


def test_max_model_len_that_the_prompts_fill_is_one_line_naming_the_longest(cli):
    line = assert_one_error_line(
        cli["jobs"]["max_model_len_under_reverse_prompts"].result(),
        "config key 'rollout.max_model_len'=20",
        "the longest prompt has 23 tokens",
        "data.reverse_lengths",
    )
    assert "no room for a response" in line
    line = assert_one_error_line(
        cli["jobs"]["max_model_len_under_file_prompts"].result(), "config key 'rollout.max_model_len'=16"
    )
    tokens, row = re.search(r"the longest prompt has (\d+) tokens \((\S+)\)", line).groups()
    assert int(tokens) > 16 and row.startswith(f"{cli['data']}:")


def test_max_model_len_derived_or_roomy_passes_and_a_short_budget_warns(capsys):
    from april_jax.training.task import check_context

    c = config_lib.default_config()
    c.rollout.max_response_len = 100
    check_context(c, 5000, "rows.jsonl:3")  # 0: derived from data.max_prompt_len, which prompts are held to
    c.rollout.max_model_len = 200
    check_context(c, 100, "rows.jsonl:3")
    assert capsys.readouterr().err == ""
    check_context(c, 150, "rows.jsonl:3")
    assert (
        "warning: rollout.max_model_len=200 leaves the longest prompt (150 tokens, rows.jsonl:3) 50 response "
        "tokens, fewer than rollout.max_response_len=100" in capsys.readouterr().err
    )
    with pytest.raises(ConfigError, match=r"'rollout.max_model_len'=200: the longest prompt has 200 tokens"):
        check_context(c, 200, "rows.jsonl:3")


def test_a_fifo_as_the_training_file_is_refused_unopened(cli):
    proc = cli["jobs"]["train_path_fifo"].result()  # a reader would block on it: the 120 s timeout is the failure
    assert_one_error_line(proc, f"config key 'data.train_path'='{cli['fifo']}'", "a FIFO, not a regular file")


# ---- the same rules at the function that enforces them ----


@pytest.mark.parametrize(
    "spec, why",
    [
        (
            "tests.reward_fns.not_a_number",
            r"expected 'math_verify', 'reverse' or 'module.path:function' \(no ':' before "
            r"the function's name\); did you mean 'tests.reward_fns:not_a_number'\?",
        ),
        ("tests.reward_fns:", r"'' is not a function name"),
        ("tests/reward_fns.py:explodes", r"'tests/reward_fns.py' is not a module path"),
        ("reverse", r"scores the synthetic data.task='reverse' only"),
    ],
)
def test_reward_fn_of_the_wrong_form_is_named_before_anything_is_imported(spec, why):
    c = config_lib.default_config()
    c.data.train_path, c.model.arch, c.reward.fn = "rows.jsonl", "tiny", spec
    with pytest.raises(ConfigError, match=rf"^config key 'reward.fn'={re.escape(repr(spec))}: {why}"):
        config_lib.validate(c)


def test_reward_fn_that_cannot_be_loaded_is_one_line_each_way(tmp_path, monkeypatch):
    from april_jax.rl.rewards import load_function

    (tmp_path / "broken_reward.py").write_text("raise RuntimeError('no judge configured')\n")
    (tmp_path / "needs_dep_reward.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "exits_reward.py").write_text("import sys\nsys.exit(0)\n")
    (tmp_path / "const_reward.py").write_text("THRESHOLD = 0.5\ndef score(sample):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {
        "no_such_module_xyz:score": "no module 'no_such_module_xyz'",
        "tests.no_such_file:score": "no module 'tests.no_such_file'",
        "broken_reward:score": "importing 'broken_reward' failed (RuntimeError: no judge configured)",
        "needs_dep_reward:score": "it imports 'no_such_dependency_xyz', which is not installed",
        "exits_reward:score": "importing 'exits_reward' failed (SystemExit: 0)",
        "const_reward:scor": "module 'const_reward' has no 'scor'; did you mean 'const_reward:score'?",
        "const_reward:THRESHOLD": "'THRESHOLD' is a float, not a function",
    }
    for spec, why in cases.items():
        with pytest.raises(ConfigError) as err:
            load_function(spec)
        message = str(err.value)
        assert message.startswith(f"config key 'reward.fn'={spec!r}: ") and why in message, (spec, message)
        assert "\n" not in message


def test_a_wrong_type_inside_a_config_file_names_the_key(tmp_path):
    from april_jax.config.loading import load_config

    for assignment, why in [
        ('c.train.total_steps = "10"', "config key 'train.total_steps' expects int, got '10' (str)"),
        ("c.data.shuffle = 'false'", "config key 'data.shuffle' expects bool, got 'false' (str)"),
        ("c.optimizer.lr = None", "config key 'optimizer.lr' expects float, got None"),
    ]:
        file = tmp_path / "config.py"
        file.write_text(
            f"from april_jax.config import default_config\n\ndef get_config():\n"
            f"    c = default_config()\n    c.model.arch = 'tiny'\n    c.data.task = 'reverse'\n"
            f"    {assignment}\n    return c\n"
        )
        with pytest.raises(ConfigError, match=re.escape(why)):
            load_config(["prog", "--config", str(file)])
    file.write_text(
        "from april_jax.config import default_config\n\ndef get_config():\n    c = default_config()\n"
        "    c.model.arch, c.data.task, c.optimizer.lr = 'tiny', 'reverse', 1\n    return c\n"
    )
    c = load_config(["prog", "--config", str(file), "--config.optimizer.lr=3e-4"])  # an int still reads as a float
    assert c.optimizer.lr == 3e-4


def test_get_config_returning_no_config_dict_is_named(tmp_path):
    from april_jax.config.loading import load_config

    file = tmp_path / "config.py"
    for returned, kind in [("None", "NoneType"), ("{'seed': 1}", "dict")]:
        file.write_text(f"def get_config():\n    return {returned}\n")
        with pytest.raises(
            ConfigError,
            match=rf"^config file {re.escape(str(file))}: get_config\(\) returned {kind}, "
            r"not a config \(return april_jax.config.default_config\(\)",
        ):
            load_config(["prog", "--config", str(file)])


@pytest.mark.parametrize(
    "name, value, why",
    [
        ("seed", -1, "must be in [0, 4294967295]"),
        ("seed", 2**32, "must be in [0, 4294967295]"),  # PRNGKey(2**32) is seed 0's key
        ("rollout.max_num_seqs", 10**23, "must be in (0, 65536]"),
        ("rollout.max_model_len", 10**23, "must be in [0, 4194304]"),
        ("data.max_prompt_len", 10**23, "must be in (0, 4194304]"),
        ("reward.workers", 10**6, "must be in (0, 1024]"),
    ],
)
def test_numbers_out_of_range_fail_before_anything_is_built(name, value, why):
    c = config_lib.default_config()
    c.model.arch, c.data.task = "tiny", "reverse"
    section, _, leaf = name.rpartition(".")
    (c[section] if section else c)[leaf] = value
    with pytest.raises(ConfigError, match=re.escape(f"config key {name!r}={value!r}: {why}")):
        config_lib.validate(c)
