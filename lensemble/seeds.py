"""The one seed-derivation function (DESIGN.md §5).

seed = first 8 bytes (big endian) of sha256("lensemble|{run_seed}|{purpose}|{round}|{participant}")
masked to 63 bits. Every random draw in Lensemble - data generation, window sampling, model
initialisation, SIGReg directions, CEM sampling - takes its seed from here, so any draw can be
reproduced from (run seed, purpose, round, participant) alone.
"""
from __future__ import annotations

import hashlib

import torch


def derive_seed(run_seed: int, purpose: str, round_idx: int = -1, participant: str = "", step: int = -1) -> int:
    """A 63-bit seed for one (run, purpose, round, participant, step)."""
    key = f"lensemble|{run_seed}|{purpose}|{round_idx}|{participant}|{step}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") & ((1 << 63) - 1)


def generator(run_seed: int, purpose: str, round_idx: int = -1, participant: str = "", step: int = -1) -> torch.Generator:
    """A CPU torch.Generator seeded by `derive_seed`."""
    g = torch.Generator()
    g.manual_seed(derive_seed(run_seed, purpose, round_idx, participant, step))
    return g
