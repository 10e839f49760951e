"""Predictor: block-causal over time, proprioception in and out, the cached rollout equal to teacher forcing
on its own predictions, and the prediction loss in closed form."""
from __future__ import annotations

import pytest
import torch

from lensemble.model.predictor import AdaptedPredictor, Predictor, ProprioAdapter, block_causal_mask, rollout
from lensemble.objectives.losses import prediction_loss, sigreg_tokens

Q = 6  # padded proprio width


def _predictor(max_steps: int = 8) -> Predictor:
    """A predictor as training leaves it: output layers no longer zero (they start at zero, see below)."""
    torch.manual_seed(0)
    g = Predictor(latent_dim=16, num_tokens=4, action_embed=8, width=32, depth=2, heads=4, max_steps=max_steps, proprio_dim=Q).eval()
    for layer in (g.out, g.proprio_out):
        torch.nn.init.normal_(layer.weight, std=0.2)
    return g


@torch.no_grad()
def test_an_untrained_predictor_says_nothing_moves():
    torch.manual_seed(0)
    g = Predictor(latent_dim=16, num_tokens=4, action_embed=8, width=32, depth=2, heads=4, max_steps=8, proprio_dim=Q).eval()
    z, q, a = _inputs(9)
    out_z, out_q = g(z, q, a)
    assert torch.equal(out_z, z) and torch.equal(out_q, q)


def _inputs(seed: int, B: int = 2, T: int = 5):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, 4, 16, generator=gen), torch.randn(B, T, Q, generator=gen), torch.randn(B, T, 8, generator=gen)


def test_block_causal_mask_lets_a_step_see_itself_and_the_past_only():
    m = block_causal_mask(3, 2)
    expected = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                             [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, expected)


@torch.no_grad()
def test_future_frames_proprio_and_actions_do_not_change_earlier_predictions():
    g = _predictor()
    z, q, a = _inputs(1)
    out_z, out_q = g(z, q, a)
    z2, q2, a2 = z.clone(), q.clone(), a.clone()
    z2[:, 3:] += 10.0
    q2[:, 3:] += 3.0
    a2[:, 3:] -= 5.0
    out2_z, out2_q = g(z2, q2, a2)
    assert torch.allclose(out_z[:, :3], out2_z[:, :3], atol=1e-5) and torch.allclose(out_q[:, :3], out2_q[:, :3], atol=1e-5)
    assert not torch.allclose(out_z[:, 3:], out2_z[:, 3:], atol=1e-3)


@torch.no_grad()
def test_proprio_and_actions_reach_the_latent_prediction():
    g = _predictor()
    z, q, a = _inputs(4)
    base = g(z, q, a)[0]
    assert not torch.allclose(base, g(z, q + 1.0, a)[0], atol=1e-3)  # the proprio token is read
    assert not torch.allclose(base, g(z, q, a + 1.0)[0], atol=1e-3)  # the action token is read


@torch.no_grad()
def test_cached_steps_equal_one_block_causal_pass():
    g = _predictor()
    z, q, a = _inputs(6, T=7)
    full_z, full_q = g(z, q, a)
    parts = [(0, 3), (3, 5), (5, 7)]
    cache, zs, qs = None, [], []
    for s, e in parts:
        zz, qq, cache = g(z[:, s:e], q[:, s:e], a[:, s:e], cache, return_cache=True)
        zs.append(zz)
        qs.append(qq)
    assert torch.allclose(torch.cat(zs, 1), full_z, atol=1e-5) and torch.allclose(torch.cat(qs, 1), full_q, atol=1e-5)


@torch.no_grad()
def test_rollout_from_a_context_equals_teacher_forcing_on_its_own_predictions():
    g = _predictor()
    z, q, a = _inputs(2, B=3, T=6)
    C = 2
    z_hat, q_hat = rollout(g, z[:, :C], q[:, :C], a)  # ẑ_2..ẑ_6 from z_0, z_1 under a_0..a_5
    assert z_hat.shape == (3, 5, 4, 16) and q_hat.shape == (3, 5, Q)
    hist_z = torch.cat([z[:, :C], z_hat[:, :-1]], dim=1)
    hist_q = torch.cat([q[:, :C], q_hat[:, :-1]], dim=1)
    tf_z, tf_q = g(hist_z, hist_q, a)
    assert torch.allclose(tf_z[:, C - 1:], z_hat, atol=1e-5) and torch.allclose(tf_q[:, C - 1:], q_hat, atol=1e-5)


def test_more_steps_than_trained_positions_is_an_error():
    g = _predictor(max_steps=4)
    z, q, a = _inputs(7, T=5)
    with pytest.raises(ValueError, match="4 time positions"):
        g(z, q, a)


