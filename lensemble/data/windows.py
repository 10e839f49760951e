"""Windows: clips of `num_steps` consecutive (frame, proprio, action) triples cut from one episode.

Proprioception leaves the sampler as the model reads it: divided by the embodiment's fixed
`proprio_scale` and zero-padded to the federation's width `model.proprio_dim` (`proprio_features`).

`WindowSampler` draws (episode, start) pairs from a seeded generator and gathers batches with one
fancy-indexing op, so a batch costs a single copy of its uint8 frames plus one table lookup that
writes the float32 frames (`python -m benchmarks.data` measures it against memory bandwidth).
"""
from __future__ import annotations

import numpy as np
import torch

from lensemble.data.episodes import Episodes
from lensemble.errors import ConfigError
from lensemble.sim.registry import embodiment_class


# uint8 → float32 in [-1, 1], computed once with the arithmetic x / 127.5 - 1 in fp32: a lookup is
# one pass over the output, bit-identical to the arithmetic, and 2-4x faster than three tensor ops.
_PIXEL_LUT = (torch.arange(256, dtype=torch.float32) / 127.5 - 1.0).numpy()


def frames_to_tensor(frames_uint8: np.ndarray) -> torch.Tensor:
    """[..., H, W, 3] uint8 → [..., 3, H, W] float32 in [-1, 1] (a channels-last view)."""
    frames = np.asarray(frames_uint8)
    if frames.dtype != np.uint8:
        raise TypeError(f"frames must be uint8, got {frames.dtype}")
    return torch.from_numpy(np.take(_PIXEL_LUT, frames)).movedim(-1, -3)


def proprio_scale(embodiment: str) -> tuple[float, ...]:
    """The embodiment's fixed proprioception divisors (ones where it declares none)."""
    cls = embodiment_class(embodiment)
    return tuple(cls.proprio_scale) or (1.0,) * cls.proprio_dim


def proprio_features(proprio_P: np.ndarray, embodiment: str, width: int, scale: tuple[float, ...] | None = None) -> torch.Tensor:
    """[..., p] raw proprioception → [..., width] float32: divided by the embodiment's scale, zero-padded."""
    scale_P = np.asarray(scale if scale is not None else proprio_scale(embodiment), dtype=np.float32)
    proprio_P = np.asarray(proprio_P, dtype=np.float32)
    p = proprio_P.shape[-1]
    if p != scale_P.shape[0]:
        raise ValueError(f"{embodiment} proprioception has {scale_P.shape[0]} components, got {p}")
    if p > width:
        raise ConfigError(f"model.proprio_dim ({width}) is smaller than {embodiment}'s proprioception ({p}); raise it")
    out = np.zeros((*proprio_P.shape[:-1], width), dtype=np.float32)
    out[..., :p] = proprio_P / scale_P
    return torch.from_numpy(out)


class WindowSampler:
    """Random Windows from one embodiment's episodes, reproducible from a torch.Generator."""

    def __init__(self, eps: Episodes, num_steps: int, proprio_width: int, scale: tuple[float, ...] | None = None) -> None:
        E, L = eps.frames_ELHWC.shape[:2]
        if num_steps > L:
            raise ValueError(f"num_steps {num_steps} exceeds episode length {L}")
        self.eps = eps
        self.num_steps = num_steps
        self.proprio_valid = int(eps.proprio_ELP.shape[-1])
        self.proprio_ELQ = proprio_features(eps.proprio_ELP, eps.embodiment, proprio_width, scale).numpy()  # [E, L, Q]
        self.starts_per_episode = L - num_steps + 1
        self.num_windows = E * self.starts_per_episode

    def __len__(self) -> int:
        return self.num_windows

    @property
    def num_frames(self) -> int:
        """Frames in the sampler's episodes (E · L)."""
        return self.eps.frames_ELHWC.shape[0] * self.eps.frames_ELHWC.shape[1]

    def window(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Window `index`: frames [T, 3, H, W], actions [T, K], proprio features [T, Q]."""
        e, s = divmod(int(index), self.starts_per_episode)
        sl = slice(s, s + self.num_steps)
        return (frames_to_tensor(self.eps.frames_ELHWC[e, sl]), torch.from_numpy(self.eps.actions_ELK[e, sl].copy()),
                torch.from_numpy(self.proprio_ELQ[e, sl].copy()))

    def draw(self, batch_size: int, gen: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
        """A batch's frame positions: episode [B, 1] and step [B, T] of every frame (one draw from `gen`)."""
        idx = torch.randint(0, self.num_windows, (batch_size,), generator=gen).numpy()
        e, s = np.divmod(idx, self.starts_per_episode)
        return e[:, None], s[:, None] + np.arange(self.num_steps)[None, :]

    def gather(self, e_B1: np.ndarray, steps_BT: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Actions [B, T, K] and proprio features [B, T, Q] at the drawn positions."""
        return torch.from_numpy(self.eps.actions_ELK[e_B1, steps_BT]), torch.from_numpy(self.proprio_ELQ[e_B1, steps_BT])

    def sample(self, batch_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A batch: frames [B, T, 3, H, W], actions [B, T, K], proprio features [B, T, Q]."""
        e, steps = self.draw(batch_size, gen)
        return frames_to_tensor(self.eps.frames_ELHWC[e, steps]), *self.gather(e, steps)
