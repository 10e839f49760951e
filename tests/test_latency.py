"""Per-component budget figures measured on every Stage A run (lensemble.perf)."""
from __future__ import annotations

import os

import pytest
import torch

from lensemble.config import parse_params
from lensemble.perf import component_latency, peak_memory_gib
from lensemble.workflow import build_model
from tests.conftest import micro_params


def test_component_latency_reports_consistent_positive_figures():
    params = parse_params(micro_params())
    model = build_model(params, "latency")
    model.train()
    figures = component_latency(model, params, step_seconds=0.05, repeats=2)
    assert model.training  # the measurement restores the mode it found
    assert figures["perf/encoder_forward_ms"] > 0 and figures["perf/predictor_step_ms"] > 0
    assert figures["perf/predictor_step_fraction"] == pytest.approx(figures["perf/predictor_step_ms"] / figures["perf/encoder_forward_ms"])
    assert figures["perf/objective_fraction"] == pytest.approx(figures["perf/sigreg_seconds"] / 0.05)
    assert 0 < figures["perf/peak_memory_gib"] < 1024


def _resident_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_peak_memory_sees_an_allocation_above_the_previous_peak():
    before, resident = peak_memory_gib(), _resident_gib()
    extra = max(before - resident, 0.0) + 0.25  # enough to push resident memory past the old peak
    block = torch.ones(int(extra * 2**30) // 4)  # written, so resident
    assert float(block[-1]) == 1.0
    assert peak_memory_gib() >= resident + 0.9 * extra > before
