"""Intra-site data parallelism: `torchrun` with 2 CPU processes on gloo matches single-process training.

Both runs start from the same site state (model + AdamW moments after one single-process step) and
the same round's global parameters, train at micro data sizes with the anchor and SIGReg on, and must
agree within fp tolerance on every parameter and every AdamW moment (atol 1e-5, rtol 1e-4; see
`_key_bias` for the one exception and why). DDP on ViT-tiny, FSDP2 on ViT-micro.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lensemble.config import parse_params
from lensemble.data.episodes import generate_episodes, write_episodes
from lensemble.distributed import shard_rows
from lensemble.errors import ConfigError
from lensemble.model.world_model import federated_state, load_federated
from lensemble.paths import Layout
from lensemble.sim.registry import make_embodiment
from lensemble.training import encode_frames, make_optimizer, train_steps
from lensemble.workflow import build_model, load_site, probe_frames, sampler_for, site_embodiment
from tests.conftest import make_project, micro_params

REPO = Path(__file__).resolve().parents[1]
SITE, ROUND, STEPS = "site_a", 1, 3


def _make_project(root: Path, encoder: str, freeze_encoder_at: float):
    """A micro project with the site's episodes, the probe, a warm site state and round-1 global params."""
    raw = micro_params()
    raw["train"]["freeze_encoder_at"] = freeze_encoder_at
    raw["run"]["torch_threads"] = 1
    raw["model"]["encoder"] = encoder
    raw["train"]["batch_size"] = 4  # 2 windows per rank
    root = make_project(root, raw)
    p, layout = parse_params(raw), Layout(root)
    d = p.data
    for s in d.sites:
        env = make_embodiment(s.embodiment, d.image_size)
        gen = lambda ns, n: generate_episodes(env, p.run.seed, ns, n, d.episode_length, d.expert_noise, d.random_fraction, d.segment_length)  # noqa: E731
        write_episodes(gen(s.name, s.episodes), layout.site_episodes(s.name))
        write_episodes(gen(f"probe/{s.embodiment}", d.probe_episodes), layout.probe(s.embodiment))
    model = build_model(p, f"site/{SITE}")
    opt = make_optimizer(model, p.train)
    # A few warm steps, and the round-1 global params taken from them: from a fresh build the predictor's
    # zero-initialised output layers make every trunk gradient exactly zero at first and then
    # round-off-sized, which AdamW turns into lr-sized steps whose signs the rank layout decides.
    train_steps(model, opt, [(site_embodiment(p, SITE), sampler_for(load_site(layout, p, SITE), p))], 8, train=p.train,
                objective=p.objective, run_seed=p.run.seed, round_idx=0, data_key=SITE)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, root / "warm.pt")
    torch.save(federated_state(model), root / "global.pt")
    return root, p, layout


def _single_process(root: Path, p, layout) -> dict:
    """What tasks.train.site_train would compute for round ROUND from warm.pt and global.pt."""
    saved = torch.load(root / "warm.pt", weights_only=True)
    model = build_model(p, f"site/{SITE}")
    opt = make_optimizer(model, p.train)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    load_federated(model, torch.load(root / "global.pt", weights_only=True))
    probe = probe_frames(layout, p)
    H = p.federate.inner_steps  # round ROUND's steps of the federation, as scripts/ddp_train.py counts them
    log = train_steps(model, opt, [(site_embodiment(p, SITE), sampler_for(load_site(layout, p, SITE), p))], STEPS, train=p.train,
                      objective=p.objective, run_seed=p.run.seed, round_idx=ROUND, data_key=SITE, probe_PCHW=probe,
                      global_probe_PND=encode_frames(model, probe), schedule=(ROUND * H, p.federate.rounds * H))
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "log": log}


def _torchrun(root: Path, strategy: str) -> tuple[dict, dict, float]:
    out = root / f"{strategy}.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(REPO / "scripts" / "ddp_train.py"),
           "--root", str(root), "--site", SITE, "--steps", str(STEPS), "--round", str(ROUND), "--state", str(root / "warm.pt"),
           "--global", str(root / "global.pt"), "--strategy", strategy, "--threads", "1", "--out", str(out)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=root)
    seconds = time.perf_counter() - t0
    assert res.returncode == 0, res.stderr[-4000:]
    summary = json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])
    return torch.load(out, weights_only=True), summary, seconds


