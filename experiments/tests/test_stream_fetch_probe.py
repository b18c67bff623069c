"""experiments/probes/stream_fetch_probe.py on the CPU at 1/16 width: every fetch form computes the same layer loop (the
probe times forms that must agree), and an unknown form is one line."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.probes import stream_fetch_probe as probe


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(probe, "H", probe.H // 16)
    monkeypatch.setattr(probe, "KV", probe.KV // 16)
    monkeypatch.setattr(probe, "I", probe.I // 16)


def test_every_weight_reading_form_computes_the_same_loop(small):
    n, t = 3, 32
    rng = np.random.default_rng(0)
    stack = jnp.asarray(rng.standard_normal((n, probe.total())) * 0.05, jnp.float32)
    x = jnp.asarray(rng.standard_normal((t, probe.H)), jnp.float32)
    want = probe.build("device", n)(x, stack)
    assert float(jnp.max(jnp.abs(want - x))) > 1e-3  # the layers change the input
    for form in ("host_iota", "host_const", "host_counter", "host_xs", "host_xs_shift", "host_peel"):
        np.testing.assert_allclose(np.asarray(probe.build(form, n)(x, stack)), np.asarray(want), rtol=1e-5, atol=1e-5)
    rows = [stack[i] for i in range(n)]
    np.testing.assert_allclose(np.asarray(probe.build("host_unrolled", n)(x, rows)), np.asarray(want), rtol=1e-5,
                               atol=1e-5)


def test_a_probe_run_reports_its_step_and_the_bytes_fetched(small):
    rec = probe.probe("host_counter", 2, 16, 1)
    assert rec["step_ms"] > 0 and rec["fetched_gb"] == round(2 * probe.total() * 2 / 1e9, 3)
    assert rec["host_values"] >= 1  # the stack is a host-memory value of the compiled loop


def test_an_unknown_form_is_one_line():
    with pytest.raises(SystemExit, match="unknown form 'nope'"):
        probe.build("nope", 2)
