"""Requests and results that cross the engine interface (shared by the JAX, vLLM and sim engines)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from april_jax.data.types import PromptRecord

__all__ = ["FinishReason", "SamplingParams", "Request", "Result", "SampleStatus", "PromptRecord", "Sample", "Group"]

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 switch truncation off; seed None draws one."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclasses.dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    # Stable identity of the response across resumed segments (APRIL sets "group/index/attempt");
    # real engines ignore it, the simulated engine draws the response length from it.
    sample_key: str | None = None
    # The first this-many prompt tokens are a prompt other requests share (a group's prompt, when
    # a member resumes from prompt + partial response); the JAX engine prefills them once for all
    # of them. 0: the whole prompt is the shared part. Other engines ignore it.
    shared_prefix_len: int = 0

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(map(int, self.prompt_ids)))  # map: ~3x the genexpr on long resumes
        object.__setattr__(self, "stop_token_ids", tuple(map(int, self.stop_token_ids)))

    def validate(self, max_model_len: int) -> str | None:
        """None when the request can run, else a one-line reason naming it."""
        if len(self.prompt_ids) == 0:
            return f"request {self.request_id!r}: empty prompt"
        if len(self.prompt_ids) >= max_model_len:
            return (
                f"request {self.request_id!r}: prompt of {len(self.prompt_ids)} tokens leaves no room "
                f"within max_model_len={max_model_len}"
            )
        if self.max_new_tokens <= 0:
            return f"request {self.request_id!r}: max_new_tokens must be > 0, got {self.max_new_tokens}"
        s = self.sampling
        if s.temperature < 0 or not 0.0 < s.top_p <= 1.0 or s.top_k < 0:
            return f"request {self.request_id!r}: bad sampling params {s}"
        return None


@dataclasses.dataclass
class Result:
    """What an engine hands back for a request: everything generated so far and why it ended."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]  # behaviour logprob of each token, under the distribution it was drawn from
    versions: list[int]  # policy version that generated each token
    finish_reason: FinishReason
    error: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)


SampleStatus = Literal["pending", "running", "completed", "truncated", "aborted"]


@dataclasses.dataclass
class Sample:
    prompt_ids: list[int]
    group_id: str
    index: int
    response_ids: list[int] = dataclasses.field(default_factory=list)
    response_logprobs: list[float] = dataclasses.field(default_factory=list)  # behaviour, per token
    response_versions: list[int] = dataclasses.field(default_factory=list)  # policy version per token
    status: SampleStatus = "pending"
    finish_reason: str | None = None
    reward: float | None = None
    attempt: int = 0  # bumped when a stale sample restarts from the prompt
    segments: int = 0  # engine requests this response took (1 = never resumed)
    metadata: dict = dataclasses.field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "truncated")

    def staleness(self, current_version: int) -> int:
        return current_version - min(self.response_versions) if self.response_versions else 0

    def reset(self) -> int:
        """Back to the prompt (a stale restart); returns the number of tokens thrown away."""
        dropped = len(self.response_ids)
        self.response_ids, self.response_logprobs, self.response_versions = [], [], []
        self.status, self.finish_reason, self.reward = "pending", None, None
        self.attempt += 1
        return dropped


@dataclasses.dataclass
class Group:
    group_id: str
    prompt: PromptRecord
    samples: list[Sample]

    @property
    def complete(self) -> bool:
        return all(s.finished for s in self.samples)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Group:
        return cls(d["group_id"], PromptRecord(**d["prompt"]), [Sample(**s) for s in d["samples"]])
