"""Cost models for the simulated engine: a roofline model of one GPU replica, and the CPU model.

Roofline (`Roofline`, one engine replica on one GPU, bf16 weights and KV):
    decode step   t = step_overhead + max(bytes / (bw * bw_eff), flops / (peak * flops_eff))
                  bytes = weight bytes + sum over busy slots of context x KV bytes per token
                  flops = 2 x matmul params x busy + 4 x layers x q_heads x head_dim x sum of contexts
    prefill       (2 x matmul params x new tokens + causal attention FLOPs) / (peak * flops_eff)
    KV budget     hbm * mem_util - weight bytes - activation reserve
    weight sync   weight bytes / sync_bw (every replica at once, in parallel)
    abort         one step_overhead per abort call + abort_per_request_s per request
    train step    6 x params x trained tokens / (GPUs x peak x train_mfu) (forward + backward)
    sleep / wake  colocated only: weight bytes to host and back over PCIe, once per train step

Tensor parallel t (one replica = one server over t GPUs, `tensor_parallel`): each GPU holds 1/t of
the weights and of every sequence's KV (vLLM splits the KV heads), so bandwidth and FLOPs are t
times one GPU's; a forward pass adds two all-reduces a layer (after attention and after the MLP,
Megatron-style as vLLM runs them), not overlapped with compute: each costs allreduce_latency_s
plus a ring's 2 (t - 1) / t x tokens x hidden x 2 bytes over link_bw. A decode step pays both
parts; a prefill the bytes part only (its latency is the same batched forward's, which the decode
step's fixed cost already pays). The logits gather of a vocabulary-parallel lm_head is left out
(tokens x vocabulary / t values a step, small beside the all-reduces). A weight sync and a sleep
move 1/t of the weights per GPU, in parallel; training is charged per GPU, unchanged. KV budget:
t x (hbm x mem_util - activation reserve) - weight bytes, or `kv_tokens` when given (what a
deployment plan leaves for KV, `april_jax/training/plan.py`).

Public figures (NVIDIA datasheets): H100 SXM 80 GB HBM3 at 3.35 TB/s; H200 SXM 141 GB HBM3e at
4.8 TB/s; both 989 TFLOP/s dense bf16 (1979 is with 2:4 sparsity) and NVLink 4 at 900 GB/s
(both directions together, so 450 GB/s one way). AMD Instinct MI300X datasheet: 192 GB HBM3 at
5.3 TB/s, 1307 TFLOP/s dense bf16, Infinity Fabric 896 GB/s aggregate peer bandwidth both ways
(448 one way), PCIe 5.0 x16 host link. GB here is 1e9 bytes, as the datasheets write.
Model shapes come from `april_jax.models.qwen3.PRESETS` (the official config.json values):
Qwen3-4B 36 layers, 32 query / 8 KV heads, head_dim 128, tied embeddings, 4.02B parameters;
Qwen3-8B 36 layers, 32 / 8 heads, head_dim 128, untied, 8.19B. KV per token = 2 (K and V) x
layers x KV heads x head_dim x 2 bytes = 147,456 bytes for both.

Assumptions (not public specs; stated so they can be argued with; the sweep varies the first):
    step_overhead 1 ms   scheduler + sampling + launches per decode step with CUDA graphs
    bw_eff 0.85          memory-bound kernels reach ~85% of peak HBM bandwidth
    flops_eff 0.5        prefill / compute-bound decode at 50% of dense bf16 peak
    mem_util 0.9         vLLM's default gpu_memory_utilization
    activation reserve 2 GB, abort 20 us per request
    allreduce_latency_s 10 us   one small-message all-reduce within a node (tensor parallel > 1 only;
                         NCCL's and vLLM's custom kernels take a few to ~20 us on NVLink: a middle value)
Weight sync at NVLink speed is a lower bound on a real sync (gathers, bucketing); both runs pay it.
    pcie_bw 64 GB/s      PCIe 5.0 x16, one way (32 GT/s x 16 lanes, 128b/130b: 63 GB/s), the H100 / H200
                         SXM host link; vLLM's sleep level 1 moves the weights to host memory and back
    train_mfu 0.35       training model FLOPs at 35% of the dense bf16 peak (346 TFLOP/s a GPU). Quoted:
                         NVIDIA NeMo Framework 24.12 performance summary, LLAMA3-8B pre-training on 8 x H100,
                         seq 8192: 711 model TFLOP/s a GPU in FP8, 0.36 of the FP8 dense peak (1979); the same
                         fraction of the bf16 peak is taken for a ~4B model trained in bf16 with full remat
                         (remat's recompute is not model FLOPs, so it lowers MFU: a conservative choice).
                         The RL step's extra forward (old logprobs) is inside that 6 x params x tokens figure's
                         margin, not charged apart; both runs train the same number of responses.

`LinearCPU` is the earlier CPU-calibrated model (the embedded JAX engine on the project's 2-core
machines, 40M model): a decode step costs t0 + c x busy, prefill p per token, no memory limit.
"""

