"""A frozen encoder's embeddings read from a cache (lensemble.training.FrozenLatents) instead of encoded every step.

Checked: a pooled training across the freeze step, and an anchored head re-fit on a frozen encoder, give every
parameter, AdamW moment and logged loss bit for bit with and without the cache, while the encoder really runs
fewer passes with it; a planted encoder whose output depends on the rest of its batch makes `build` refuse
the cache (and training is still the uncached one, bit for bit); a call too short to pay for a cache builds none.
"""
from __future__ import annotations

import torch

from lensemble.config import parse_params
from lensemble.training import FrozenLatents, encode_frames, make_optimizer, set_trainable, train_steps
from lensemble.workflow import build_model
from tests.conftest import micro_params, pooled_samplers

TOTAL = 16  # freeze_encoder_at 0.25: steps 0..3 learn the encoder, 4..15 read the cache (96 frames' work against 48)


def _setup():
    p = parse_params(micro_params())
    torch.manual_seed(0)
    model = build_model(p, "centralized")
    return p, model, make_optimizer(model, p.train), pooled_samplers(p)


def _count_passes(model) -> list[int]:
    calls = [0]
    model.encoder.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _state(model, opt) -> list[torch.Tensor]:
    return [*model.state_dict().values(), *(v for s in opt.state.values() for v in s.values())]


def _train(reuse: bool, schedule=(0, TOTAL), steps=TOTAL, anchored=False, encoder=None):
    p, model, opt, samplers = _setup()
    if encoder is not None:
        model.encoder = encoder(model.encoder)
    probe = global_probe = None
    if anchored:  # a head re-fit: only the action heads train, the anchor reads the probe through the frozen encoder
        probe = torch.cat([s.window(i)[0] for _, s in samplers for i in range(2)])
        global_probe = encode_frames(model, probe) * 1.01
        set_trainable(model, False)
        for head in model.action_heads.values():
            set_trainable(head, True)
        opt = torch.optim.AdamW([t for t in model.parameters() if t.requires_grad], lr=p.train.lr, foreach=True)
    calls = _count_passes(model)
    log = train_steps(model, opt, samplers, steps, train=p.train, objective=p.objective, run_seed=p.run.seed, round_idx=0,
                      data_key="pooled", schedule=schedule, probe_PCHW=probe, global_probe_PND=global_probe,
                      reuse_frozen_latents=reuse)
    return _state(model, opt), log, calls[0]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_frozen_steps_read_the_cache_and_train_bit_for_bit_as_the_encoded_ones():
    cached, log_c, passes_c = _train(True)
    encoded, log_e, passes_e = _train(False)
    assert _same(cached, encoded)
    assert (log_c.pred, log_c.proprio, log_c.sigreg) == (log_e.pred, log_e.proprio, log_e.sigreg)
    assert passes_e == TOTAL and passes_c < passes_e  # 4 learning steps, then the cache's passes instead of 12 steps'


def test_an_anchored_refit_on_a_frozen_encoder_reads_the_cache_bit_for_bit():
    cached, log_c, passes_c = _train(True, schedule=None, anchored=True)
    encoded, log_e, passes_e = _train(False, schedule=None, anchored=True)
    assert _same(cached, encoded)
    assert log_c.anchor == log_e.anchor and min(log_e.anchor) > 0  # the anchor's value, read from cached probe embeddings
    assert passes_c < passes_e == TOTAL


class _BatchMean(torch.nn.Module):
    """An encoder whose embeddings depend on the other frames of the pass (a batch statistic): no cache may stand in."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner, self.num_tokens, self.width = inner, inner.num_tokens, inner.width

    def forward(self, frames):
        z = self.inner(frames)
        return z + 0.1 * z.mean(dim=(0, 1), keepdim=True)


def test_an_encoder_that_reads_its_batch_gets_no_cache():
    p, model, _, samplers = _setup()
    set_trainable(model, False)
    assert FrozenLatents.build(_BatchMean(model.encoder), samplers, None, p.train.batch_size, 0, torch.device("cpu"), "fp32") is None
    assert FrozenLatents.build(model.encoder, samplers, None, p.train.batch_size, 0, torch.device("cpu"), "fp32") is not None
    cached, _, passes_c = _train(True, encoder=_BatchMean)
    encoded, _, _ = _train(False, encoder=_BatchMean)
    assert _same(cached, encoded) and passes_c > TOTAL  # refused: the attempt's passes, then every step encoded its frames


def test_a_call_too_short_to_pay_builds_no_cache():
    p, _, _, samplers = _setup()
    frames = sum(s.num_frames for _, s in samplers)
    per_step = p.train.batch_size * p.data.num_steps
    assert 2 * frames % per_step == 0  # the boundary below is exact: a cache of half the steps' frames pays
    assert FrozenLatents.pays(samplers, 0, 2 * frames // per_step, p.train.batch_size, 4, 8)
    assert not FrozenLatents.pays(samplers, 0, 2 * frames // per_step - 1, p.train.batch_size, 4, 8)
    assert not FrozenLatents.pays(samplers, 1, 2 * frames // per_step, p.train.batch_size, 4, 8)  # a probe row to encode too
    _, _, passes = _train(True, schedule=(TOTAL - 7, TOTAL), steps=7)  # seven frozen steps: 84 frames against a cache of 48
    assert passes == 7
