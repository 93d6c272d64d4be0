"""Seconds this process has spent compiling JAX programs (tracing, lowering, XLA), so that a
step's time can be split into its steady-state work and one-off compiles.

The engine compiles a program the first time it meets a new shape (a batch, length or suffix
bucket), so in a short run the compiles land in whichever steps meet new shapes first; a median
over steps then says more about compile order than about the rollout. `seconds()` is read before
and after a step: the difference is that step's compile time (`time/compile_s`,
`rollout/compile_s`).

JAX reports each compile phase as a time span when it ends (`jax.monitoring`); a trace nested in
another (a jitted function called while an outer one is traced) lies inside the outer span, so the
spans are merged before they are summed.
"""

from __future__ import annotations

import threading

from jax import monitoring

_PHASES = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_lock = threading.Lock()
_total = 0.0
_recent: list[tuple[float, float]] = []  # spans counted lately, for nested ones to be subtracted
_installed = False


def _on_span(event: str, start: float, end: float, **_) -> None:
    global _total, _recent
    if event not in _PHASES:
        return
    with _lock:
        # Spans end inner-first: an outer span arrives after the spans it contains.
        inner = [(s, e) for s, e in _recent if s >= start and e <= end]
        if inner:
            _total -= sum(e - s for s, e in inner)
            _recent = [(s, e) for s, e in _recent if not (s >= start and e <= end)]
        _total += end - start
        _recent.append((start, end))
        del _recent[:-256]


def install() -> None:
    """Start counting (idempotent); compiles before this are not counted."""
    global _installed
    with _lock:
        if not _installed:
            monitoring.register_event_time_span_listener(_on_span)
            _installed = True


def seconds() -> float:
    """Compile seconds since `install()`."""
    install()
    return _total
