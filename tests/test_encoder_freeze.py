"""The encoder frozen for the last part of a model's training (train.freeze_encoder_at).

Checked: the freeze step in closed form; in a real pooled training the encoder's parameters and AdamW
moments are bit for bit those of the freeze step afterwards while the predictor keeps learning, and
before it the encoder learns; the caller's trainable flags come back; a training without a schedule
(a head re-fit) is never frozen; a data-parallel call (1-rank gloo) that straddles the freeze step freezes
at the same step as `train_steps`.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lensemble.config import parse_params
from lensemble.errors import ConfigError
from lensemble.federation.outer import state_hash
from lensemble.training import encoder_learns, make_optimizer, train_steps
from lensemble.workflow import build_model
from tests.conftest import micro_params, pooled_samplers

TOTAL = 6


def _setup(freeze_at: float):
    raw = micro_params()
    raw["train"]["freeze_encoder_at"] = freeze_at
    p = parse_params(raw)
    torch.manual_seed(0)
    model = build_model(p, "centralized")
    return p, model, make_optimizer(model, p.train), pooled_samplers(p)


def _steps(p, model, opt, samplers, offset: int, steps: int, schedule: bool = True):
    return train_steps(model, opt, samplers, steps, train=p.train, objective=p.objective, run_seed=p.run.seed, round_idx=offset,
                       data_key="pooled", schedule=(offset, TOTAL) if schedule else None)


def _part(model, prefix: str) -> dict:
    return {n: t.clone() for n, t in model.state_dict().items() if n.startswith(prefix)}


def _moments(model, opt, prefix: str) -> dict:
    names = {id(t): n for n, t in model.named_parameters()}
    return {names[id(t)]: {k: v.clone() for k, v in opt.state[t].items()} for t in opt.state if names[id(t)].startswith(prefix)}


def test_the_encoder_learns_for_the_rounded_share_of_the_steps():
    p = parse_params(micro_params())
    at = lambda f: p.train.model_copy(update={"freeze_encoder_at": f})  # noqa: E731
    assert [encoder_learns(at(0.25), s, 750) for s in (0, 187, 188, 749)] == [True, True, False, False]  # round(187.5) = 188
    assert [encoder_learns(at(0.25), s, 2000) for s in (499, 500)] == [True, False]
    assert all(encoder_learns(at(1.0), s, 7) for s in range(7))
    assert not any(encoder_learns(at(0.0), s, 7) for s in range(7))
    with pytest.raises(ConfigError, match="train.freeze_encoder_at must be <= 1.0, got 1.5"):
        parse_params({**micro_params(), "train": {**micro_params()["train"], "freeze_encoder_at": 1.5}})


def test_after_the_freeze_step_the_encoder_and_its_moments_stay_bit_for_bit():
    p, model, opt, samplers = _setup(0.5)  # steps 0..2 learn the encoder, 3..5 do not
    start = _part(model, "encoder.")
    _steps(p, model, opt, samplers, 0, 3)
    frozen, frozen_moments, predictor = _part(model, "encoder."), _moments(model, opt, "encoder."), _part(model, "predictor.")
    assert state_hash(frozen) != state_hash(start)  # it learned before the freeze
    assert frozen_moments
    _steps(p, model, opt, samplers, 3, 3)
    assert state_hash(_part(model, "encoder.")) == state_hash(frozen)  # no update and no weight decay after it
    after = _moments(model, opt, "encoder.")
    for name, st in frozen_moments.items():
        for key, value in st.items():
            assert torch.equal(after[name][key], value), (name, key)
    assert state_hash(_part(model, "predictor.")) != state_hash(predictor)  # the predictor kept learning
    assert all(t.requires_grad for t in model.encoder.parameters())  # the caller's flags come back


def test_a_freeze_inside_one_call_takes_effect_at_its_step():
    # steps 0..5 in one call leave the encoder as steps 0..2 alone do (the same draws: steps 0..2 of one call)
    p, whole, whole_opt, samplers = _setup(0.5)
    _, first, first_opt, _ = _setup(0.5)
    _steps(p, whole, whole_opt, samplers, 0, TOTAL)
    _steps(p, first, first_opt, samplers, 0, 3)
    assert state_hash(_part(whole, "encoder.")) == state_hash(_part(first, "encoder."))
    assert state_hash(_part(whole, "predictor.")) != state_hash(_part(first, "predictor."))
    p1, unfrozen, unfrozen_opt, _ = _setup(1.0)  # never frozen: the encoder goes on learning
    _steps(p1, unfrozen, unfrozen_opt, samplers, 0, TOTAL)
    assert state_hash(_part(unfrozen, "encoder.")) != state_hash(_part(first, "encoder."))
    p0, never, never_opt, _ = _setup(0.0)  # frozen from the first step: never learns
    start = _part(never, "encoder.")
    _steps(p0, never, never_opt, samplers, 0, TOTAL)
    assert state_hash(_part(never, "encoder.")) == state_hash(start)


def test_a_training_without_a_schedule_is_never_frozen():
    p, model, opt, samplers = _setup(0.0)
    start = _part(model, "encoder.")
    _steps(p, model, opt, samplers, 0, 3, schedule=False)  # a head re-fit's call: the caller decides what trains
    assert state_hash(_part(model, "encoder.")) != state_hash(start)


def test_data_parallel_training_freezes_as_train_steps_does(tmp_path):
    # a 1-rank gloo group; steps 1..4 straddle the freeze step 3: DDP wraps the steps before it with the encoder, those after without
    from lensemble.distributed import ddp_train_steps

    p, single, single_opt, samplers = _setup(0.5)
    _, model, opt, _ = _setup(0.5)
    _steps(p, single, single_opt, samplers, 0, 1)
    _steps(p, model, opt, samplers, 0, 1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp_train_steps(model, opt, samplers, 4, train=p.train, objective=p.objective, run_seed=p.run.seed, round_idx=1,
                        data_key="pooled", schedule=(1, TOTAL))
        frozen = _part(model, "encoder.")
        ddp_train_steps(model, opt, samplers, 1, train=p.train, objective=p.objective, run_seed=p.run.seed, round_idx=5,
                        data_key="pooled", schedule=(5, TOTAL))
        assert state_hash(_part(model, "encoder.")) == state_hash(frozen)  # a call wholly after the freeze
        with pytest.raises(ValueError, match="run past the 6-step schedule"):
            ddp_train_steps(model, opt, samplers, 2, train=p.train, objective=p.objective, run_seed=p.run.seed, round_idx=5,
                            data_key="pooled", schedule=(5, TOTAL))
    finally:
        dist.destroy_process_group()
    _steps(p, single, single_opt, samplers, 1, 4)
    _steps(p, single, single_opt, samplers, 5, 1)
    assert all(t.requires_grad for t in model.encoder.parameters())
    for (name, a), b in zip(single.state_dict().items(), model.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), name
    for name, a in _part(single, "encoder.").items():  # the encoder stopped at the same step on both paths
        assert torch.allclose(a, frozen[name], rtol=1e-5, atol=1e-7), name


def test_the_ddp_launcher_refuses_a_round_past_the_federation(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import make_project

    root = make_project(tmp_path / "proj", micro_params())  # rounds 2 x H 3: round 1 with 4 steps runs past step 5
    res = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "scripts" / "ddp_train.py"), "--root", str(root), "--site",
                          "site_a", "--round", "1", "--steps", "4", "--out", str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=120)
    assert res.returncode == ConfigError.exit_code, res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("ddp_train: error: --round 1 with --steps 4 runs past")
    assert not (tmp_path / "out.pt").exists()
