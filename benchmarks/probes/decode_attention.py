"""Where a decode step of the 40M benchmark model goes beyond the bare forward: milliseconds (JSON).

    python -m benchmarks.probes.decode_attention [--batches 16,64] [--context 176]

Per batch, fp32, random weights (benchmarks/common.py's CONFIG_40M), each the best of 5 after a
compile: `forward_floor_ms` (one jitted token, no KV cache: engine.py's floor), `decode_step_ms`
(the engine's decode program, every slot in place, 8 steps a call, per step, cache of `context`
positions), `attention_ms` (the model's `_decode_attention` over that cache, all layers) and the
q.k product alone in other formulations (`qk_*_ms`, all layers; the model keeps keys [B, K, D, S]).
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from april_jax.models import qwen3
from april_jax.models.qwen3 import KVCache
from april_jax.rollout import engine_steps
from benchmarks.common import CONFIG_40M, timed

QK_FORMS = {  # q [B, K, G, D]; keys [B, K, D, S] ("kds") or [B, K, S, D] ("ksd")
    "qk_einsum_kds": ("kds", lambda q, k: jnp.einsum("bkgd,bkds->bkgs", q, k, preferred_element_type=jnp.float32)),
    "qk_einsum_ksd": ("ksd", lambda q, k: jnp.einsum("bkgd,bksd->bkgs", q, k, preferred_element_type=jnp.float32)),
    "qk_flat_matmul": ("kds", lambda q, k: jnp.matmul(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]))),
    "qk_multiply_reduce_d": ("ksd", lambda q, k: jnp.sum(k[:, :, None] * q[:, :, :, None, :], axis=-1)),
}


def ms(fn, *args) -> float:
    return round(1e3 * timed(fn, *args, repeats=5)[0], 2)


def measure(B: int, S: int, steps: int, graphdef, state, programs, rng) -> dict:
    """One batch size's figures (the module docstring lists them)."""
    cfg = CONFIG_40M
    K, G, D, L = (
        cfg.num_key_value_heads,
        cfg.num_attention_heads // cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.num_hidden_layers,
    )
    row = {"batch": B, "context": S}
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    row["forward_floor_ms"] = ms(forward, state, jnp.zeros((B, 1), jnp.int32))

    z = np.zeros(B, np.int32)
    box = [KVCache.zeros(cfg, B, S, jnp.float32)]

    def decode_call():  # 8 steps from 40 cached positions; the donated cache comes back each call
        box[0], tokens, *_ = programs.decode(
            state,
            box[0]._replace(lengths_B=jnp.full(B, 40, jnp.int32)),
            jnp.zeros(B, jnp.int32),
            np.arange(B, dtype=np.int32),
            np.ones(B, bool),
            z.astype(np.float32),
            np.ones(B, np.float32),
            z,
            z,
            z,
            np.full(B, 1000, np.int32),
            np.full((B, 1), -1, np.int32),
            np.int32(steps),
            mode="greedy",
            num_positions=S,
            steps_per_call=steps,
            in_place=True,
        )
        return tokens

    row["decode_step_ms"] = round(ms(decode_call) / steps, 2)

    q = jnp.asarray(rng.randn(B, K, G, D), jnp.float32)
    keys = {"kds": jnp.asarray(rng.randn(L, B, K, D, S), jnp.float32)}
    keys["ksd"] = jnp.swapaxes(keys["kds"], -1, -2)
    values = jnp.asarray(rng.randn(L, B, K, S, D), jnp.float32)
    valid = jnp.ones((B, S), bool)
    attention = jax.jit(
        lambda q, ks, vs: [qwen3._decode_attention(q[:, None], ks[i], vs[i], valid, jnp.float32) for i in range(L)]
    )
    row["attention_ms"] = ms(attention, q, keys["kds"], values)
    for name, (layout, form) in QK_FORMS.items():
        row[f"{name}_ms"] = ms(jax.jit(lambda q, ks, form=form: [form(q, ks[i]) for i in range(L)]), q, keys[layout])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--context", type=int, default=176)
    args = ap.parse_args()
    cfg, S, steps = CONFIG_40M, args.context, 8
    model = qwen3.init_model(cfg, seed=0)
    graphdef, state = nnx.split(model)
    programs = engine_steps.compiled(graphdef)
    K, G, D, L = (
        cfg.num_key_value_heads,
        cfg.num_attention_heads // cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.num_hidden_layers,
    )
    rng = np.random.RandomState(0)
    rows = [measure(B, S, steps, graphdef, state, programs, rng) for B in map(int, args.batches.split(","))]
    print(
        json.dumps(
            {
                "benchmark": "decode_attention",
                "params_m": round(cfg.num_params / 1e6, 1),
                "layers": L,
                "kv_heads": K,
                "group": G,
                "head_dim": D,
                "results": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