from __future__ import annotations

import dataclasses
import math

GB = 1e9


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The config.json fields the cost depends on (tests check them against qwen3.PRESETS; kept
    here so the simulator does not import JAX)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool


MODELS = {
    "qwen3-4b": ModelShape(151936, 2560, 9728, 36, 32, 8, 128, True),
    "qwen3-8b": ModelShape(151936, 4096, 12288, 36, 32, 8, 128, False),
}


def matmul_params(cfg: ModelShape) -> tuple[int, int]:
    """(all parameters, parameters in matmuls per token): the input embedding is a lookup, so an
    untied model's matmuls skip it; a tied model's lm_head is the embedding matrix."""
    h, L, inter = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h + 2 * cfg.head_dim  # + norms
    embed = cfg.vocab_size * h
    total = L * per_layer + h + embed * (1 if cfg.tie_word_embeddings else 2)
    return total, total - (0 if cfg.tie_word_embeddings else embed)


def span_of_max_lines(n: int, a1: float, b1: float, a2: float, b2: float) -> float:
    """sum_{j=0}^{n-1} max(a1 + b1 j, a2 + b2 j), exactly (two lines cross at most once)."""
    if n <= 0:
        return 0.0
    line = lambda a, b, lo, hi: (hi - lo) * a + b * (hi * (hi - 1) - lo * (lo - 1)) / 2  # sum over j in [lo, hi)
    if b1 == b2:
        return line(max(a1, a2), b1, 0, n)
    cross = (a2 - a1) / (b1 - b2)  # line 1 >= line 2 for j >= cross when b1 > b2
    k = min(n, max(0, math.ceil(cross)))
    first, second = ((a2, b2), (a1, b1)) if b1 > b2 else ((a1, b1), (a2, b2))
    return line(*first, 0, k) + line(*second, k, n)


