"""`run.device` and the numerical contract on it (lensemble/device.py): resolution and its errors, bf16
training on the CPU with fp32 master weights and fp32 loss terms, CPU updates for the aggregator."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lensemble.config import parse_params
from lensemble.data.episodes import generate_episodes
from lensemble.device import device_info, resolve_device, to_device
from lensemble.errors import ConfigError
from lensemble.model.world_model import federated_state, local_state
from lensemble.sim.registry import make_embodiment
from lensemble.training import make_optimizer, train_steps
from lensemble.workflow import build_model, place, sampler_for
from tests.conftest import REPO, make_project, micro_params

NO_GPU = not torch.cuda.is_available()


def test_auto_and_cpu_resolve_to_what_is_here():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
def test_cuda_without_a_gpu_names_the_fix():
    with pytest.raises(ConfigError, match=r"run.device is cuda but torch sees no CUDA GPU \(torch .*\): set run.device to auto or cpu"):
        resolve_device("cuda")


def test_an_unknown_device_is_a_config_error():
    with pytest.raises(ConfigError, match="run.device is 'tpu'; expected auto, cpu or cuda"):
        resolve_device("tpu")
    raw = micro_params()
    raw["run"]["device"] = "tpu"
    with pytest.raises(ConfigError, match="run.device"):
        parse_params(raw)


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
def test_run_with_cuda_on_a_cpu_machine_fails_in_one_line_before_any_work(tmp_path):
    raw = micro_params()
    raw["run"]["device"] = "cuda"
    root = make_project(tmp_path / "p", raw)
    for argv in (["check-params"], ["run", "prepare"]):
        out = subprocess.run([sys.executable, "-m", "flows.cli", "--root", str(root), *argv], capture_output=True, text=True, cwd=REPO)
        assert out.returncode == 2, out.stderr
        lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
        assert len(lines) == 1 and "run.device is cuda but torch sees no CUDA GPU" in lines[0]
    assert sorted(p.name for p in root.iterdir()) == ["budgets.yaml", "params.yaml", "pricing.yaml"]  # nothing written


def test_device_info_records_the_cpu_and_the_determinism_mode():
    info = device_info(torch.device("cpu"), True)
    assert info["type"] == "cpu" and info["deterministic"] is True and info["threads"] == torch.get_num_threads()
    assert info["torch"] == torch.__version__


def test_to_device_is_the_same_tensor_when_already_there():
    t = torch.arange(3.0)
    assert to_device(t, torch.device("cpu")) is t


@pytest.fixture(scope="module")
def tiny():
    raw = micro_params()
    raw["train"]["precision"] = "bf16"
    p = parse_params(raw)
    eps = generate_episodes(make_embodiment("grid_point", p.data.image_size), 0, "device-test", 3, p.data.episode_length, 0.5, 0.3, 4)
    return p, sampler_for(eps, p)


def test_bf16_training_on_the_cpu_keeps_fp32_master_weights_and_fp32_loss_terms(tiny):
    p, sampler = tiny
    model = place(build_model(p, "bf16-cpu"), p)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    opt = make_optimizer(model, p.train)
    seen = []
    log = train_steps(model, opt, [("grid_point", sampler)], 3, train=p.train, objective=p.objective, run_seed=0, round_idx=0,
                      data_key="t", on_step=lambda step, losses: seen.append(losses))
    assert all(t.dtype == torch.float32 for t in model.parameters())  # master weights
    assert all(s.dtype == torch.float32 for state in opt.state.values() for s in state.values() if s.is_floating_point())
    assert len(seen) == 3 and all(torch.isfinite(torch.tensor(list(d.values()))).all() for d in seen)
    assert any(not torch.equal(before[n], t) for n, t in model.state_dict().items())  # it trained
    assert log.mean()["loss/pred"] > 0


def test_bf16_loss_terms_are_fp32_tensors(tiny):
    from lensemble.objectives.losses import world_model_loss
    from lensemble.objectives.sigreg import random_directions

    p, sampler = tiny
    model = build_model(p, "bf16-terms")
    frames, actions, proprio = sampler.sample(4, torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        terms = world_model_loss(model.encoder, model.predictor, model.action_heads["grid_point"], frames, actions, proprio,
                                 random_directions(model.latent_dim, 8, torch.Generator().manual_seed(1)),
                                 proprio_valid=sampler.proprio_valid, proprio_weight=1.0, sigreg_weight=0.5, anchor_weight=0.1,
                                 num_knots=17, t_max=3.0, rollout_steps=1, sigreg_on="centered_tokens",
                                 probe_PCHW=frames[:2, 0], global_probe_PND=torch.zeros(2, model.encoder.num_tokens, model.latent_dim))
    assert {t.dtype for t in (terms.total, terms.pred, terms.proprio, terms.sigreg, terms.anchor)} == {torch.float32}


def test_updates_for_the_aggregator_are_cpu_fp32(tiny):
    p, _ = tiny
    model = build_model(p, "cpu-state")
    for state in (federated_state(model), local_state(model)):
        assert {t.device.type for t in state.values()} == {"cpu"} and {t.dtype for t in state.values()} == {torch.float32}
