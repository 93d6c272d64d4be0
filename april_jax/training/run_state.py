"""The run's position, written as each checkpoint's meta and read back on resume.

The meta holds the steps done, the policy version, the skipped steps, the data position, the
engine's RNG and the reward failure counts, APRIL's state (its partial buffer: the large part),
on a stop signal's checkpoint the KV rows the engine holds (rollout/held_kv.py), and the config
and model config a resume is checked against (runtime/checkpoints.py reads it).
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable


class RunState:
    def __init__(self, c, trainer, april, prompts, reward):
        self.c, self.trainer, self.april, self.prompts, self.reward = c, trainer, april, prompts, reward
        self.step = 0  # steps done
        self.version = 0  # the policy version the engine generates with
        self.engine = None  # process 0's engine, once built (None elsewhere)
        self.engine_rng = None  # the engine's RNG state read back on resume, for the engine once built
        self.engine_kv = None  # the KV rows it held, saved by a stop signal's checkpoint

    def meta(self, done_steps: int, with_april: bool = True) -> dict:
        """The checkpoint meta after `done_steps` steps (APRIL's state None unless `with_april`)."""
        rng = {
            "engine": self.engine.rng_state() if self.engine is not None else None,  # None: not process 0
            "reward_failures": self.reward.failures,
            "reward_timeouts": self.reward.timeouts,
        }
        return {
            "step": done_steps,
            "version": self.version,
            "skipped_steps": self.trainer.skipped_steps,
            "data": self.prompts.state_dict(),
            "rng": rng,
            "april": self.april.state_dict() if with_april else None,
            "config": json.loads(self.c.to_json()),
            "model_config": self.trainer.model_cfg.to_hf_config(),
            "lora": self.trainer.lora_meta(),
        }

    def later(self, done_steps: int) -> Callable[[], dict]:
        """meta(done_steps) for a stop signal's save, should one come: all but APRIL's state now;
        APRIL's (the large part: the partial buffer's tokens) as a cheap copy, made a dict only if asked."""
        meta, frozen = self.meta(done_steps, with_april=False), frozen_copy(self.april)
        # the KV of the responses the engine holds now, as the uninterrupted run resumes them
        # (scheduled checkpoints release it instead: train.py)
        held = self.engine.held_kv_snapshot() if hasattr(self.engine, "held_kv_snapshot") else None

        def signal_meta() -> dict:
            from april_jax.rollout import held_kv

            extra = {"engine_kv": held_kv.to_json(held)} if held else {}
            return dict(meta, april=frozen.state_dict(), **extra)

        return signal_meta

    def restore(self, meta: dict) -> None:
        """Continue from a checkpoint's meta (the params and optimiser state are restored apart)."""
        self.trainer.skipped_steps = meta["skipped_steps"]
        self.step, self.version = meta["step"], meta["version"]
        rng = meta.get("rng", {})
        self.prompts.load_state_dict(meta["data"])
        self.april.load_state_dict(meta["april"])
        self.reward.failures = int(rng.get("reward_failures", 0))
        self.reward.timeouts = int(rng.get("reward_timeouts", 0))
        self.engine_rng = rng.get("engine")
        self.engine_kv = meta.get("engine_kv")

    def attach_engine(self, engine) -> None:
        """Process 0's engine: it continues from the restored RNG state, and saves its own from now on."""
        self.engine = engine
        engine.set_rng_state(self.engine_rng)
        if self.engine_kv and hasattr(engine, "restore_held_kv"):
            problem = engine.restore_held_kv(self.engine_kv)
            if problem:
                print(f"warning: {problem}; the responses it held re-prefill", file=sys.stderr)
        self.engine_kv = None


def frozen_copy(april):
    """A copy of `april` whose state_dict() the next rollout cannot change: its containers, the
    buffered groups and their samples' lists copied one level deep (APRIL's state_dict() walks every
    token: seconds per step for a large buffer; the copy is a few C-level list copies)."""
    from april_jax.rollout.buffer import PartialBuffer

    def shallow(obj):
        out = copy.copy(obj)
        for name, value in vars(obj).items():
            if isinstance(value, (list, dict)):
                setattr(out, name, type(value)(value))
        return out

    clone, clone.buffer = shallow(april), PartialBuffer(april.buffer.capacity)
    for g in april.buffer.groups():
        group = copy.copy(g)
        group.samples = [shallow(s) for s in g.samples]
        clone.buffer.put(group)
    return clone