@dataclasses.dataclass(frozen=True)
class Roofline:
    name: str
    hbm_bytes: float  # one GPU's
    hbm_bw: float  # bytes/s, one GPU's
    peak_flops: float  # dense bf16, one GPU's
    model: str | ModelShape  # a key of MODELS (= qwen3.PRESETS), or the shape itself
    step_overhead_s: float = 1e-3
    bw_eff: float = 0.85
    flops_eff: float = 0.5
    mem_util: float = 0.9
    activation_reserve_bytes: float = 2 * GB
    sync_bw: float = 450 * GB
    abort_per_request_s: float = 20e-6
    dtype_bytes: int = 2
    pcie_bw: float = 64 * GB
    train_mfu: float = 0.35
    tensor_parallel: int = 1  # GPUs per replica
    kv_tokens: int | None = None  # the replica's KV budget in tokens, when a deployment plan sets it
    allreduce_latency_s: float = 10e-6
    link_bw: float = 450 * GB  # one way, per GPU: the tensor-parallel all-reduce's

    @property
    def cfg(self) -> ModelShape:
        return MODELS[self.model] if isinstance(self.model, str) else self.model

    @property
    def eff_bw(self) -> float:
        """The replica's achieved HBM bandwidth (all its GPUs)."""
        return self.hbm_bw * self.bw_eff * self.tensor_parallel

    @property
    def eff_flops(self) -> float:
        """The replica's achieved bf16 FLOP/s (all its GPUs)."""
        return self.peak_flops * self.flops_eff * self.tensor_parallel

    @property
    def comm_step_s(self) -> float:
        """Tensor parallel: the all-reduces' latency in one forward pass (0 on one GPU)."""
        t = self.tensor_parallel
        return 0.0 if t == 1 else 2 * self.cfg.num_hidden_layers * self.allreduce_latency_s

    @property
    def comm_token_s(self) -> float:
        """Tensor parallel: the all-reduces' bytes time per token of a forward pass (0 on one GPU)."""
        t, c = self.tensor_parallel, self.cfg
        ring = 2 * (t - 1) / t * c.hidden_size * self.dtype_bytes / self.link_bw
        return 2 * c.num_hidden_layers * ring

    @property
    def step_fixed_s(self) -> float:
        """What every decode step pays whatever its batch: overhead, all-reduce latency, the weights read."""
        return self.step_overhead_s + self.comm_step_s + matmul_params(self.cfg)[1] * self.dtype_bytes / self.eff_bw

    @property
    def params(self) -> int:
        return matmul_params(self.cfg)[0]

    @property
    def weight_bytes(self) -> float:
        return matmul_params(self.cfg)[0] * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.cfg
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * self.dtype_bytes

    @property
    def kv_budget_bytes(self) -> float:
        if self.kv_tokens is not None:
            return float(self.kv_tokens * self.kv_bytes_per_token)
        t = self.tensor_parallel
        return self.hbm_bytes * self.mem_util * t - self.weight_bytes - self.activation_reserve_bytes * t

    @property
    def kv_budget_tokens(self) -> int:
        if self.kv_tokens is not None:
            return int(self.kv_tokens)
        return int(self.kv_budget_bytes // self.kv_bytes_per_token)

    @property
    def _attn_flops_per_ctx(self) -> float:  # QK^T and PV, 2 FLOPs per multiply-add each
        c = self.cfg
        return 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim

    def _lines(self, busy: int, ctx0: int):
        """Per-step memory and compute time as lines in the step index j (contexts grow by busy per step)."""
        bw, fl = self.eff_bw, self.eff_flops
        mm = matmul_params(self.cfg)[1]
        kvb, att = self.kv_bytes_per_token, self._attn_flops_per_ctx
        mem = ((mm * self.dtype_bytes + ctx0 * kvb) / bw, busy * kvb / bw)
        comp = ((2 * mm * busy + att * ctx0) / fl, busy * att / fl)
        return mem, comp

    def decode_span_s(self, busy: int, ctx_sum: int, steps: int) -> float:
        """`steps` decode steps of `busy` slots whose contexts sum to `ctx_sum` at the first step."""
        if steps <= 0 or busy <= 0:
            return 0.0
        (a1, b1), (a2, b2) = self._lines(busy, ctx_sum)
        fixed = self.step_overhead_s + self.comm_step_s + self.comm_token_s * busy
        return steps * fixed + span_of_max_lines(steps, a1, b1, a2, b2)

    def decode_step_s(self, busy: int, ctx_sum: int) -> float:
        return self.decode_span_s(busy, ctx_sum, 1)

    def prefill_s(self, new_tokens: int, cached: int = 0) -> float:
        """Prefill of `new_tokens` after `cached` tokens already in KV (causal attention over both)."""
        if new_tokens <= 0:
            return 0.0
        mm = matmul_params(self.cfg)[1]
        positions = new_tokens * cached + new_tokens * (new_tokens + 1) / 2  # keys each new token attends to
        compute = (2 * mm * new_tokens + self._attn_flops_per_ctx * positions) / self.eff_flops
        return compute + self.comm_token_s * new_tokens

    def weight_sync_s(self) -> float:
        return self.weight_bytes / self.tensor_parallel / self.sync_bw

    def abort_s(self, n_requests: int) -> float:
        return self.step_overhead_s + self.abort_per_request_s * n_requests if n_requests else 0.0

    def sleep_wake_s(self) -> float:
        """A colocated engine around one train step: weights to host memory, then back (each GPU its
        shard over its own host link)."""
        return 2 * self.weight_bytes / self.tensor_parallel / self.pcie_bw

    def train_step_s(self, tokens: int, gpus: int) -> float:
        """One optimiser step over `tokens` (prompt + response) tokens on `gpus` GPUs."""
        return 6 * self.params * tokens / (gpus * self.peak_flops * self.train_mfu)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "pcie_bw": self.pcie_bw,
            "train_mfu": self.train_mfu,
            "model": self.model if isinstance(self.model, str) else dataclasses.asdict(self.model),
            "params": self.params,
            "weight_bytes": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_budget_bytes": self.kv_budget_bytes,
            "kv_budget_tokens": self.kv_budget_tokens,
            "hbm_bytes": self.hbm_bytes,
            "hbm_bw": self.hbm_bw,
            "peak_flops": self.peak_flops,
            "step_overhead_s": self.step_overhead_s,
            "bw_eff": self.bw_eff,
            "flops_eff": self.flops_eff,
            "mem_util": self.mem_util,
            "activation_reserve_bytes": self.activation_reserve_bytes,
            "sync_bw": self.sync_bw,
            "tensor_parallel": self.tensor_parallel,
            "kv_tokens": self.kv_tokens,
            "allreduce_latency_s": self.allreduce_latency_s,
            "link_bw": self.link_bw,
        }


