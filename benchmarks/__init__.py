"""Benchmark suites: they run the measurements of `lensemble.perf` and report them.

Modules (importable from an installed checkout; the CLI calls the first two):
  suite     `lensemble bench`: every figure beside a physical limit, written to reports/bench.json
  profiler  `lensemble profile`: torch profiler trace and span table of a training step
  data      `python -m benchmarks.data`: window loader, episode generation, residency-guard cost
  wire      wire-path micro-benchmarks: mask keystream, quantize + mask, the aggregator's round
The other files here are stand-alone scripts (`python benchmarks/gpu_vitl.py`).
"""
