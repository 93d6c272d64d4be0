"""Requests and results that cross the engine interface (shared by the JAX, vLLM and sim engines)."""

from __future__ import annotations

import dataclasses
from typing import Literal

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

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def validate(self, max_model_len: int) -> str | None:
        """None when the request can run, else a one-line reason naming it."""
        if len(self.prompt_ids) == 0:
            return f"request {self.request_id!r}: empty prompt"
        if len(self.prompt_ids) >= max_model_len:
            return (f"request {self.request_id!r}: prompt of {len(self.prompt_ids)} tokens leaves no room "
                    f"within max_model_len={max_model_len}")
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
