"""What a run trains on: the prompts, how responses are scored and decoded, and (for tasks that
have them) supervised warm-up examples. `build_task(c)` makes the `Task` for `data.task`."""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Callable, Iterator

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


def build_task(c, model_path: str | None) -> Task:
    """The Task of `data.task`. Fails (ConfigError) on `warmup.steps > 0` for a task without warm-up data."""
    from april_jax.rl.rewards import RewardModel

    task = _reverse_task(c) if c.data.task == "reverse" else _file_task(c, model_path)
    if c.warmup.steps and task.warmup_examples is None:
        raise ConfigError(f"config key 'warmup.steps'={c.warmup.steps}: data.task={c.data.task!r} has no supervised "
                          "warm-up examples (set warmup.steps=0)")
    # last: it starts the scoring processes
    task.reward = (RewardModel("reverse") if c.data.task == "reverse" else
                   RewardModel(c.reward.fn, timeout_s=c.reward.timeout_s, workers=c.reward.workers))
    return task


def _reverse_task(c) -> Task:
    from april_jax.data import reverse

    try:
        buckets = reverse.parse_lengths(c.data.reverse_lengths)
    except ValueError as e:
        raise ConfigError(f"config key 'data.reverse_lengths'={c.data.reverse_lengths!r}: {e}") from None
    longest_prompt = len(reverse.encode_prompt([0] * max(hi for _, _, hi in buckets)))
    if longest_prompt > c.data.max_prompt_len:
        raise ConfigError(f"config key 'data.reverse_lengths'={c.data.reverse_lengths!r}: prompts of up to "
                          f"{longest_prompt} tokens, over data.max_prompt_len={c.data.max_prompt_len}")
    return Task(reverse.ReverseTask(c.seed, "train", buckets),
                reverse.ReverseTask(c.seed, "eval", buckets).take(c.eval.num_prompts),
                (reverse.EOS,), reverse.VOCAB_SIZE, reverse.decode, reverse.decode,
                warmup_examples=functools.partial(reverse.sft_examples, reverse_frac=c.warmup.reverse_frac,
                                                  buckets=buckets))


def _file_task(c, model_path: str | None) -> Task:
    from april_jax.data.dataset import PromptDataset, read_rows
    from april_jax.data.tokenizer import load_tokenizer

    tok = load_tokenizer(c.data.tokenizer_path or model_path, system_prompt=c.data.system_prompt,
                         chat=c.data.chat_template, template_kwargs=config_lib.chat_template_kwargs(c))
    lengths = dict(max_prompt_len=c.data.max_prompt_len, overlong=c.data.overlong_prompt)
    train = PromptDataset(read_rows(c.data.train_path, c.data.prompt_key, c.data.answer_key), tok.encode_prompt,
                          seed=c.seed, shuffle=c.data.shuffle, **lengths)
    datasets = [train]
    eval_prompts = []
    if c.data.eval_path:
        ev = PromptDataset(read_rows(c.data.eval_path, c.data.prompt_key, c.data.answer_key), tok.encode_prompt,
                           shuffle=False, **lengths)
        eval_prompts = [next(ev) for _ in range(min(c.eval.num_prompts, len(ev.rows)))]
        datasets.append(ev)
    for ds in datasets:
        if ds.skipped:
            print(f"data.overlong_prompt=skip: skipped {len(ds.skipped)} of {len(ds.skipped) + len(ds.rows)} prompts "
                  f"longer than data.max_prompt_len={c.data.max_prompt_len} tokens (first: {ds.skipped[0]})",
                  file=sys.stderr)
    if not tok.template and any(not isinstance(r[0], str) for r in train.rows):
        raise ConfigError(f"{c.data.train_path}: prompts are chat messages but no chat template is used "
                          "(data.chat_template=false or the tokenizer has none)")
    return Task(train, eval_prompts, tuple(tok.stop_ids), tok.vocab_size, tok.decode,
                lambda ids: tok.decode(ids, skip_special_tokens=False))
