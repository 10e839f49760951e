"""One site's inner loop, data-parallel over the processes `torchrun` starts (gloo, CPU).

    torchrun --standalone --nproc_per_node=2 scripts/ddp_train.py --root PROJECT --site SITE --steps N --out state.pt

Refuses to start (exit 7, one line) when the run's pre-flight estimate exceeds a ceiling in
params.yaml, as every training stage does. Reads the site's episodes and params from the project at --root; starts from --state (a
{"model", "optimizer"} file as tasks.train.site_train writes it) if given, then loads --global (the
round's federated parameters) if given; trains with `lensemble.distributed.ddp_train_steps`, the
anchor target being the public probe embedded by the encoder at the start (as the coordinator
computes it from the global parameters) and the steps counted as round --round of the federation
(steps r·H .. of federate.rounds x inner_steps: the scheduled learning rate and train.freeze_encoder_at as
site_train applies them; a round that would run past the federation is refused with one line); rank 0 writes the new state to --out in site_train's
format, atomically, and prints one JSON line of losses and timings. --strategy fsdp shards with
FSDP2 instead of replicating (for configs whose model + AdamW moments do not fit one device).
"""
from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file by torchrun, from any cwd

from lensemble.config import load_params  # noqa: E402
from lensemble.errors import ConfigError, LensembleError  # noqa: E402
from lensemble.observability.hardware import hardware_class  # noqa: E402
from tasks.preflight import preflight  # noqa: E402
from lensemble.distributed import ddp_train_steps, full_state, load_optimizer_state, shard_fsdp  # noqa: E402
from lensemble.federation.checkpoint import atomic_write  # noqa: E402
from lensemble.model.world_model import load_federated  # noqa: E402
from lensemble.paths import Layout  # noqa: E402
from lensemble.training import encode_frames, make_optimizer  # noqa: E402
from lensemble.workflow import build_model, load_site, probe_frames, sampler_for, site_embodiment  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", type=Path, required=True, help="project root (params.yaml, data/)")
    ap.add_argument("--site", required=True, help="site id from params.yaml")
    ap.add_argument("--steps", type=int, default=None, help="inner steps (default: federate.inner_steps)")
    ap.add_argument("--round", type=int, default=0, dest="round_idx", help="round index: keys the batch and SIGReg seeds")
    ap.add_argument("--state", type=Path, default=None, help="site state to start from (site_train format)")
    ap.add_argument("--global", type=Path, default=None, dest="global_state", help="federated parameters to load before training")
    ap.add_argument("--no-anchor", action="store_true", help="train without the probe anchor term")
    ap.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: run.torch_threads / world size)")
    ap.add_argument("--out", type=Path, required=True, help="where rank 0 writes the new site state")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        params = load_params(args.root / "params.yaml")
        layout = Layout(args.root)
        # the pre-flight every training launch passes: BudgetExceeded before any process group or step
        preflight.fn(params, layout, "federate", hardware_class(params.run.hardware_class))
        steps, H = args.steps if args.steps is not None else params.federate.inner_steps, params.federate.inner_steps
        if args.round_idx * H + steps > params.federate.rounds * H:
            raise ConfigError(f"--round {args.round_idx} with --steps {steps} runs past the federation's federate.rounds x inner_steps = "
                              f"{params.federate.rounds * H} steps: lower --steps or --round")
    except LensembleError as exc:
        print(f"ddp_train: error: {exc}", file=sys.stderr)
        return exc.exit_code
    dist.init_process_group("gloo")  # the inner loop runs on CPU tensors (as train_steps does); NCCL needs a device placement first
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads or max(1, params.run.torch_threads // world))
    try:
        model = build_model(params, f"site/{args.site}")
        saved = torch.load(args.state, weights_only=True) if args.state else None
        if saved is not None:
            model.load_state_dict(saved["model"])
        if args.global_state is not None:
            load_federated(model, torch.load(args.global_state, weights_only=True))
        if args.strategy == "fsdp":
            shard_fsdp(model)
        opt = make_optimizer(model, params.train)  # after sharding: FSDP's AdamW holds sharded moments
        if saved is not None:
            load_optimizer_state(model, opt, saved["optimizer"])
        probe = global_probe = None
        if not args.no_anchor:
            probe = probe_frames(layout, params)
            global_probe = encode_frames(model, probe)
        sampler = sampler_for(load_site(layout, params, args.site), params)
        t0 = time.perf_counter()  # round r's steps are steps r·H .. of the federation's rounds·H, as site_train counts them
        log = ddp_train_steps(model, opt, [(site_embodiment(params, args.site), sampler)], steps, train=params.train, objective=params.objective,
                              run_seed=params.run.seed, round_idx=args.round_idx, data_key=args.site, probe_PCHW=probe, global_probe_PND=global_probe,
                              schedule=(args.round_idx * H, params.federate.rounds * H))
        seconds = time.perf_counter() - t0
        state = full_state(model, opt)
        if rank == 0:
            buf = io.BytesIO()
            torch.save(state, buf)
            atomic_write(args.out, buf.getvalue())
            print(json.dumps({"site": args.site, "world_size": world, "strategy": args.strategy, "steps": steps, "train_seconds": seconds,
                              "losses": {"pred": log.pred, "sigreg": log.sigreg, "anchor": log.anchor}}), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
