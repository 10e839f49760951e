"""Compute accounting against closed forms, the benchmark smoke, profiler spans, warm start, bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from benchmarks.profiler import SPANS, profile_main, profile_step
from benchmarks.suite import BENCHMARKS, StepSetting, bench_main, bench_params, run_bench, select
from lensemble import compute
from lensemble.config import load_params, parse_params
from lensemble.errors import ConfigError
from lensemble.model.sizes import vit_config
from lensemble.model.vit import ViTEncoder
from lensemble.model.warm_start import validate_warm_start, warm_start_encoder
from lensemble.training import autocast_context
from lensemble.workflow import build_model
from tests.conftest import micro_params

# micro, 16 px frames in 8 px patches (N = 4 tokens), Windows of 2 frames, batch 1, no anchor
MICRO = StepSetting("micro", 16, 8, 2, 1, probe_batch=1)


def real_model(params, seed: int = 0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(params, f"test{seed}")


# ------------------------------------------------------------------------------- parameter counts


def test_vit_large_encoder_has_the_vit_l16_parameter_count():
    # timm's vit_large_patch16_224 has 304,326,632 parameters; ours has no class token (1024), no
    # position for it (1024) and no 1000-way head (1024 * 1000 + 1000)
    n = compute.encoder_param_count("large", 224, 16)
    assert n == 304_326_632 - 1024 - 1024 - (1024 * 1000 + 1000) == 303_299_584
    D, L, p, N = 1024, 24, 16, 196
    block = 2 * 2 * D + (3 * D * D + 3 * D) + (D * D + D) + (4 * D * D + 4 * D) + (4 * D * D + D)
    assert n == 3 * p * p * D + D + N * D + L * block + 2 * D


def test_param_counts_split_federated_and_local():
    params = bench_params(MICRO)
    counts = compute.param_counts(compute.meta_model(params))
    # encoder 112,704 + predictor 115,280 (by hand, see test_memory_estimate_micro_by_hand) and
    # one grid_point head R^2 -> R^32: (2*32 + 32) + (32*32 + 32) = 1,152
    assert counts == {"encoder": 112_704, "predictor": 115_280, "federated": 227_984, "local": 1_152, "total": 229_136}
    assert counts == compute.param_counts(real_model(params))


# ------------------------------------------------------------------------------------------ FLOPs


def test_flop_counter_on_a_linear_layer_is_the_closed_form():
    B, n_in, n_out = 8, 48, 24
    layer = torch.nn.Linear(n_in, n_out)
    x = torch.randn(B, n_in, requires_grad=True)
    with compute.flop_counter() as fwd:
        y = layer(x)
    with compute.flop_counter() as bwd:
        y.sum().backward()
    assert fwd.get_total_flops() == 2 * B * n_in * n_out
    assert bwd.get_total_flops() == 2 * (2 * B * n_in * n_out)  # grad wrt input and wrt weight


def test_cpu_flash_attention_is_counted_as_model_flops():
    b, h, s, d = 2, 3, 16, 8
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    with compute.flop_counter() as fwd:
        out = F.scaled_dot_product_attention(q, k, v)
    with compute.flop_counter() as bwd:
        out.sum().backward()
    assert fwd.get_total_flops() == 4 * b * h * s * s * d  # QKᵀ and PV
    assert bwd.get_total_flops() == 2 * fwd.get_total_flops()


def encoder_frame_flops(name: str, image: int, patch: int) -> tuple[int, int]:
    """Closed form: (blocks, patch embedding) forward FLOPs of the encoder on one frame."""
    cfg = vit_config(name)
    N, D = (image // patch) ** 2, cfg.width
    linear = 2 * N * (3 * D * D + D * D + 4 * D * D + 4 * D * D)  # qkv, proj, fc1, fc2
    attention = 4 * N * N * D  # QKᵀ and PV over all heads
    return cfg.depth * (linear + attention), 2 * N * 3 * patch * patch * D


@pytest.mark.parametrize("name", ["nano8", "nano16", "nano32", "micro"])
def test_encoder_forward_flops_are_the_closed_form(name):
    frames = 3
    enc = ViTEncoder(vit_config(name), 16, 8)
    with compute.flop_counter() as counter:
        z = enc(torch.randn(1, frames, 3, 16, 16))
    assert z.shape == (1, frames, 4, vit_config(name).width)
    blocks, patch = encoder_frame_flops(name, 16, 8)
    assert counter.get_total_flops() == frames * (blocks + patch)


def test_step_flops_meta_equal_cpu_and_scale_with_the_batch():
    params = bench_params(MICRO)
    meta = compute.step_flops(params)
    model = real_model(params)
    emb = next(iter(model.action_heads))
    inputs = compute.step_inputs(model, compute.step_shape(params), emb, torch.Generator().manual_seed(0))
    assert compute.count_step_flops(model, params, inputs, emb) == meta
    assert meta["backward"] > meta["forward"] > 0
    # every matmul is per Window, so without the (fixed-size) anchor FLOPs are linear in the batch
    f = [compute.step_flops(bench_params(StepSetting("micro", 16, 8, 2, b, 1)), anchor=False)["total"] for b in (1, 2)]
    assert f[1] == 2 * f[0]
    # the anchor adds an encoder forward + backward on its probe frame: backward is 2x forward but
    # for the patch embedding, whose input (pixels) needs no gradient
    blocks, patch = encoder_frame_flops("micro", 16, 8)
    assert meta["total"] - f[0] == 3 * blocks + 2 * patch


# ----------------------------------------------------------------------------------------- memory


def test_memory_estimate_micro_by_hand():
    params = bench_params(MICRO)
    est = compute.memory_estimate(params, 229_136, anchor=False, action_dim=2)
    P = 229_136  # encoder 12,352 patch + 256 pos + 2 x 49,984 blocks + 128 norm; predictor 4,160 inp + 1,088 proprio_in
    # + 2,112 act + 2,112 act_cond + 384 space + 128 time + 99,968 blocks + 128 norm + 4,160 out + 1,040 proprio_out; head 1,152
    # activations, bytes: encoder 2 frames x (2 blocks x 16,512 + final norm 2,080) = 70,208;
    # predictor 1 one-step pass of 6 tokens (teacher-forced; the 1-step rollout from the 1-step context reuses it):
    # 2 blocks x 24,768 + inputs 1,216 + final norm 1,584 + out/proprio_out inputs 1,280 + predictions 1,088 = 54,704,
    # and the rollout's stacked prediction for its MSE, 1,088; SIGReg 8 tokens: 2,048 + 34,816
    activations = 70_208 + 54_704 + 1_088 + 36_864
    inputs = 1 * 2 * (3 * 16 * 16 * 4 + (2 + 16) * 4)
    assert est == {
        "master_fp32": 4 * P, "working_bf16": 0, "gradients": 4 * P, "adamw_moments": 8 * P,
        "activations": activations, "inputs": inputs, "total": 16 * P + activations + inputs,
    }
    bf16 = compute.memory_estimate(params.model_copy(update={"train": params.train.model_copy(update={"precision": "bf16"})}), P, anchor=False)
    assert bf16["working_bf16"] == 2 * P and bf16["activations"] < activations


@pytest.mark.parametrize("encoder,precision,rollout", [("micro", "fp32", 1), ("tiny", "bf16", 1), ("micro", "fp32", 3)])
def test_activation_formula_matches_saved_tensors_measured(encoder, precision, rollout):
    setting = StepSetting(encoder, 32, 8, 4, 2, 4, precision)
    params = bench_params(setting)
    params = params.model_copy(update={"objective": params.objective.model_copy(update={"rollout_steps": rollout})})  # 3: two cached steps
    model = real_model(params)
    emb = next(iter(model.action_heads))
    shape = compute.step_shape(params)
    inputs = compute.step_inputs(model, shape, emb, torch.Generator().manual_seed(0))
    held = (inputs.frames_BTCHW, inputs.actions_BTK, inputs.proprio_BTQ, inputs.directions_DM, inputs.probe_PCHW, inputs.global_probe_PND)
    with compute.saved_tensor_bytes(model, held) as measured, autocast_context(precision):
        compute.step_loss(model, params, inputs, emb)
    assert compute.activation_bytes(shape)["total"] == pytest.approx(measured["activations"], rel=0.01)
    n_params = compute.param_counts(model)["total"]
    # the patch weight's bf16 cast is of a view (`PatchEmbed` flattens it), so the hook counts it as an activation: 1.4% here
    assert measured["working_copy"] == pytest.approx(2 * n_params if precision == "bf16" else 0, rel=0.02)


def test_compute_summary_is_plain_json():
    summary = compute.compute_summary(bench_params(MICRO))
    assert json.loads(json.dumps(summary)) == summary
    assert summary["params"]["total"] == 229_136 and summary["flops_per_step"]["total"] > 0


# ---------------------------------------------------------------------------------- bench, profile


def test_bench_smoke_returns_every_key_and_writes_the_report(tmp_path):
    out = tmp_path / "bench.json"
    results = run_bench(None, smoke=True, out=out, echo=False)
    for name in BENCHMARKS:
        if not name.startswith("wire."):
            assert name in results, name
    assert {"wire.keystream_gbps", "wire.quant_mask_total_s", "wire.aggregate_ratio"} <= set(results)
    assert results["peak.matmul_gflops"] > 0 and 0 < results["tiny.mfu"] < 1
    for cfg in ("tiny", "small"):
        assert 0.75 <= results[f"{cfg}.peak_memory_ratio"] <= 1.25
    assert 303e6 < results["large.params"] < 305e6
    doc = json.loads(out.read_text())
    assert doc["results"] == results and doc["hardware"] and doc["hardware_class"]


def test_bench_names_select_by_prefix_and_reject_unknown(capsys):
    assert select(["small"]) == ["small.mfu", "small.sigreg_fraction", "small.peak_memory_ratio"]
    assert select(None) == list(BENCHMARKS)
    with pytest.raises(ConfigError, match="unknown benchmark 'huge.mfu'"):
        select(["huge.mfu"])
    assert bench_main(["huge.mfu"]) == ConfigError.exit_code
    assert "unknown benchmark" in capsys.readouterr().err


def test_profile_step_writes_a_trace_with_the_plan_spans(tmp_path):
    trace = profile_step("micro", 1, tmp_path, threads=1)
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert set(SPANS) <= names
    assert "encoder_forward" in trace.with_suffix(".txt").read_text()
    assert profile_main(["huge", "--out", str(tmp_path)]) == ConfigError.exit_code


def test_profiler_spans_change_no_number():
    params = bench_params(MICRO)
    model = real_model(params)
    emb = next(iter(model.action_heads))
    inputs = compute.step_inputs(model, compute.step_shape(params), emb, torch.Generator().manual_seed(0))
    plain = compute.step_loss(model, params, inputs, emb)
    with torch.profiler.profile():
        profiled = compute.step_loss(model, params, inputs, emb)
    assert torch.equal(plain, profiled)


# ------------------------------------------------------------------------------------- warm start


def test_warm_start_round_trip_from_every_checkpoint_form(tmp_path):
    params = bench_params(MICRO)
    source = real_model(params, seed=0)
    full = source.state_dict()
    encoder_only = source.encoder.state_dict()
    forms = {"full.pt": full, "site.pt": {"model": full, "optimizer": {}}, "encoder.pt": encoder_only}
    for name, state in forms.items():
        torch.save(state, tmp_path / name)
        target = real_model(params, seed=1)
        predictor_before = {k: v.clone() for k, v in target.predictor.state_dict().items()}
        info = warm_start_encoder(target, tmp_path / name)
        assert info["tensors"] == len(encoder_only) and len(info["sha256"]) == 64
        for k, v in encoder_only.items():
            assert torch.equal(target.encoder.state_dict()[k], v), (name, k)
        for k, v in predictor_before.items():
            assert torch.equal(target.predictor.state_dict()[k], v)


def test_warm_start_shape_mismatch_names_the_field_and_tensor(tmp_path):
    other = real_model(bench_params(StepSetting("micro", 32, 8, 2, 1, 1)))  # 16 tokens, not 4
    torch.save(other.state_dict(), tmp_path / "other.pt")
    params = bench_params(MICRO)
    target = real_model(params)
    before = {k: v.clone() for k, v in target.encoder.state_dict().items()}
    with pytest.raises(ConfigError, match=r"model\.warm_start: .*tensor encoder\.pos has shape \(1, 16, 64\).*expects \(1, 4, 64\)"):
        warm_start_encoder(target, tmp_path / "other.pt")
    assert all(torch.equal(target.encoder.state_dict()[k], v) for k, v in before.items())  # untouched
    bad = params.model_copy(update={"model": params.model.model_copy(update={"warm_start": str(tmp_path / "other.pt")})})
    with pytest.raises(ConfigError, match=r"model\.warm_start: .*encoder\.pos"):
        validate_warm_start(bad)
    with pytest.raises(ConfigError, match=r"model\.warm_start: checkpoint .*missing\.pt does not exist"):
        warm_start_encoder(target, tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match=r"model\.warm_start: .*not a readable torch checkpoint"):
        warm_start_encoder(target, tmp_path / "junk.pt")


# -------------------------------------------------------------------------------------- bad input


def test_unknown_model_name_is_a_config_error_naming_the_field():
    raw = micro_params()
    raw["model"]["encoder"] = "huge"
    with pytest.raises(ConfigError, match=r"model\.encoder: unknown ViT config 'huge'"):
        parse_params(raw)  # refused at load, before any model is built
    with pytest.raises(ConfigError, match=r"model\.encoder: unknown ViT config 'huge'"):
        vit_config("huge")


def test_patch_that_does_not_divide_the_image_is_a_config_error_naming_both_fields():
    raw = yaml.safe_load(yaml.safe_dump(micro_params()))
    raw["model"]["patch_size"] = 7
    with pytest.raises(ConfigError, match=r"model\.patch_size \(7\) must divide data\.image_size \(16\)"):
        parse_params(raw)
    with pytest.raises(ConfigError, match=r"model\.patch_size 7 must divide data\.image_size 16"):
        ViTEncoder(vit_config("micro"), 16, 7)


@pytest.mark.parametrize("path", ["params.yaml", "examples/grid-four-sites.params.yaml"])
def test_shipped_configs_validate_and_their_encoder_builds(path):
    """Both shipped configs pass the strict schema, and the encoder each names is the width it declares."""
    root = Path(__file__).resolve().parents[1]
    params = load_params(root / path)
    cfg = vit_config(params.model.encoder)
    enc = ViTEncoder(cfg, params.data.image_size, params.model.patch_size)
    z = enc(torch.zeros(1, 1, 3, params.data.image_size, params.data.image_size))
    assert z.shape[-1] == cfg.width and z.shape[-2] == (params.data.image_size // params.model.patch_size) ** 2