@dataclasses.dataclass(frozen=True)
class LinearCPU:
    """decode step t0 + c * busy; prefill p per token; no memory limit; abort, weight sync, sleep and
    training free (not modelled: its end-to-end figures are rollout-only)."""

    t0: float
    c: float = 0.0
    p: float = 0.00073
    name: str = "cpu-jax"
    kv_bytes_per_token: int = 0
    kv_budget_tokens: float = math.inf
    kv_budget_bytes: float = math.inf

    @classmethod
    def for_slots(cls, slots: int, **kw) -> LinearCPU:
        # The embedded JAX engine computes every slot each step, busy or idle: flat in busy.
        return cls(t0=0.010 + 0.00094 * slots, **kw)

    def decode_span_s(self, busy: int, ctx_sum: int, steps: int) -> float:
        return steps * (self.t0 + self.c * busy) if busy > 0 and steps > 0 else 0.0

    def decode_step_s(self, busy: int, ctx_sum: int) -> float:
        return self.decode_span_s(busy, ctx_sum, 1)

    def prefill_s(self, new_tokens: int, cached: int = 0) -> float:
        return self.p * max(new_tokens, 0)

    def weight_sync_s(self) -> float:
        return 0.0

    def abort_s(self, n_requests: int) -> float:
        return 0.0

    def sleep_wake_s(self) -> float:
        return 0.0

    def train_step_s(self, tokens: int, gpus: int) -> float:
        return 0.0

    def describe(self) -> dict:
        return {"name": self.name, "t0": self.t0, "c": self.c, "p": self.p}


H100_SXM = dict(hbm_bytes=80 * GB, hbm_bw=3.35e12, peak_flops=989e12)
H200_SXM = dict(hbm_bytes=141 * GB, hbm_bw=4.8e12, peak_flops=989e12)
MI300X = dict(hbm_bytes=192 * GB, hbm_bw=5.3e12, peak_flops=1307e12, link_bw=448 * GB, sync_bw=448 * GB)
# a deployment plan's device name (`april_jax.training.devices`) -> its datasheet figures
DEVICES = {"H100": H100_SXM, "H200": H200_SXM, "MI300X": MI300X}
PRESETS = {
    "h200-qwen3-4b": dict(H200_SXM, model="qwen3-4b"),
    "h100-qwen3-4b": dict(H100_SXM, model="qwen3-4b"),
    "h200-qwen3-8b": dict(H200_SXM, model="qwen3-8b"),
}


def make(preset: str, slots: int = 256, **overrides):
    """A cost model by name: a roofline preset, or 'cpu-jax' (whose step time depends on `slots`)."""
    if preset == "cpu-jax":
        return LinearCPU.for_slots(slots, **overrides)
    if preset not in PRESETS:
        raise ValueError(f"--cost {preset!r}: unknown; choose from {', '.join(['cpu-jax', *PRESETS])}")
    return Roofline(name=preset, **PRESETS[preset], **overrides)


