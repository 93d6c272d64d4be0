"""APRIL's settings (`RolloutConfig`): each field is the config key `rollout.<field>`, declared
here beside the code that reads it (rollout/april.py), with its default, bounds and doc."""

from __future__ import annotations

import dataclasses

from april_jax.config.schema import check_fields, internal, key


@dataclasses.dataclass
class RolloutConfig:
    """APRIL's settings; each field but stop_token_ids is the config key `rollout.<field>`."""

    rollout_batch_size: int = key(32, "prompt groups delivered to each train step", gt=0)
    n_samples_per_prompt: int = key(8, "responses per prompt (the GRPO group size)", gt=0)
    over_sampling_batch_size: int = key(
        64,
        "prompt groups kept in flight; = rollout_batch_size (with partial_rollout=false): the synchronous baseline",
        gt=0,
    )
    partial_rollout: bool = key(
        True, "keep aborted groups in the buffer and resume them next step (APRIL); false: discard them"
    )
    max_response_len: int = key(
        1024, "generation budget per response, in tokens (a resumed response counts what it already generated)", gt=0
    )
    max_staleness: int = key(
        4,
        "policy versions a buffered token may lag (4: a response spans at most 5); older ones are restarted/dropped "
        "(stale_policy) and masked in the loss",
        ge=0,
    )
    stale_policy: str = key(
        "restart",
        "a buffered member past max_staleness: regenerate it from the prompt, or drop its whole group",
        choices=("restart", "drop_group"),
    )
    dynamic_sampling: bool = key(
        False, "DAPO dynamic sampling: drop groups whose rewards are all equal (zero advantage) and draw more prompts"
    )
    schedule: str = key(
        "fifo",
        "submission order of buffered groups: as they came, or shortest remaining first "
        "(by the prompt's past response lengths)",
        choices=("fifo", "short_first"),
    )
    # "groups": delivered + in-flight groups, a resumed group by `resume_count`; the engine drains
    # as members finish and refills only when a group is dropped (the paper's). "members":
    # unfinished requests / n_samples_per_prompt, refilled as members finish.
    refill: str = key(
        "members",
        "how the in-flight budget is counted: by groups (the paper's: refilled when a "
        "group is dropped) or by unfinished members (refilled as they finish)",
        choices=("groups", "members"),
    )
    resume_count: str = key(
        "fraction",
        "a resumed group with k of n members unfinished counts k/n of the budget, or 1 ('group', as slime)",
        choices=("fraction", "group"),
    )
    # "auto" also caps the in-flight requests so that a max_response_len response finishes within
    # its cap (a response advances one token per decode step: R requests in flight make a step of
    # D delivered tokens last D / R decode steps, so R <= steps x D / max_response_len, D measured,
    # steps = max_staleness + 1 - the fraction of the step gone when it starts; no fresh start past
    # late_start_cutoff) and, on an engine that reports its KV budget
    # (`kv_budget_tokens`, the simulated replicas), so that their contexts fit it.
    inflight: str = key(
        "auto",
        "requests in flight: over_sampling_batch_size x n_samples_per_prompt, or "
        "'auto': also as few as let a full-length response finish within "
        "its staleness cap (and fit the KV budget)",
        choices=("over_sampling", "auto"),
    )
    # A response must finish within max_staleness + 1 steps counted from the step it starts in, so a
    # fresh group started late in a step has nearly a step less than one started at its start.
    late_start_cutoff: float = key(
        0.7,
        "inflight='auto': no fresh group starts once this fraction of the step's "
        "groups is delivered (a later start has fewer steps before the staleness "
        "cap); 1: no cutoff",
        gt=0,
        le=1,
    )
    # The staleness cap throws away a whole group when its longest member misses it by a little (its
    # finished members too); these two let the nearly-late ones through. The wait is counted in the
    # engine's decode steps, not seconds, so that a seeded run stays deterministic on a real engine.
    finish_wait: float = key(
        1.0,
        "inflight='auto': once the step's groups are delivered, keep generating (no fresh "
        "start) for up to this many mean steps' worth of decode steps while a response that would pass "
        "max_staleness at the next step is in flight; a group finished then takes the "
        "place of the freshest delivered one, which waits in the buffer; 0: off",
        ge=0,
        finite=True,
    )
    inflight_headroom: float = key(
        0.75,
        "inflight='auto': steps of time added to the staleness sizing of the "
        "requests in flight (more in flight, more responses finished late, which "
        "finish_wait saves)",
        ge=0,
        finite=True,
    )
    buffer_capacity: int = key(1024, "most groups the partial buffer holds; the oldest are evicted beyond it", gt=0)
    temperature: float = key(
        1.0, "sampling temperature (0: greedy); the loss's logprobs use the same one", ge=0, finite=True
    )
    top_p: float = key(1.0, "nucleus sampling: keep the smallest token set with this much probability", gt=0, le=1)
    top_k: int = key(0, "sample among the k most likely tokens; 0: all", ge=0)
    stop_token_ids: tuple[int, ...] = internal((), "token ids that end a response (from the task's tokenizer)")

    def validate(self) -> RolloutConfig:
        check_fields(self, "rollout")
        if self.over_sampling_batch_size < self.rollout_batch_size:
            raise ValueError(
                f"rollout.over_sampling_batch_size={self.over_sampling_batch_size}: must be >= "
                f"rollout.rollout_batch_size={self.rollout_batch_size}"
            )
        return self

    @property
    def waits_to_finish(self) -> bool:
        """finish_wait acts (and APRIL keeps its step-time clock) only here."""
        return self.inflight == "auto" and self.partial_rollout and self.finish_wait > 0
