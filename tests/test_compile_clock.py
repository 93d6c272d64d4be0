"""compile_clock: counts the compiles a call triggers, once, and nothing for a cached program."""

import time

import jax
import jax.numpy as jnp
import pytest

from april_jax.runtime import compile_clock


def timed(fn, *args):
    before, t = compile_clock.seconds(), time.perf_counter()
    jax.block_until_ready(fn(*args))
    return compile_clock.seconds() - before, time.perf_counter() - t


def test_a_first_call_counts_its_compile_and_a_cached_one_nothing():
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
    x = jnp.ones((64, 64))
    compiled, wall = timed(f, x)
    assert 0 < compiled <= wall
    assert timed(f, x)[0] == 0.0
    assert timed(f, jnp.ones((32, 64)))[0] > 0  # a new shape is a new program


def test_nested_traces_are_not_counted_twice():
    """A jitted function traced inside another: its span lies inside the outer one's."""
    inner = [jax.jit(lambda x, k=k: jnp.sin(x) * k) for k in range(20)]

    @jax.jit
    def outer(x):
        for f in inner:
            x = f(x)
        return x

    compiled, wall = timed(outer, jnp.ones(8))
    assert 0 < compiled <= wall


def test_spans_merge_inner_first_as_jax_reports_them():
    """JAX ends inner spans first; the outer one replaces them (5 s in all, not 7)."""
    before = compile_clock.seconds()
    trace = "/jax/core/compile/jaxpr_trace_duration"
    for start, end in ((1e9 + 1, 1e9 + 2), (1e9 + 3, 1e9 + 4), (1e9, 1e9 + 5)):
        compile_clock._on_span(trace, start, end)
    compile_clock._on_span("/jax/some/other_event", 1e9 + 6, 1e9 + 9)
    assert compile_clock.seconds() - before == pytest.approx(5.0)