def for_device(device: str, model: str | ModelShape, *, name: str | None = None, **overrides) -> Roofline:
    """A roofline of one replica on `device` (a key of DEVICES); `overrides` set any other field
    (tensor_parallel, kv_tokens, hbm_bytes, step_overhead_s, ...)."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r}: no roofline figures; known: {', '.join(DEVICES)}")
    return Roofline(name=name or device.lower(), model=model, **{**DEVICES[device], **overrides})


def delivered_ctx_sum(prompt_len: int, response_len: int) -> int:
    """Sum of the contexts the decode steps of one response read: token i reads prompt + i."""
    return response_len * prompt_len + response_len * (response_len - 1) // 2


def time_lower_bound_s(
    cost,
    *,
    tokens: int,
    ctx_sum: int,
    prompt_lens: list[int],
    slots: int,
    replicas: int,
    syncs: int = 0,
    windows: StalenessWindows | None = None,
) -> float:
    """Least engine time in which `replicas` replicas can decode `tokens` tokens whose contexts sum to
    `ctx_sum`, prefill each prompt (one per group: `prompt_lens`) once, and do `syncs` weight syncs, under `cost`.

    A true lower bound for any schedule under the same memory: every step decodes at most `slots`
    tokens per replica and reads at most the KV budget, so the steps summed over replicas are at
    least max(tokens / slots, ctx_sum / budget); a step costs at least its overhead plus the larger
    of its bytes and FLOPs terms, and sum(max) >= max(sum); work is split across replicas at will
    (no group or sequence constraint), so the bound is the total divided by `replicas`.

    With `windows` (roofline only) the responses must also keep their staleness: each one's tokens
    are generated, one decode step after another, within the training steps its window allows
    (`staleness_bound_steps`), which can force more, smaller decode steps; the bound is then the
    least total time S that pays for the replica-steps such a schedule needs within S.
    """
    if isinstance(cost, LinearCPU):
        decode = tokens * (cost.t0 / slots + cost.c)
        return (decode + sum(cost.prefill_s(p) for p in prompt_lens)) / replicas + syncs * cost.weight_sync_s()
    floor_steps = max(tokens / slots, ctx_sum / cost.kv_budget_tokens)
    mm = matmul_params(cost.cfg)[1]
    bw, fl = cost.eff_bw, cost.eff_flops
    prefill = sum(cost.prefill_s(p) for p in prompt_lens)
    sync = syncs * cost.weight_sync_s()
    comm = tokens * cost.comm_token_s  # tensor parallel: the all-reduce bytes of every decoded token

    def total(steps: float) -> float:
        mem = (steps * mm * cost.dtype_bytes + ctx_sum * cost.kv_bytes_per_token) / bw
        comp = (2 * mm * tokens + cost._attn_flops_per_ctx * ctx_sum) / fl
        fixed = steps * (cost.step_overhead_s + cost.comm_step_s) + comm
        return (fixed + max(mem, comp) + prefill) / replicas + sync

    free = total(floor_steps)
    if windows is None or not len(windows.tokens):
        return free
    return staleness_bound_s(cost, windows, floor_steps, total, free)


@dataclasses.dataclass
class StalenessWindows:
    """Per response (counted tokens only): its number of tokens, the sum over them of sqrt(context
    read), the sum of the contexts, and the first and last training step (0-based, within the
    measured window) in which those tokens may have been generated; `steps` training steps in all.
    A response with no constraint (still buffered) has first = 0, last = steps - 1."""

    tokens: object  # numpy arrays, one entry per response
    sqrt_ctx: object
    ctx: object
    first: object
    last: object
    steps: int

    def __len__(self) -> int:
        return len(self.tokens)


def staleness_bound_steps(cost, w: StalenessWindows, S: float, mu=None):
    """A lower bound on the replica-steps of any schedule of total time S that respects the windows.

    Why: give every replica-step t its running contexts K_t <= budget and duration
    tau_t >= c0 + c1 K_t (c0 = step overhead + all-reduce latency + weight bytes / bandwidth, c1 =
    KV bytes per token / bandwidth; the per-token all-reduce bytes are left out, which only lowers
    the bound). A response i reads contexts a_it at its L_i steps, which run one after another
    within its window, of length W_i: sum_t tau_t <= W_i, so sum_t K_t <= (W_i - L_i c0) / c1.
    Splitting each step among the responses it serves, N = sum_t 1 >= sum_i sum_t a_it / K_t, and by
    Cauchy-Schwarz sum_t a_it / K_t >= (sum_t sqrt a_it)^2 / sum_t K_t, so
        n_i(W_i) = max(A_i / (W_i - L_i c0), ctx_i / budget),  A_i = c1 (sum_t sqrt a_it)^2.
    The windows are sums of the step times T_k, which total S. The least sum_i n_i over all T_k >= 0
    is bounded below by its Lagrange dual at any mu >= 0 (weak duality):
        sum_i min_W [n_i(W) + mu_i W] - S max_k sum_{i: k in window i} mu_i.
    mu defaults to the optimality condition of equal step times. Returns (the bound, mu).
    """
    import numpy as np

    c0, c1 = cost.step_fixed_s, cost.kv_bytes_per_token / cost.eff_bw
    a = w.tokens * c0
    A = c1 * w.sqrt_ctx**2
    e = w.ctx / cost.kv_budget_tokens
    if mu is None:
        mu = _slopes(w, np.full(w.steps, S / w.steps), a, A, e, c1)
    # min over W > a of max(A / (W - a), e) + mu W: at W = a + sqrt(A / mu) while that is left of
    # the kink a + A / e, else at the kink
    steep = mu * A >= e**2
    g = np.where(steep, 2 * np.sqrt(A * mu) + mu * a, e + mu * (a + A / e))
    cover = np.zeros(w.steps + 1)
    np.add.at(cover, w.first, mu)
    np.add.at(cover, w.last + 1, -mu)
    lam = float(np.cumsum(cover)[:-1].max())
    return float(g.sum() - S * lam), mu


def _slopes(w: StalenessWindows, T, a, A, e, c1):
    """-dn_i/dW_i at the windows the step times T give (a window too short for its response is
    taken at twice its least feasible length): the optimality condition's multipliers."""
    import numpy as np

    prefix = np.concatenate([[0.0], np.cumsum(T)])
    W = np.maximum(prefix[w.last + 1] - prefix[w.first], a + 2 * c1 * w.ctx)
    return np.where(W - a < A / e, A / (W - a) ** 2, 0.0)