def test_prediction_loss_closed_form_reads_only_the_embodiment_proprio():
    g = _predictor()
    z, q, a = _inputs(3, T=5)
    valid = 4
    tf_z, tf_q = g(z[:, :-1], q[:, :-1], a[:, :-1])
    lat0 = (tf_z - z[:, 1:]).square().mean()
    prop0 = (tf_q[..., :valid] - q[:, 1:, :valid]).square().mean()
    lat, prop = prediction_loss(g, z, q, a, rollout_steps=0, proprio_valid=valid)
    assert torch.allclose(lat, lat0) and torch.allclose(prop, prop0)
    # rollout part: the last k steps from the T - k before them
    k = 2
    lat_k, prop_k = prediction_loss(g, z, q, a, rollout_steps=k, proprio_valid=valid)
    rz, rq = rollout(g, z[:, :3], q[:, :3], a[:, :4])
    assert torch.allclose(lat_k, lat0 + (rz - z[:, 3:]).square().mean(), atol=1e-6)
    assert torch.allclose(prop_k, prop0 + (rq[..., :valid] - q[:, 3:, :valid]).square().mean(), atol=1e-6)


def _two_pass_prediction_loss(g, z, q, a, k: int, valid: int):
    """The loss as first written: teacher forcing, then a rollout that runs its own pass over the context."""
    tf_z, tf_q = g(z[:, :-1], q[:, :-1], a[:, :-1])
    C = z.shape[1] - k
    rz, rq = rollout(g, z[:, :C], q[:, :C], a[:, :-1])
    lat = (tf_z - z[:, 1:]).square().mean() + (rz - z[:, C:]).square().mean()
    prop = (tf_q[..., :valid] - q[:, 1:, :valid]).square().mean() + (rq[..., :valid] - q[:, C:, :valid]).square().mean()
    return lat, prop


@pytest.mark.parametrize("adapted", [False, True])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_shared_pass_loss_and_its_gradient_equal_the_two_pass_reference(adapted: bool, k: int):
    """prediction_loss reuses the teacher-forced pass as the rollout's context pass: same loss, same gradient
    for every parameter (the predictor's and the adapter's), same gradient into the embeddings."""
    valid = 4
    grads = []
    for fn in (lambda g, z, q, a: prediction_loss(g, z, q, a, rollout_steps=k, proprio_valid=valid),
               lambda g, z, q, a: _two_pass_prediction_loss(g, z, q, a, k, valid)):
        g = AdaptedPredictor(_predictor(), _adapter(valid, trained=True)) if adapted else _predictor()
        z, q, a = _inputs(21, B=3, T=6)
        q[..., valid:] = 0.0
        z.requires_grad_(True)
        lat, prop = fn(g, z, q, a)
        (lat + 0.5 * prop).backward()
        grads.append((lat.detach(), prop.detach(), z.grad, {n: p.grad for n, p in g.named_parameters()}))
    (lat_s, prop_s, gz_s, gp_s), (lat_r, prop_r, gz_r, gp_r) = grads
    assert torch.allclose(lat_s, lat_r, rtol=1e-5) and torch.allclose(prop_s, prop_r, rtol=1e-5)
    def close(x: torch.Tensor, ref: torch.Tensor) -> bool:  # float rounding only: within 1e-5 of the gradient's scale
        return float((x - ref).abs().max()) <= 1e-5 * float(ref.abs().max()) + 1e-8

    assert close(gz_s, gz_r)
    assert gp_s.keys() == gp_r.keys()
    for name in gp_r:
        assert close(gp_s[name], gp_r[name]), name


@torch.no_grad()
def test_a_cache_prefix_is_the_cache_of_a_pass_over_the_prefix_alone():
    g = _predictor()
    z, q, a = _inputs(22, T=5)
    _, _, full = g(z, q, a, return_cache=True)
    _, _, alone = g(z[:, :3], q[:, :3], a[:, :3], return_cache=True)
    pre = full.prefix(3)
    assert pre.steps == 3 and len(pre.kv) == len(alone.kv)
    for (k1, v1), (k2, v2) in zip(pre.kv, alone.kv):
        assert k1.shape == k2.shape and torch.allclose(k1, k2, atol=1e-6) and torch.allclose(v1, v2, atol=1e-6)
    for bad in (0, 6):
        with pytest.raises(ValueError, match="prefix"):
            full.prefix(bad)


def test_patch_embedding_is_the_strided_convolution_and_keeps_its_state_dict():
    from lensemble.model.sizes import vit_config
    from lensemble.model.vit import ViTEncoder
    torch.manual_seed(3)
    enc = ViTEncoder(vit_config("micro"), image_size=64, patch_size=16)
    x = torch.randn(5, 3, 64, 64)
    ref = torch.nn.functional.conv2d(x, enc.patch.weight, enc.patch.bias, stride=16).flatten(2).transpose(1, 2)
    out = enc.patch(x)
    assert out.shape == (5, 16, 64)
    assert torch.allclose(out, ref, atol=1e-5)
    assert enc.state_dict()["patch.weight"].shape == (64, 3, 16, 16) and "patch.bias" in enc.state_dict()