def _key_bias(name: str, t: torch.Tensor) -> torch.Tensor:
    """True on the key third of an attention qkv bias, whose gradient is exactly zero in exact arithmetic.

    softmax(q·(k + b_k)) = softmax(q·k + q·b_k) and q·b_k is the same for every key, so the loss does
    not depend on b_k. In floats its gradient is round-off (~1e-10), and AdamW divides by
    sqrt(v) + 1e-8, turning round-off of either sign into steps of up to ~lr: single-process and
    data-parallel runs then agree only to ~lr per step on these entries, as two single-process runs
    with different thread counts would.
    """
    mask = torch.zeros_like(t, dtype=torch.bool)
    if name.endswith("qkv.bias"):
        width = t.shape[0] // 3
        mask[width : 2 * width] = True
    return mask


def _assert_close(dp: dict, ref: dict, lr: float) -> None:
    assert dp["model"].keys() == ref["model"].keys()
    for name, t in ref["model"].items():
        free = _key_bias(name, t)
        torch.testing.assert_close(dp["model"][name][~free], t[~free], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        assert torch.all((dp["model"][name][free] - t[free]).abs() <= 2 * lr * STEPS), name
    assert dp["optimizer"]["param_groups"] == ref["optimizer"]["param_groups"]
    assert dp["optimizer"]["state"].keys() == ref["optimizer"]["state"].keys()
    for i, st in ref["optimizer"]["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(dp["optimizer"]["state"][i][key], st[key], atol=1e-6, rtol=1e-4, msg=lambda m: f"param {i} {key}: {m}")


# DDP on ViT-tiny, the config issue 8 names; FSDP2 on ViT-micro, because FSDP's per-block
# collectives make ViT-tiny's 24 units slow on gloo (~3x the DDP run) for no extra coverage. The DDP run's
# encoder learns; the FSDP run's round lies after the encoder's freeze step (train.freeze_encoder_at 0.25 of
# 2 rounds x 3 steps: steps 2..5 frozen), so its encoder must come back as the round's global encoder, bit for bit.
@pytest.mark.parametrize("strategy,encoder,freeze_at", [("ddp", "tiny", 1.0), ("fsdp", "micro", 0.25)])
def test_torchrun_two_gloo_ranks_match_single_process(tmp_path, strategy, encoder, freeze_at):
    root, p, layout = _make_project(tmp_path / "proj", encoder, freeze_at)
    ref = _single_process(root, p, layout)
    dp, summary, seconds = _torchrun(root, strategy)
    print(f"{strategy}/{encoder}: torchrun wall {seconds:.1f}s, train {summary['train_seconds']:.2f}s")
    assert summary["world_size"] == 2 and summary["steps"] == STEPS
    _assert_close(dp, ref, p.train.lr)
    # the logged losses are the global-batch losses, as single-process training logs them
    for term in ("pred", "sigreg", "anchor"):
        assert summary["losses"][term] == pytest.approx(getattr(ref["log"], term), rel=1e-4, abs=1e-6), term
    # and training moved the parameters well beyond the tolerance, so the match is not vacuous
    warm = torch.load(root / "warm.pt", weights_only=True)["model"]
    moved = lambda prefix: max((ref["model"][n] - warm[n]).abs().max().item() for n in warm if n.startswith(prefix))  # noqa: E731
    assert moved("predictor.") > 1e-3
    if freeze_at == 1.0:
        assert moved("encoder.") > 1e-3
    else:
        global_state = torch.load(root / "global.pt", weights_only=True)
        for name, t in global_state.items():
            if name.startswith("encoder."):
                assert torch.equal(dp["model"][name], t) and torch.equal(ref["model"][name], t), name


def test_shard_rows_partition_the_global_batch_in_rank_order():
    x = torch.arange(12).reshape(6, 2)
    assert torch.equal(torch.cat([shard_rows(x, r, 3) for r in range(3)]), x)
    with pytest.raises(ConfigError, match=r"train.batch_size \(6\).*world size \(4\)"):
        shard_rows(x, 0, 4)


def test_ddp_launch_is_refused_by_the_preflight_ceiling_before_any_process_group(tmp_path):
    from tests.conftest import make_project, micro_params

    params = micro_params()
    params["preflight"]["max_accelerator_hours"] = 1e-12
    root = make_project(tmp_path / "over", params)
    script = Path(__file__).resolve().parents[1] / "scripts" / "ddp_train.py"
    proc = subprocess.run([sys.executable, str(script), "--root", str(root), "--site", "site_a", "--out", str(tmp_path / "s.pt")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 7, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddp_train: error: ") and "max_accelerator_hours" in lines[0], proc.stderr
    assert not (tmp_path / "s.pt").exists()
