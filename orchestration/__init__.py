"""Orchestration: running stages, tracking them, and the sites of a federation run (no Prefect task lives here; tasks/ holds those)."""