def best_multipliers(cost, w: StalenessWindows, S: float, iters: int = 300):
    """Multipliers for the dual in `staleness_bound_steps`: any are valid, these make it tight. Step
    times start equal and move (multiplicatively, total S) toward the steps whose windows need the
    most time, which is where the optimum has equal sums of multipliers per step; the best dual seen is kept."""
    import numpy as np

    c0, c1 = cost.step_fixed_s, cost.kv_bytes_per_token / cost.eff_bw
    a, A, e = w.tokens * c0, c1 * w.sqrt_ctx**2, w.ctx / cost.kv_budget_tokens
    T = np.full(w.steps, S / w.steps)
    best, best_mu = -np.inf, None
    for _ in range(iters):
        mu = _slopes(w, T, a, A, e, c1)
        value = staleness_bound_steps(cost, w, S, mu)[0]
        if value > best:
            best, best_mu = value, mu
        cover = np.zeros(w.steps + 1)
        np.add.at(cover, w.first, mu)
        np.add.at(cover, w.last + 1, -mu)
        m = np.cumsum(cover)[:-1]
        T = T * np.exp(0.3 * (m / max(m.mean(), 1e-300) - 1))
        T *= S / T.sum()
    return best_mu


def staleness_bound_s(cost, w: StalenessWindows, floor_steps: float, total, free: float) -> float:
    """The least S with S >= total(replica-steps any schedule of time S needs): bisection with mu
    fixed (the dual is then linear in S, so the condition is monotone), re-centred a few times."""
    best = free
    S_ref = free
    for _ in range(4):
        mu = best_multipliers(cost, w, S_ref)

        def needs(S, mu=mu):
            return total(max(floor_steps, staleness_bound_steps(cost, w, S, mu)[0]))

        lo, hi = 0.0, max(free, S_ref)
        while needs(hi) > hi:
            hi *= 2
        for _ in range(60):  # invariant: needs(lo) > lo, so the run's own time is above lo
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if needs(mid) > mid else (lo, mid)
        if lo <= best * (1 + 1e-9):
            break
        best, S_ref = lo, lo
    return best
