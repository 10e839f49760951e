"""Stage-level operations shared by the Prefect tasks: load a site's data, build a model, probe frames.

Each function does one piece of work on explicit inputs; the tasks in `tasks/` only load, call and
write.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from lensemble.config import Params
from lensemble.data.episodes import Episodes, read_episodes
from lensemble.data.windows import WindowSampler, frames_to_tensor
from lensemble.device import configure, resolve_device
from lensemble.errors import ConfigError
from lensemble.model.world_model import WorldModel
from lensemble.paths import Layout
from lensemble.seeds import derive_seed
from lensemble.sim.registry import embodiment_class

PROBE_STRIDE = 4  # every 4th frame of each probe episode: enough coverage, a small probe


def site_names(params: Params) -> list[str]:
    """Site ids in the fixed (sorted) reduction order."""
    return sorted(s.name for s in params.data.sites)


def site_embodiment(params: Params, site: str) -> str:
    """The embodiment of a site; ConfigError for an unknown site name."""
    for s in params.data.sites:
        if s.name == site:
            return s.embodiment
    raise ConfigError(f"unknown site {site!r}; sites in params: {site_names(params)}")


def action_dims(params: Params) -> dict[str, int]:
    """Action dimension of every embodiment in the federation."""
    return {s.embodiment: embodiment_class(s.embodiment).action_dim for s in params.data.sites}


_INIT_LOCK = threading.Lock()


def build_model(params: Params, purpose: str, extra_embodiments: Sequence[str] = ()) -> WorldModel:
    """A freshly initialised world model, seeded by (run seed, purpose), with an action head per federated embodiment
    and, per `extra_embodiments` (a robot joining after the federation), an action head and a proprio adapter.

    nn.Module initialisers draw from torch's global generator; site tasks run in threads, so seeding
    and construction happen under one lock or concurrent sites would interleave their draws.
    """
    with _INIT_LOCK:
        torch.manual_seed(derive_seed(params.run.seed, f"init/{purpose}"))
        dims = action_dims(params) | {e: embodiment_class(e).action_dim for e in extra_embodiments}
        adapted = {e: embodiment_class(e).proprio_dim for e in extra_embodiments}
        return WorldModel(params.model, params.data.image_size, dims, max_steps=params.data.num_steps, adapted=adapted)


def place(model: WorldModel, params: Params) -> WorldModel:
    """`model` moved to `run.device`, with that device's determinism mode set (lensemble.device)."""
    device = resolve_device(params.run.device)
    configure(device, params.run.deterministic)
    return model.to(device)


def warm_start(model: WorldModel, params: Params, layout: Layout) -> dict | None:
    """Initialise the encoder from `model.warm_start` (relative to the project root) if set; provenance or None."""
    if params.model.warm_start is None:
        return None
    from lensemble.model.warm_start import warm_start_encoder

    return warm_start_encoder(model, layout.root / params.model.warm_start)


def load_site(layout: Layout, params: Params, site: str) -> Episodes:
    """A site's episodes (DataError naming the file on any defect)."""
    return read_episodes(layout.site_episodes(site), params.data.image_size)


def sampler_for(eps: Episodes, params: Params) -> WindowSampler:
    return WindowSampler(eps, params.data.num_steps, params.model.proprio_dim)


def embodiments(params: Params) -> list[str]:
    """Distinct embodiments in the federation, sorted."""
    return sorted({s.embodiment for s in params.data.sites})


def load_probe_episodes(layout: Layout, params: Params, embodiment: str) -> Episodes:
    """The public probe episodes of one embodiment: held out from every site's training data."""
    return read_episodes(layout.probe(embodiment), params.data.image_size)


def probe_frames(layout: Layout, params: Params) -> torch.Tensor:
    """The public probe P as normalised frames [P, 3, H, W] (every PROBE_STRIDE-th frame)."""
    return probe_frames_labelled(layout, params)[0]


def probe_frames_labelled(layout: Layout, params: Params) -> tuple[torch.Tensor, list[str], list[int]]:
    """`probe_frames`, the embodiment of each of its rows and the probe episode it comes from (numbered across
    embodiments; a row's frames of one episode are in time order): the per-embodiment gauge reads all three."""
    chunks, labels, episodes = [], [], []
    for emb in embodiments(params):
        eps = read_episodes(layout.probe(emb), params.data.image_size)
        frames = eps.frames_ELHWC[:, ::PROBE_STRIDE]
        E, L = frames.shape[:2]
        chunks.append(frames.reshape(E * L, *frames.shape[2:]))
        first = episodes[-1] + 1 if episodes else 0
        labels += [emb] * (E * L)
        episodes += [first + e for e in range(E) for _ in range(L)]
    return frames_to_tensor(np.concatenate(chunks)), labels, episodes


def eval_seeds(params: Params, embodiment: str) -> Sequence[int]:
    """Fixed evaluation episode seeds, disjoint in namespace from every data-generation seed."""
    return [derive_seed(params.run.seed, f"eval/{embodiment}", participant=str(i)) % (2**32) for i in range(params.evaluate.episodes)]
