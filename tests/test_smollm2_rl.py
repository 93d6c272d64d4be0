"""The SmolLM2 learning config: its word-problem data (seeded, held-out split apart), its reward, and
the config itself (parses, validates, its assets resolve, every prompt fits its token budget)."""

import json
from pathlib import Path

import pytest

from april_jax.data import word_problems
from april_jax.rl.rewards import RewardSample, load_function

ROOT = Path(__file__).resolve().parents[1]


def arithmetic(row):
    return (row["kind"], *row["numbers"])


def test_generator_is_deterministic_under_its_seed():
    assert word_problems.generate("train", 300, seed=0) == word_problems.generate("train", 300, seed=0)
    assert word_problems.generate("train", 300, seed=0) != word_problems.generate("train", 300, seed=1)
    # a longer split starts with the shorter one: the evaluation set does not shift when it grows
    assert word_problems.generate("eval", 120)[:50] == word_problems.generate("eval", 50)


def test_answers_are_the_arithmetic_of_the_question():
    compute = {
        "add": lambda a, b: a + b,
        "sub": lambda a, b: a - b,
        "mul": lambda a, b: a * b,
        "two_step": lambda a, b, c: a + b - c,
    }
    for row in word_problems.generate("train", 400) + word_problems.generate("eval", 100):
        assert int(row["answer"]) == compute[row["kind"]](*row["numbers"]) >= 0, row
        assert all(str(n) in row["prompt"] for n in row["numbers"]), row
    assert {r["kind"] for r in word_problems.generate("eval", 100)} == set(compute)


def test_held_out_split_shares_no_arithmetic_with_training():
    train = word_problems.generate("train", 2000)
    held_out = word_problems.generate("eval", 100)
    assert not {arithmetic(r) for r in train} & {arithmetic(r) for r in held_out}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert len({arithmetic(r) for r in held_out}) == 100  # distinct sums, not one sum under many names
    with pytest.raises(ValueError, match="split must be 'train' or 'eval'"):
        word_problems.generate("test", 10)


def sample(response, answer):
    return RewardSample(
        prompt="",
        prompt_text="",
        prompt_ids=[],
        response=response,
        response_ids=[],
        answer=answer,
        finish_reason="stop",
    )


@pytest.mark.parametrize(
    "response,answer,expected",
    [
        ("Mia has 11 + 2 = 13 pencils now.", "13", 1.0),
        ("13", "13", 1.0),
        ("The answer is 1,200.", "1200", 1.0),
        ("She has 7 - 3 = 4.0 apples left.", "4", 1.0),
        # the right sum, then more talk ending on another number: the answer must be the last word
        ("Mia has 11 + 2 = 13 pencils. This is like 11 + 2 = 22.", "13", 0.0),
        ("Anna has 6 * 1 = 6 cookies left.", "5", 0.0),
        ("Let's think about how many pencils Mia has", "13", 0.0),
        ("", "13", 0.0),
        ("It is 13.", None, 0.0),
    ],
)
def test_reward_pays_the_last_number(response, answer, expected):
    assert word_problems.reward(sample(response, answer)) == expected


def test_config_loads_and_its_data_fits(tmp_path, monkeypatch):
    from april_jax import assets
    from april_jax.config.loading import load_config
    from april_jax.data.tokenizer import ChatTokenizer

    weights = assets.smollm2_135m_instruct()  # converted once into the user's cache
    monkeypatch.setitem(assets.ASSETS, "smollm2-135m-instruct", lambda: weights)
    monkeypatch.setenv("APRIL_JAX_CACHE", str(tmp_path))  # the data is built into this test's
    c = load_config(["x", "--config", str(ROOT / "configs/smollm2_rl.py")])
    assert c.rollout.partial_rollout and c.eval.every and c.eval.temperature == 0.0
    assert load_function(c.reward.fn) is word_problems.reward
    train = [json.loads(line) for line in Path(c.data.train_path).read_text().splitlines()]
    held_out = [json.loads(line) for line in Path(c.data.eval_path).read_text().splitlines()]
    assert Path(c.data.train_path).parent == tmp_path and len(held_out) == c.eval.num_prompts
    assert not {arithmetic(r) for r in train} & {arithmetic(r) for r in held_out}
    tok = ChatTokenizer(c.model.path)
    # rendering the chat template per prompt takes seconds for 2,100 prompts: the question sits between
    # special tokens, so its own tokens plus the template's are the prompt's (checked on the longest)
    questions = [r["prompt"] for r in train + held_out]
    lengths = [len(e.ids) for e in tok.tok.encode_batch(questions, add_special_tokens=False)]
    longest = questions[max(range(len(questions)), key=lengths.__getitem__)]
    assert len(tok.encode_prompt(longest)) == max(lengths) + len(tok.encode_prompt("")) <= c.data.max_prompt_len
