"""What a federation round carries, read from params alone: every party derives it, none is told it."""
from __future__ import annotations

from lensemble.config import Params
from lensemble.federation.transport import ParamSpec, frozen_prefix
from lensemble.model.world_model import ENCODER_PREFIX
from lensemble.training import encoder_learns


def round_frozen_prefix(params: Params, spec: ParamSpec, round_idx: int) -> int:
    """`RoundContext.frozen` of federation round `round_idx`: the encoder's tensors (the head of the spec, in
    sorted order) once it no longer learns at the round's first inner step (`train.freeze_encoder_at`), else 0.
    Every party derives it from params, so none has to be told it and none can move a frozen encoder."""
    H, rounds = params.federate.inner_steps, params.federate.rounds
    if encoder_learns(params.train, round_idx * H, rounds * H):
        return 0
    return frozen_prefix(spec, lambda name: name.startswith(ENCODER_PREFIX))
