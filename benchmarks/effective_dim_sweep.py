"""How the SIGReg settings and the latent width move the effective dimension (issue 6 exploration).

    python benchmarks/effective_dim_sweep.py ROOT STEPS SPEC [SPEC ...]

ROOT is a project whose `prepare` stage has run (e.g. the examples/grid-four-sites config). Each
SPEC is `encoder:sigreg_on:sigreg_weight:sketch_dim:sigreg_tokens` (encoder: any
`model.encoder` name, e.g. micro, nano32, nano16, nano8). For each, the Stage A model is
trained STEPS steps on the pooled sites from the same seed, and the script prints the mean
prediction and SIGReg losses, the first and last SIGReg values, and RankMe / participation ratio
of the public probe's per-frame (token-mean) embeddings, which is what `gauge/effective_dim`
measures, and RankMe of the token embeddings.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lensemble.model.sizes import VIT_CONFIGS  # noqa: E402
from lensemble.config import load_params  # noqa: E402
from lensemble.gauge import effective_dim, pool_tokens  # noqa: E402
from lensemble.paths import Layout  # noqa: E402
from lensemble.training import encode_frames, make_optimizer, train_steps  # noqa: E402
from lensemble.workflow import build_model, load_site, probe_frames, sampler_for, site_embodiment, site_names  # noqa: E402


def main() -> None:
    root, steps = Path(sys.argv[1]), int(sys.argv[2])
    base = load_params(root / "params.yaml")
    layout = Layout(root)
    probe = probe_frames(layout, base)
    torch.set_num_threads(base.run.torch_threads)
    for spec in sys.argv[3:]:
        enc, mode, weight, sketch, tokens = spec.split(":")
        objective = base.objective.model_copy(update={"sigreg_on": mode, "sigreg_weight": float(weight), "sketch_dim": int(sketch),
                                                      "sigreg_tokens": int(tokens)})
        p = base.model_copy(update={"objective": objective, "model": base.model.model_copy(update={"encoder": enc})})
        model = build_model(p, "centralized")
        samplers = [(site_embodiment(p, s), sampler_for(load_site(layout, p, s), p)) for s in site_names(p)]
        t0 = time.perf_counter()
        log = train_steps(model, make_optimizer(model, p.train), samplers, steps, train=p.train, objective=p.objective, run_seed=p.run.seed,
                          round_idx=-1, data_key="pooled")
        z = encode_frames(model, probe)
        pooled, tok = effective_dim(pool_tokens(z)), effective_dim(z.flatten(0, 1))
        width = VIT_CONFIGS[enc].width
        print(f"{spec}: pred {log.mean()['loss/pred']:.3f} sigreg {log.mean()['loss/sigreg']:.1f} (first {log.sigreg[0]:.1f}, last {log.sigreg[-1]:.1f})"
              f" | probe RankMe {pooled['rankme']:.1f}/{width} = {pooled['rankme'] / width:.0%}, PR {pooled['participation_ratio']:.1f}"
              f" | token RankMe {tok['rankme']:.1f} | {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
