"""The roofline cost model against figures worked out by hand from the public specs."""

import dataclasses

import pytest

from april_jax.models import qwen3
from april_jax.rollout import cost_model as cm

# Qwen3-4B by hand: tied 151936 x 2560 embedding; per layer q/o 2560x4096, k/v 2560x1024,
# MLP 3 x 2560x9728, four norms (2 x 2560 + 2 x 128); a final norm.
QWEN3_4B_PARAMS = 151936 * 2560 + 36 * (2 * 2560 * 4096 + 2 * 2560 * 1024 + 3 * 2560 * 9728 + 2 * 2560 + 2 * 128) + 2560


@pytest.mark.parametrize("name", ["qwen3-4b", "qwen3-8b"])
def test_model_shapes_are_the_hf_config_values(name):
    shape, preset = cm.MODELS[name], qwen3.PRESETS[name]
    for field in dataclasses.fields(shape):
        assert getattr(shape, field.name) == getattr(preset, field.name), field.name


def test_parameter_counts():
    assert QWEN3_4B_PARAMS == 4_022_468_096
    assert cm.make("h200-qwen3-4b").params == QWEN3_4B_PARAMS
    assert 8.15e9 < cm.make("h200-qwen3-8b").params < 8.25e9  # the model card's 8.2B


def test_kv_bytes_and_budget():
    h200 = cm.make("h200-qwen3-4b")
    assert h200.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2 == 147_456
    assert h200.kv_budget_bytes == pytest.approx(0.9 * 141e9 - 2 * QWEN3_4B_PARAMS - 2e9)  # 116.86 GB
    assert h200.kv_budget_tokens == int((0.9 * 141e9 - 2 * QWEN3_4B_PARAMS - 2e9) // 147_456) == 792_474
    h100 = cm.make("h100-qwen3-4b")
    assert h100.kv_budget_bytes == pytest.approx(0.9 * 80e9 - 2 * QWEN3_4B_PARAMS - 2e9)  # 61.96 GB


def test_decode_step_at_batch_16_and_context_4096():
    cost = cm.make("h200-qwen3-4b")
    busy, ctx = 16, 16 * 4096
    mem_s = (2 * QWEN3_4B_PARAMS + ctx * 147_456) / (4.8e12 * 0.85)  # 17.7 GB at 4.08 TB/s: 4.340 ms
    flops_s = (2 * QWEN3_4B_PARAMS * busy + 4 * 36 * 32 * 128 * ctx) / (989e12 * 0.5)  # 0.339 ms
    assert mem_s > flops_s
    assert cost.decode_step_s(busy, ctx) == pytest.approx(1e-3 + mem_s)
    assert cost.decode_step_s(busy, ctx) == pytest.approx(5.340e-3, rel=1e-3)


def test_prefill_of_1000_tokens_with_and_without_cached_prefix():
    cost = cm.make("h200-qwen3-4b")
    attn = 4 * 36 * 32 * 128
    assert cost.prefill_s(1000) == pytest.approx((2 * QWEN3_4B_PARAMS * 1000 + attn * 1000 * 1001 / 2) / 494.5e12)
    assert cost.prefill_s(1000, cached=500) == pytest.approx(
        (2 * QWEN3_4B_PARAMS * 1000 + attn * (1000 * 500 + 1000 * 1001 / 2)) / 494.5e12
    )
    assert cost.prefill_s(1000) == pytest.approx(16.87e-3, rel=1e-3)  # 8.04 + 0.30 TFLOP at 494.5 TFLOP/s


@pytest.mark.parametrize("peak", [989e12, 2e12])  # memory-bound; compute-bound crossing mid-span
def test_decode_span_is_the_sum_of_its_steps(peak):
    cost = dataclasses.replace(cm.make("h100-qwen3-4b"), peak_flops=peak)
    busy, ctx0, steps = 24, 50_000, 700
    by_step = sum(cost.decode_step_s(busy, ctx0 + busy * j) for j in range(steps))
    assert cost.decode_span_s(busy, ctx0, steps) == pytest.approx(by_step, rel=1e-9)


def test_span_of_max_lines_crossing():
    assert cm.span_of_max_lines(5, 0.0, 2.0, 5.0, 0.0) == sum(max(2.0 * j, 5.0) for j in range(5))
    assert cm.span_of_max_lines(5, 5.0, 0.0, 0.0, 2.0) == sum(max(2.0 * j, 5.0) for j in range(5))


def test_weight_sync_and_abort():
    cost = cm.make("h200-qwen3-8b")
    assert cost.weight_sync_s() == pytest.approx(2 * cost.params / 450e9)
    assert cost.abort_s(0) == 0.0 and cost.abort_s(100) == pytest.approx(1e-3 + 100 * 20e-6)


def test_train_step_and_colocated_sleep_by_hand():
    """A million trained tokens on 8 H200s at MFU 0.35: 6 x 4.022e9 x 1e6 / (8 x 989e12 x 0.35) = 8.715 s;
    sleep and wake move 8.045 GB of bf16 weights over PCIe 5.0 x16 (64 GB/s) twice: 0.2514 s."""
    cost = cm.make("h200-qwen3-4b")
    assert cost.train_step_s(10**6, gpus=8) == pytest.approx(6 * QWEN3_4B_PARAMS * 1e6 / (8 * 989e12 * 0.35))
    assert cost.train_step_s(10**6, gpus=8) == pytest.approx(8.715, rel=1e-3)
    assert cost.train_step_s(10**6, gpus=16) == pytest.approx(cost.train_step_s(10**6, gpus=8) / 2)
    assert cost.sleep_wake_s() == pytest.approx(2 * 2 * QWEN3_4B_PARAMS / 64e9)
    assert cost.sleep_wake_s() == pytest.approx(0.2514, rel=1e-3)
    assert cm.make("h200-qwen3-4b", train_mfu=0.5).train_step_s(10**6, 8) == pytest.approx(8.715 * 0.35 / 0.5, rel=1e-3)
    cpu = cm.make("cpu-jax")  # not modelled there: its end-to-end figures are rollout-only
    assert cpu.train_step_s(10**6, 1) == 0.0 and cpu.sleep_wake_s() == 0.0


def test_cpu_model_is_the_old_linear_one():
    cost = cm.make("cpu-jax", slots=256)
    assert cost.decode_step_s(7, 10**6) == pytest.approx(0.010 + 0.00094 * 256)
    assert cost.prefill_s(100) == pytest.approx(0.073)


def test_unknown_preset_names_itself():
    with pytest.raises(ValueError, match="--cost 'a100'"):
        cm.make("a100")


def test_lower_bound_takes_the_memory_budget_into_account():
    cost = cm.make("h200-qwen3-4b")
    few = cm.time_lower_bound_s(cost, tokens=1000, ctx_sum=1000 * 100, prompt_lens=[], slots=256, replicas=1)
    mem = 1000 / 256 * 2 * QWEN3_4B_PARAMS / 4.08e12 + 1000 * 100 * 147_456 / 4.08e12
    flops = (2 * QWEN3_4B_PARAMS * 1000 + 4 * 36 * 32 * 128 * 1000 * 100) / 494.5e12  # short contexts: compute-bound
    assert flops > mem and few == pytest.approx(1000 / 256 * 1e-3 + flops)
    # Long contexts: the budget, not the slots, caps the tokens per step.
    ctx = 1000 * 30_000
    long = cm.time_lower_bound_s(cost, tokens=1000, ctx_sum=ctx, prompt_lens=[], slots=256, replicas=1)
    steps = ctx / 792_474
    assert steps > 1000 / 256
    assert long == pytest.approx(steps * (1e-3 + 2 * QWEN3_4B_PARAMS / 4.08e12) + ctx * 147_456 / 4.08e12)


def windows_of(responses, steps):
    """StalenessWindows from (prompt_len, response_len, first_step, last_step) tuples."""
    import numpy as np

    ctx = [np.arange(n) + p for p, n, _, _ in responses]
    return cm.StalenessWindows(
        tokens=np.array([len(c) for c in ctx], float),
        sqrt_ctx=np.array([np.sqrt(c).sum() for c in ctx]),
        ctx=np.array([c.sum() for c in ctx], float),
        first=np.array([f for *_, f, _ in responses]),
        last=np.array([l for *_, l in responses]),
        steps=steps,
    )


def test_staleness_bound_for_one_long_response_sits_between_the_free_bound_and_its_own_decode_time():
    """One 32k response, alone on one replica: its 32768 steps run one after another, each costing at
    least the overhead + weights read + its own context; the free bound splits it into ~1000 steps
    of a full KV budget instead. The windowed bound must lie between the two (and well above the free one)."""
    cost = cm.make("h200-qwen3-4b")
    n, p = 32768, 64
    ctx = cm.delivered_ctx_sum(p, n)
    c0 = 1e-3 + 2 * QWEN3_4B_PARAMS / 4.08e12
    alone = n * c0 + ctx * 147_456 / 4.08e12  # 97.3 s + 19.5 s: what a schedule of this one response costs
    kw = dict(tokens=n, ctx_sum=ctx, prompt_lens=[], slots=256, replicas=1)
    free = cm.time_lower_bound_s(cost, **kw)
    bound = cm.time_lower_bound_s(cost, **kw, windows=windows_of([(p, n, 0, 0)], 1))
    assert free == pytest.approx(ctx / 792_474 * c0 + ctx * 147_456 / 4.08e12)  # 21.5 s
    assert 4 * free < bound <= alone
    # By Cauchy-Schwarz the bound is at least 8/9 of the overhead part (sum sqrt)^2 / sum <= n: 2/3 n^1.5 ...
    assert bound > 0.85 * alone


def test_staleness_bound_without_binding_windows_is_the_free_bound():
    """Short responses with windows spanning every step constrain nothing: the bound is the free one."""
    cost = cm.make("h200-qwen3-4b")
    responses = [(64, 300, 0, 9) for _ in range(2000)]
    tokens, ctx = 2000 * 300, 2000 * cm.delivered_ctx_sum(64, 300)
    kw = dict(tokens=tokens, ctx_sum=ctx, prompt_lens=[64] * 250, slots=256, replicas=8, syncs=10)
    free = cm.time_lower_bound_s(cost, **kw)
    assert cm.time_lower_bound_s(cost, **kw, windows=windows_of(responses, 10)) == pytest.approx(free, rel=1e-6)


def test_staleness_bound_tightens_as_windows_shrink():
    cost = cm.make("h200-qwen3-4b")
    rows = [(64, 1000 + 997 * i % 31000, 0, 0) for i in range(64)]
    tokens = sum(n for _, n, _, _ in rows)
    ctx = sum(cm.delivered_ctx_sum(p, n) for p, n, _, _ in rows)
    kw = dict(tokens=tokens, ctx_sum=ctx, prompt_lens=[], slots=256, replicas=2)
    bounds = [
        cm.time_lower_bound_s(cost, **kw, windows=windows_of([(p, n, 0, k - 1) for p, n, _, _ in rows], k))
        for k in (1, 2, 4)
    ]
    # one step holding every response is the tightest; windows of 4 of 4 steps the same as 1 of 1
    # in total time, since the steps can be as long as they like: only their total matters then
    assert bounds[0] == pytest.approx(bounds[1], rel=1e-3) == pytest.approx(bounds[2], rel=1e-3)
    staggered = cm.time_lower_bound_s(
        cost, **kw, windows=windows_of([(p, n, i % 4, i % 4) for i, (p, n, _, _) in enumerate(rows)], 4)
    )
    assert staggered > bounds[0] * 1.01  # each response confined to one of four steps: less room


def test_a_device_roofline_at_tensor_parallel_1_is_the_preset():
    preset, device = cm.make("h200-qwen3-4b"), cm.for_device("H200", "qwen3-4b")
    for busy, ctx, steps in ((16, 16 * 4096, 1), (300, 300 * 9000, 57)):
        assert device.decode_span_s(busy, ctx, steps) == preset.decode_span_s(busy, ctx, steps)
    assert device.prefill_s(1000, 64) == preset.prefill_s(1000, 64)
    assert device.kv_budget_tokens == preset.kv_budget_tokens == 792_474
    assert (device.weight_sync_s(), device.sleep_wake_s()) == (preset.weight_sync_s(), preset.sleep_wake_s())


def test_tensor_parallel_2_by_hand():
    """Two H200s per replica: twice the bandwidth and FLOPs, two all-reduces a layer (72), each
    10 us + a ring's 2 x (2 - 1) / 2 x 2560 x 2 bytes a token over 450 GB/s; the weights, the KV
    and a sleep or sync split over the two GPUs."""
    tp2 = cm.for_device("H200", "qwen3-4b", tensor_parallel=2)
    busy, ctx = 16, 16 * 4096
    mem_s = (2 * QWEN3_4B_PARAMS + ctx * 147_456) / (2 * 4.8e12 * 0.85)
    comm_s = 72 * 10e-6 + 72 * busy * 2560 * 2 / 450e9
    assert tp2.decode_step_s(busy, ctx) == pytest.approx(1e-3 + comm_s + mem_s)
    attn = 4 * 36 * 32 * 128
    assert tp2.prefill_s(1000) == pytest.approx(
        (2 * QWEN3_4B_PARAMS * 1000 + attn * 1000 * 1001 / 2) / (2 * 494.5e12) + 72 * 1000 * 2560 * 2 / 450e9
    )
    assert tp2.kv_budget_bytes == pytest.approx(2 * (0.9 * 141e9 - 2e9) - 2 * QWEN3_4B_PARAMS)
    assert tp2.weight_sync_s() == pytest.approx(QWEN3_4B_PARAMS / 450e9)
    assert tp2.sleep_wake_s() == pytest.approx(2 * QWEN3_4B_PARAMS / 64e9)
    assert tp2.train_step_s(10**6, 8) == cm.make("h200-qwen3-4b").train_step_s(10**6, 8)  # per GPU, unchanged
    # the free bound pays the same per-token all-reduce bytes and per-step latency
    few = cm.time_lower_bound_s(tp2, tokens=1000, ctx_sum=1000 * 100, prompt_lens=[], slots=256, replicas=1)
    flops = (2 * QWEN3_4B_PARAMS * 1000 + attn * 1000 * 100) / (2 * 494.5e12)
    assert few == pytest.approx(1000 / 256 * (1e-3 + 72 * 10e-6) + 1000 * 72 * 2560 * 2 / 450e9 + flops)


def test_a_plan_sets_the_kv_budget_and_mi300x_has_its_datasheet_figures():
    planned = cm.for_device("H200", "qwen3-4b", kv_tokens=719_573)
    assert planned.kv_budget_tokens == 719_573 and planned.kv_budget_bytes == 719_573 * 147_456
    mi = cm.for_device("MI300X", "qwen3-8b")
    assert (mi.hbm_bytes, mi.hbm_bw, mi.peak_flops) == (192e9, 5.3e12, 1307e12)
    with pytest.raises(ValueError, match="'A100'"):
        cm.for_device("A100", "qwen3-4b")
