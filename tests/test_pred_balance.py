"""Per-embodiment balance of L_pred in pooled training (objective.pred_balance, `training.PredBalance`).

Checked against closed forms: the weights from planted copy errors, the total with a weight, the
running copy errors recomputed from the batches a real pooled training saw; and the invariances: `none`
and one-embodiment training are bit for bit the unbalanced training, on one process and on a
1-rank gloo group through `ddp_train_steps`.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import lensemble.training as training
from lensemble.config import parse_params
from lensemble.federation.outer import state_hash
from lensemble.objectives.losses import copy_error, world_model_loss
from lensemble.training import PredBalance, make_optimizer, train_steps
from lensemble.workflow import build_model
from tests.conftest import micro_params, pooled_samplers


def test_weights_are_the_inverse_copy_errors_averaging_one():
    b = PredBalance("copy", ["a", "b", "c"])
    b.update("a", 0.9)
    b.update("b", 0.3)
    assert b.weight("a") == b.weight("b") == 1.0  # until every embodiment has had a batch
    b.update("c", 0.3)
    inverse = [1 / 0.9, 1 / 0.3, 1 / 0.3]
    expected = [x * 3 / sum(inverse) for x in inverse]
    assert [b.weight(e) for e in "abc"] == pytest.approx(expected, rel=1e-12)
    assert sum(b.weight(e) for e in "abc") == pytest.approx(3.0, rel=1e-12)
    assert b.weight("a") == pytest.approx(3 / 7)  # 3x the copy error: a third of the others' weight
    b.update("a", 0.4)  # a running mean, not the last batch
    assert b.copy["a"] == pytest.approx(0.98 * 0.9 + 0.02 * 0.4, rel=1e-12)


def test_none_and_a_single_embodiment_keep_every_weight_one():
    for b in (PredBalance("none", ["a", "b"]), PredBalance("copy", ["a", "a"])):
        for copy in (0.1, 10.0, 0.5):
            b.update("a", copy)
            b.update("b", copy * 7)
        assert b.weight("a") == 1.0 and b.weight("b") == 1.0
    with pytest.raises(ValueError, match="pred_balance"):
        PredBalance("loss", ["a"])


def _terms(pred_weight: float):
    gen = torch.Generator().manual_seed(3)
    p = parse_params(micro_params())
    model = build_model(p, "centralized")
    emb = p.data.sites[0].embodiment
    frames = torch.rand(2, 3, 3, 16, 16, generator=gen)
    actions = torch.randn(2, 3, model.action_heads[emb].net[0].in_features, generator=gen)
    proprio = torch.randn(2, 3, p.model.proprio_dim, generator=gen)
    directions = torch.randn(model.latent_dim, 8, generator=gen)
    o = p.objective
    return o, world_model_loss(model.encoder, model.predictor, model.action_heads[emb], frames, actions, proprio, directions,
                               proprio_valid=2, proprio_weight=o.proprio_weight, sigreg_weight=o.sigreg_weight,
                               anchor_weight=o.anchor_weight, num_knots=o.num_knots, t_max=o.t_max, rollout_steps=1,
                               sigreg_on=o.sigreg_on, pred_weight=pred_weight), model, frames


def test_the_weight_multiplies_l_pred_alone_and_the_copy_error_is_nothing_moves():
    o, one, model, frames = _terms(1.0)
    _, three, _, _ = _terms(3.0)
    rest = o.proprio_weight * one.proprio + o.sigreg_weight * one.sigreg + o.anchor_weight * one.anchor
    assert torch.equal(one.total, one.pred + rest)  # weight 1: the unweighted sum, bit for bit
    assert torch.equal(three.pred, one.pred) and torch.equal(three.copy, one.copy)  # terms are reported unweighted
    assert float(three.total.detach()) == pytest.approx(float(3.0 * one.pred + rest), rel=1e-6)
    with torch.no_grad():
        z = model.encoder(frames)
    assert float(one.copy) == pytest.approx(float(((z[:, 1:] - z[:, :-1]) ** 2).mean()), rel=1e-6)
    assert torch.equal(copy_error(torch.ones(2, 4, 3, 5)), torch.tensor(0.0))


def _pooled(raw: dict, steps: int, monkeypatch=None, record: list | None = None):
    p = parse_params(raw)
    torch.manual_seed(0)
    model = build_model(p, "centralized")
    samplers = pooled_samplers(p)
    if record is not None:
        real = training.world_model_loss

        def spy(encoder, predictor, head, *args, pred_weight=1.0, **kwargs):
            terms = real(encoder, predictor, head, *args, pred_weight=pred_weight, **kwargs)
            record.append((pred_weight, float(terms.copy)))
            return terms

        monkeypatch.setattr(training, "world_model_loss", spy)
    opt = make_optimizer(model, p.train)
    train_steps(model, opt, samplers, steps, train=p.train, objective=p.objective, run_seed=p.run.seed, round_idx=-1, data_key="pooled")
    return model, samplers


def test_pooled_training_weighs_each_batch_by_the_running_copy_errors_of_the_batches_before_it(monkeypatch):
    raw = micro_params()
    raw["objective"]["pred_balance"] = "copy"
    seen: list = []
    _, samplers = _pooled(raw, 8, monkeypatch, seen)
    names = [e for e, _ in samplers]
    assert len(set(names)) == 2
    running: dict[str, float] = {}
    for step, (weight, copy) in enumerate(seen):  # round-robin: step i trains on samplers[i % 2]
        e = names[step % 2]
        if len(running) < 2:
            assert weight == 1.0
        else:
            inverse = {k: 1 / v for k, v in running.items()}
            assert weight == pytest.approx(inverse[e] * 2 / sum(inverse.values()), rel=1e-12)
        running[e] = copy if e not in running else 0.98 * running[e] + 0.02 * copy
    assert any(not math.isclose(w, 1.0) for w, _ in seen[2:])  # the planted worlds move differently: the weights do too


def test_balance_none_is_the_unbalanced_training_and_balance_changes_pooled_training():
    raw = micro_params()
    none_model, _ = _pooled(raw, 5)
    raw_copy = {**raw, "objective": {**raw["objective"], "pred_balance": "copy"}}
    copy_model, _ = _pooled(raw_copy, 5)
    one = {**raw_copy, "data": {**raw["data"], "sites": raw["data"]["sites"][:1]}}
    one_none = {**one, "objective": {**one["objective"], "pred_balance": "none"}}
    assert state_hash(_pooled(one, 5)[0].state_dict()) == state_hash(_pooled(one_none, 5)[0].state_dict())  # one embodiment: the same bits
    assert state_hash(copy_model.state_dict()) != state_hash(none_model.state_dict())


def test_data_parallel_training_uses_the_same_weights(tmp_path):
    # ddp_train_steps on a 1-rank gloo group: the copy error is the global batch's, so its weights are train_steps'.
    from lensemble.distributed import ddp_train_steps

    raw = micro_params()
    raw["objective"]["pred_balance"] = "copy"
    p = parse_params(raw)
    single, samplers = _pooled(raw, 6)
    torch.manual_seed(0)
    model = build_model(p, "centralized")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp_train_steps(model, make_optimizer(model, p.train), samplers, 6, train=p.train, objective=p.objective, run_seed=p.run.seed,
                        round_idx=-1, data_key="pooled")
    finally:
        dist.destroy_process_group()
    for (name, a), b in zip(single.state_dict().items(), model.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), name
