"""The inner learning-rate schedule: closed form, what the optimizer actually takes, rounds that
continue one schedule, and bad schedules rejected before any work."""
from __future__ import annotations

import itertools
import math

import pytest

from lensemble.config import parse_params
from lensemble.data.episodes import generate_episodes
from lensemble.errors import ConfigError
from lensemble.sim.registry import make_embodiment
from lensemble.training import make_optimizer, scheduled_lr, train_steps
from lensemble.workflow import build_model, sampler_for
from tests.conftest import micro_params


def _params(**train):
    raw = micro_params()
    raw["train"].update(train)
    return parse_params(raw)


def test_constant_is_lr_everywhere():
    p = _params(lr_schedule="constant", lr=0.003)
    assert {scheduled_lr(p.train, s, 10) for s in range(10)} == {0.003}
    assert scheduled_lr(p.train, 5, None) == 0.003


def test_cosine_against_its_closed_form():
    p = _params(lr_schedule="cosine", lr=0.002, warmup_steps=3, lr_final_fraction=0.1)
    total = 23  # 3 warm-up steps, then 20 steps of decay: step 3 is lr, step 22 is 0.1 lr
    lrs = [scheduled_lr(p.train, s, total) for s in range(total)]
    assert lrs[:3] == pytest.approx([0.002 / 3, 0.004 / 3, 0.002])
    assert lrs[3] == pytest.approx(0.002)
    assert lrs[-1] == pytest.approx(0.0002)
    assert lrs[13] == pytest.approx(0.002 * (0.1 + 0.45 * (1 + math.cos(math.pi * 10 / 19))))
    assert all(a >= b for a, b in itertools.pairwise(lrs[3:]))  # non-increasing after warm-up
    with pytest.raises(ValueError, match="outside"):
        scheduled_lr(p.train, total, total)


@pytest.fixture(scope="module")
def site():
    p = _params(lr_schedule="cosine", lr=0.004, warmup_steps=1, lr_final_fraction=0.25)
    eps = generate_episodes(make_embodiment("grid_point", p.data.image_size), 0, "lr-test", 3, p.data.episode_length, 0.5, 0.3, 4)
    return p, sampler_for(eps, p)


def _taken(p, sampler, model, opt, steps, schedule, round_idx):
    seen = []
    train_steps(model, opt, [("grid_point", sampler)], steps, train=p.train, objective=p.objective, run_seed=0, round_idx=round_idx,
                data_key="t", schedule=schedule, on_step=lambda step, losses: seen.append(opt.param_groups[0]["lr"]))
    return seen


def test_rounds_continue_one_schedule_and_the_optimizer_takes_it(site):
    p, sampler = site
    model = build_model(p, "lr")
    opt = make_optimizer(model, p.train)
    total, h = 9, 3
    taken = [lr for r in range(3) for lr in _taken(p, sampler, model, opt, h, (r * h, total), r)]
    assert taken == pytest.approx([scheduled_lr(p.train, s, total) for s in range(total)])
    assert taken[0] == pytest.approx(0.004) and taken[-1] == pytest.approx(0.001)
    # no schedule (a head re-fit on a fresh optimizer): every step at the optimizer's rate, train.lr
    opt = make_optimizer(model, p.train)
    assert _taken(p, sampler, model, opt, 2, None, 9) == [0.004, 0.004]


def test_steps_past_the_schedule_are_refused_before_training(site):
    p, sampler = site
    model = build_model(p, "lr-past")
    opt = make_optimizer(model, p.train)
    with pytest.raises(ValueError, match="run past the 4-step schedule"):
        _taken(p, sampler, model, opt, 3, (2, 4), 0)
    assert opt.state == {}  # nothing stepped


def test_a_warm_up_as_long_as_a_training_is_a_one_line_config_error():
    with pytest.raises(ConfigError) as info:
        _params(lr_schedule="cosine", warmup_steps=4)  # micro: centralized.steps 4, rounds x H 6
    assert "train.warmup_steps (4)" in str(info.value) and "\n" not in str(info.value)
    assert _params(lr_schedule="constant", warmup_steps=4).train.warmup_steps == 4  # only a cosine schedule warms up