def test_centered_tokens_remove_the_shared_layout():
    gen = torch.Generator().manual_seed(8)
    layout = torch.randn(1, 1, 4, 16, generator=gen) * 10.0  # what every frame shares at each position
    z = layout + torch.randn(3, 2, 4, 16, generator=gen)
    t = sigreg_tokens(z, "centered_tokens", None)
    assert t.shape == (24, 16)
    assert torch.allclose(t.reshape(6, 4, 16).mean(0), torch.zeros(4, 16), atol=1e-5)
    assert sigreg_tokens(z, "frames", None).shape == (6, 16)


def _adapter(valid: int, trained: bool) -> ProprioAdapter:
    """A proprio adapter at initialisation (identity) or as training leaves it (random affine maps both ways)."""
    ad = ProprioAdapter(Q, valid)
    if trained:
        torch.manual_seed(5)
        for w in (ad.inp.weight, ad.inp.bias, ad.out.weight):
            torch.nn.init.normal_(w, std=0.5)
    return ad


@torch.no_grad()
def test_an_untrained_adapter_changes_nothing_in_the_embodiment_components_and_keeps_the_padding_zero():
    g = _predictor()
    z, q, a = _inputs(11)
    q[..., 4:] = 0.0  # an embodiment with 4 components, zero-padded to Q
    raw_z, raw_q = g(z, q, a)
    ad_z, ad_q = AdaptedPredictor(g, _adapter(4, trained=False))(z, q, a)
    assert torch.equal(ad_z, raw_z) and torch.equal(ad_q[..., :4], raw_q[..., :4])
    assert torch.equal(ad_q[..., 4:], torch.zeros_like(ad_q[..., 4:]))  # the raw predictor's padding moved: the adapter's never does


@torch.no_grad()
def test_through_any_adapter_an_untrained_predictor_still_says_nothing_moves():
    torch.manual_seed(0)
    g = Predictor(latent_dim=16, num_tokens=4, action_embed=8, width=32, depth=2, heads=4, max_steps=8, proprio_dim=Q).eval()
    z, q, a = _inputs(12)
    q[..., 4:] = 0.0
    out_z, out_q = AdaptedPredictor(g, _adapter(4, trained=True))(z, q, a)
    assert torch.equal(out_z, z) and torch.allclose(out_q, q, atol=1e-6)


@torch.no_grad()
def test_an_adapted_rollout_equals_adapted_teacher_forcing_on_its_own_predictions():
    g = AdaptedPredictor(_predictor(), _adapter(5, trained=True))
    z, q, a = _inputs(13, B=3, T=6)
    q[..., 5:] = 0.0
    C = 2
    z_hat, q_hat = rollout(g, z[:, :C], q[:, :C], a)
    hist_z, hist_q = torch.cat([z[:, :C], z_hat[:, :-1]], dim=1), torch.cat([q[:, :C], q_hat[:, :-1]], dim=1)
    tf_z, tf_q = g(hist_z, hist_q, a)
    assert torch.allclose(tf_z[:, C - 1:], z_hat, atol=1e-5) and torch.allclose(tf_q[:, C - 1:], q_hat, atol=1e-5)
    assert not torch.allclose(q_hat, rollout(g.predictor, z[:, :C], q[:, :C], a)[1], atol=1e-3)  # the adapter is on the path


def test_proprio_adapters_are_local_and_only_joining_embodiments_have_one():
    from lensemble.config import parse_params
    from lensemble.model.world_model import federated_state, load_federated, local_state
    from lensemble.workflow import build_model
    from tests.conftest import micro_params

    params = parse_params(micro_params())
    member = params.data.sites[0].embodiment
    fed = build_model(params, "test/fed")
    joined = build_model(params, "test/join", extra_embodiments=("grid_thruster",))
    assert len(fed.proprio_adapters) == 0 and fed.predictor_for(member) is fed.predictor
    assert list(joined.proprio_adapters) == ["grid_thruster"] and isinstance(joined.predictor_for("grid_thruster"), AdaptedPredictor)
    assert not any(n.startswith("proprio_adapters.") for n in federated_state(joined))  # never in a pseudo-gradient
    assert {n for n in local_state(joined) if n.startswith("proprio_adapters.")} == {
        f"proprio_adapters.grid_thruster.{w}" for w in ("inp.weight", "inp.bias", "out.weight")}
    load_federated(joined, federated_state(fed))  # the federated model loads into a joining one unchanged
    assert all(torch.equal(p, federated_state(fed)[n]) for n, p in federated_state(joined).items())
