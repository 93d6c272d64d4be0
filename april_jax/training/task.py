"""What a run trains on: the prompts, how responses are scored and decoded, and (for tasks that
have them) supervised warm-up examples. `build_task(c)` makes the `Task` for `data.task`."""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator

from april_jax import config as config_lib
from april_jax.config import ConfigError

WarmupExamples = Callable[[int, int], list]  # (seed, n) -> [(prompt ids, answer ids)]


@dataclasses.dataclass
class Task:
    train: Iterator  # PromptRecords, resumable (state_dict / load_state_dict)
    eval_prompts: list  # held-out PromptRecords (may be empty)
    stop_ids: tuple[int, ...]  # token ids that end a response
    vocab_size: int | None  # the tokenizer's, compared with the model's
    decode: Callable  # response ids -> text, for the reward
    decode_prompt: Callable  # prompt ids -> text (special tokens kept), for the reward
    warmup_examples: WarmupExamples | None = None  # supervised (prompt, answer) pairs; None: the task has none
    reward: object = None  # the RewardModel (worker processes: close it when the run ends)
    longest_prompt: tuple[int, str] = (0, "")  # (tokens, where) of the longest prompt the task can draw


def build_task(c, model_path: str | None) -> Task:
    """The Task of `data.task`, scored by `reward.fn` (imported first: a bad one fails before the
    data is read). Fails (ConfigError) on `warmup.steps > 0` for a task without warm-up data, and on
    a `rollout.max_model_len` that leaves the longest prompt no room for a response."""
    from april_jax.rl.rewards import RewardModel, load_function

    reward_fn = config_lib.reward_spec(c)
    load_function(reward_fn)
    task = _reverse_task(c) if c.data.task == "reverse" else _file_task(c, model_path)
    if c.warmup.steps and task.warmup_examples is None:
        raise ConfigError(
            f"config key 'warmup.steps'={c.warmup.steps}: data.task={c.data.task!r} has no supervised "
            "warm-up examples (set warmup.steps=0)"
        )
    check_context(c, *task.longest_prompt)
    # last: it starts the scoring processes
    task.reward = RewardModel(reward_fn, timeout_s=c.reward.timeout_s, workers=c.reward.workers)
    return task


def check_context(c, longest: int, where: str) -> None:
    """An engine rejects a prompt that fills `rollout.max_model_len` (an empty response, reward 0,
    nothing to learn from, step after step): fail up front. A context that only cuts the response
    budget short is allowed, with a warning."""
    limit = c.rollout.max_model_len
    if not limit:
        return  # derived: data.max_prompt_len + rollout.max_response_len, room for every kept prompt
    if longest >= limit:
        raise ConfigError(
            f"config key 'rollout.max_model_len'={limit}: the longest prompt has {longest} tokens "
            f"({where}), leaving no room for a response (set it above {longest}; 0: "
            f"data.max_prompt_len + rollout.max_response_len)"
        )
    if longest + c.rollout.max_response_len > limit:
        print(
            f"warning: rollout.max_model_len={limit} leaves the longest prompt ({longest} tokens, {where}) "
            f"{limit - longest} response tokens, fewer than rollout.max_response_len={c.rollout.max_response_len}",
            file=sys.stderr,
        )


def _reverse_task(c) -> Task:
    from april_jax.data import reverse

    try:
        buckets = reverse.parse_lengths(c.data.reverse_lengths)
    except ValueError as e:
        raise ConfigError(f"config key 'data.reverse_lengths'={c.data.reverse_lengths!r}: {e}") from None
    longest_prompt = len(reverse.encode_prompt([0] * max(hi for _, _, hi in buckets)))
    if longest_prompt > c.data.max_prompt_len:
        raise ConfigError(
            f"config key 'data.reverse_lengths'={c.data.reverse_lengths!r}: prompts of up to "
            f"{longest_prompt} tokens, over data.max_prompt_len={c.data.max_prompt_len}"
        )
    return Task(
        reverse.ReverseTask(c.seed, "train", buckets),
        reverse.ReverseTask(c.seed, "eval", buckets).take(c.eval.num_prompts),
        (reverse.EOS,),
        reverse.VOCAB_SIZE,
        reverse.decode,
        reverse.decode,
        warmup_examples=functools.partial(reverse.sft_examples, reverse_frac=c.warmup.reverse_frac, buckets=buckets),
        longest_prompt=(longest_prompt, f"data.reverse_lengths={c.data.reverse_lengths!r}"),
    )


def _file_task(c, model_path: str | None) -> Task:
    from april_jax.data.dataset import PromptDataset, read_rows
    from april_jax.data.tokenizer import load_tokenizer

    tok = load_tokenizer(
        c.data.tokenizer_path or model_path,
        system_prompt=c.data.system_prompt,
        chat=c.data.chat_template,
        template_kwargs=config_lib.chat_template_kwargs(c),
    )
    lengths = dict(max_prompt_len=c.data.max_prompt_len, overlong=c.data.overlong_prompt)
    train_rows = read_rows(c.data.train_path, c.data.prompt_key, c.data.answer_key, key="data.train_path")
    if not tok.template and any(not isinstance(r[0], str) for r in train_rows):
        raise ConfigError(
            f"{c.data.train_path}: prompts are chat messages but no chat template is used "
            "(data.chat_template=false or the tokenizer has none)"
        )
    train = PromptDataset(train_rows, tok.encode_prompt, seed=c.seed, shuffle=c.data.shuffle, **lengths)
    datasets = [train]
    eval_prompts = []
    if c.data.eval_path:
        ev = PromptDataset(
            read_rows(c.data.eval_path, c.data.prompt_key, c.data.answer_key, key="data.eval_path"),
            tok.encode_prompt,
            shuffle=False,
            **lengths,
        )
        eval_prompts = [next(ev) for _ in range(min(c.eval.num_prompts, len(ev.rows)))]
        datasets.append(ev)
    for ds in datasets:
        if ds.skipped:
            print(
                f"data.overlong_prompt=skip: skipped {len(ds.skipped)} of {len(ds.skipped) + len(ds.rows)} prompts "
                f"longer than data.max_prompt_len={c.data.max_prompt_len} tokens (first: {ds.skipped[0]})",
                file=sys.stderr,
            )
    longest = max((ds.longest for ds in datasets if ds.longest), default=(0, ""))
    return Task(
        train,
        eval_prompts,
        tuple(tok.stop_ids),
        tok.vocab_size,
        tok.decode,
        lambda ids: tok.decode(ids, skip_special_tokens=False),
        longest_prompt=longest,
    )
