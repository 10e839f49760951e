"""Data-path benchmarks: window loader, episode generation, residency-guard cost per round.

Pure functions returning plain dicts of numbers (they write only to a temporary folder); `main`
prints each figure beside its target and, where one applies, its physical limit:

    python -m benchmarks.data             # full size (~1-2 min on 2 cores)
    python -m benchmarks.data --quick     # small counts, seconds

- loader: `WindowSampler.sample` windows/s (64x64, 4 frames, batch 64); the bytes it moves
  (uint8 gather read + write, lookup read + float32 write) per second against one-thread memory
  copy bandwidth (`perf.copy_bandwidth`, bytes read + written): both run on one core.
- generation: one process, sites one after another (pusht, mujoco_point, mujoco_reacher,
  48 episodes x 32 steps at 64x64 by default), each with its Parquet write, manifest and private
  index, plus one public probe per embodiment, as the prepare stage does.
- guard: one federated inner round (`train_steps` with params.yaml's model, objective and
  `federate.inner_steps`) against what the guard adds per site and round: loading the stored
  private index, adding the action head, and releasing every message the site sends in a round, as
  `tasks.train.site_train` and the exchange protocol do: the update, the metrics, the probe
  embedding, the task-seconds metric, and the transport's key share, announcement and update
  payload (params' `federate.transport`, one codec playing both parties). Separately: the
  coordinator's leak scan of one round's exchange tree (global parameters, the site's train.pt and
  its messages) against the site's index (`tasks.residency.check_exchange_tree`, per site and round).

    python -m benchmarks.data --guard-only    # the guard figure alone (one inner round at params.yaml)
"""
from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from lensemble.data.audit import PrivateIndex, fingerprints, index_path
from lensemble.data.episodes import Episodes, data_manifest, generate_episodes, write_episodes
from lensemble.data.residency import ResidencyGuard
from lensemble.data.windows import WindowSampler
from lensemble.perf import best_seconds, copy_bandwidth
from lensemble.sim.registry import make_embodiment

DEFAULT_SITES = (("site_a", "pusht"), ("site_b", "mujoco_point"), ("site_c", "mujoco_reacher"))


def synthetic_episodes(episodes: int = 48, length: int = 32, image_size: int = 64, action_dim: int = 2, seed: int = 0) -> Episodes:
    """Random episodes of a given size: the loader's cost does not depend on pixel content."""
    rng = np.random.default_rng(seed)
    return Episodes(
        "synthetic",
        rng.integers(0, 256, (episodes, length, image_size, image_size, 3), dtype=np.uint8),
        rng.uniform(-1, 1, (episodes, length, action_dim)).astype(np.float32),
        rng.standard_normal((episodes, length, 4)).astype(np.float32),
    )


def bench_loader(image_size: int = 64, num_steps: int = 4, batch: int = 64, episodes: int = 48, length: int = 32, batches: int = 40) -> dict[str, float]:
    """Windows/s of `WindowSampler.sample` and the bytes it moves per second vs copy bandwidth."""
    sampler = WindowSampler(synthetic_episodes(episodes, length, image_size), num_steps, proprio_width=16, scale=(1.0,) * 4)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        sampler.sample(batch, gen)  # warm the allocator
    seconds = best_seconds(lambda: [sampler.sample(batch, gen) for _ in range(batches)], 3) / batches
    pixels = num_steps * image_size * image_size * 3
    moved = pixels * (1 + 1) + pixels * (1 + 4)  # gather: read + write uint8; lookup: read uint8, write float32
    copy = copy_bandwidth(256 << 20)
    return {
        "windows_per_s": batch / seconds,
        "batch_ms": 1e3 * seconds,
        "bytes_moved_per_window": float(moved),
        "moved_gbps": batch * moved / seconds / 1e9,
        "copy_gbps": copy / 1e9,
        "fraction_of_copy_bandwidth": batch * moved / seconds / copy,
    }


def bench_generation(sites: Sequence[tuple[str, str]] = DEFAULT_SITES, episodes: int = 48, length: int = 32, image_size: int = 64,
                     probe_episodes: int = 4, seed: int = 0, out_dir: Path | None = None) -> tuple[dict[str, float], dict[str, Episodes]]:
    """Seconds to generate, store and index every site (and probe), one process; also the episodes."""
    out: dict[str, float] = {}
    made: dict[str, Episodes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(out_dir or tmp)
        t_all = time.perf_counter()
        for site, emb in sites:
            t0 = time.perf_counter()
            env = make_embodiment(emb, image_size)
            eps = generate_episodes(env, seed, f"site/{site}", episodes, length, 0.5, 0.3, 8)
            env.close()
            t1 = time.perf_counter()
            store = root / site / "episodes.parquet"
            write_episodes(eps, store)
            data_manifest(eps, store)
            t2 = time.perf_counter()
            fingerprints(eps).save(index_path(store))
            t3 = time.perf_counter()
            out |= {f"{site}.simulate_s": t1 - t0, f"{site}.store_s": t2 - t1, f"{site}.index_s": t3 - t2,
                    f"{site}.ms_per_step": 1e3 * (t1 - t0) / (episodes * length)}
            made[site] = eps
        t0 = time.perf_counter()
        for emb in sorted({e for _, e in sites}):
            env = make_embodiment(emb, image_size)
            probe = generate_episodes(env, seed, f"public-probe/{emb}", probe_episodes, length, 0.5, 0.3, 8)
            env.close()
            write_episodes(probe, root / "probe" / f"{emb}.parquet")
        out["probe_s"] = time.perf_counter() - t0
        out["total_s"] = time.perf_counter() - t_all
        out["steps"] = float(len(sites) * episodes * length)
    return out, made


def bench_guard(params_path: Path | str = "params.yaml", repeats: int = 3) -> dict[str, float]:
    """One inner round at params.yaml vs the guard's added work for one site in that round."""
    from lensemble.config import load_params
    from lensemble.data.audit import scan_blobs
    from lensemble.federation.exchange import pack_tensors
    from lensemble.federation.transport import RoundContext, param_spec
    from lensemble.federation.transports import make_transport
    from lensemble.gauge import drift, pool_tokens
    from lensemble.model.world_model import federated_state, local_state
    from lensemble.training import encode_frames, make_optimizer, train_steps
    from lensemble.workflow import build_model
    from lensemble.data.windows import frames_to_tensor

    p = load_params(Path(params_path))
    torch.set_num_threads(p.run.torch_threads)
    site = p.data.sites[0]
    d = p.data
    env = make_embodiment(site.embodiment, d.image_size)
    eps = generate_episodes(env, p.run.seed, f"site/{site.name}", site.episodes, d.episode_length, d.expert_noise, d.random_fraction, d.segment_length)
    env.close()
    probe = frames_to_tensor(eps.frames_ELHWC[:2].reshape(-1, *eps.frames_ELHWC.shape[2:]))  # stands in for P: same size class
    model = build_model(p, f"site/{site.name}")
    opt = make_optimizer(model, p.train)
    global_state = federated_state(model)
    global_probe = encode_frames(model, probe)
    t0 = time.perf_counter()
    log = train_steps(model, opt, [(site.embodiment, WindowSampler(eps, d.num_steps, p.model.proprio_dim))], p.federate.inner_steps, train=p.train,
                      objective=p.objective, run_seed=p.run.seed, round_idx=0, data_key=site.name, probe_PCHW=probe, global_probe_PND=global_probe)
    round_s = time.perf_counter() - t0
    local = federated_state(model)
    delta = {n: local[n] - global_state[n] for n in sorted(global_state)}
    spec = param_spec(global_state)
    site_probe = pool_tokens(encode_frames(model, probe))
    metrics = {**log.mean(), "train_seconds": round_s, "steps": p.federate.inner_steps,
               **{f"gauge/{k}": v for k, v in drift(site_probe, pool_tokens(global_probe)).items()}}
    peer = "bench_peer"
    codec = make_transport(p.federate.transport, p.federate.quant_block)  # one object plays both sites
    ctx = RoundContext("bench", 0, tuple(sorted((site.name, peer))), spec)
    codec.begin_round(ctx)
    key_share = codec.key_share(ctx, site.name)
    anns = {s: codec.announce(ctx, s, {n: (1.0 if s == site.name else -0.5) * t for n, t in delta.items()}) for s in ctx.site_ids}
    codec.agree(ctx, anns)
    payload = codec.encode(ctx, site.name, delta)
    messages = [key_share, anns[site.name], payload]
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "episodes.parquet"
        t0 = time.perf_counter()
        fingerprints(eps).save(index_path(store))
        index_build_s = time.perf_counter() - t0

        def guarded_round() -> None:
            index = PrivateIndex.load(index_path(store)).with_tensors(local_state(model))
            guard = ResidencyGuard(site.name, spec, Path(tmp) / "audit.jsonl", probe_rows=site_probe.shape[0], private=index,
                                   probe_dim=model.latent_dim)
            guard.release("update", delta)
            released = guard.release("metrics", metrics)
            embedding = guard.release("public_probe_embedding", site_probe)
            guard.release("metrics", {"task_seconds": round_s})
            for blob in messages:  # payloads go through the site's payload guard (a fresh one per message in local mode)
                guard.release("payload", blob, expected_size=len(blob))
            released_now.update(metrics=released, probe_embedding=embedding)

        released_now: dict = {}
        guard_s = best_seconds(guarded_round, repeats)  # the guard's work only: serialising for the exchange is not in it
        tree = {"global.pt": pack_tensors({"state": global_state, "global_probe": global_probe}),
                "train.pt": pack_tensors({**released_now, "task_seconds": round_s})}
        tree.update({"a0/site.key": key_share, "a0/site.ann": anns[site.name], "a0/site.upd": payload})
        indexes = {site.name: PrivateIndex.load(index_path(store))}
        tree_scan_s = best_seconds(lambda: scan_blobs(tree.items(), indexes), repeats)
        assert not scan_blobs(tree.items(), indexes)
        update_s = best_seconds(lambda: ResidencyGuard(site.name, spec, None, private=PrivateIndex.load(index_path(store))).release("update", delta), repeats)
        unscanned_s = best_seconds(lambda: ResidencyGuard(site.name, spec, None).release("update", delta), repeats)
    numel = sum(t.numel() for t in delta.values())
    return {
        "round_s": round_s,
        "inner_steps": float(p.federate.inner_steps),
        "image_size": float(d.image_size),
        "federated_params": float(numel),
        "payload_bytes": float(len(payload)),
        "guard_s": guard_s,
        "guard_fraction_of_round": guard_s / round_s,
        "exchange_tree_bytes": float(sum(len(b) for b in tree.values())),
        "exchange_tree_scan_s": tree_scan_s,
        "exchange_tree_scan_fraction_of_round": tree_scan_s / round_s,
        "update_release_s": update_s,
        "update_release_without_index_s": unscanned_s,
        "scan_mbps": (4 * numel + len(payload)) / max(guard_s, 1e-9) / 1e6,
        "index_build_s_at_prepare": index_build_s,
        "index_keys": float(len(fingerprints(eps))),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small counts: a smoke run in seconds")
    ap.add_argument("--params", default="params.yaml", help="params for the guard's round (default params.yaml)")
    ap.add_argument("--guard-only", action="store_true", help="only the guard's cost against one inner round")
    args = ap.parse_args(argv)
    if args.guard_only:
        return {"guard": _print_guard(bench_guard(args.params))}
    episodes, batches = (4, 5) if args.quick else (48, 40)
    loader = bench_loader(episodes=episodes, batches=batches)
    print(f"loader     {loader['windows_per_s']:9.0f} windows/s  (target >= 2000; 64x64, 4 frames, batch 64; {loader['batch_ms']:.1f} ms/batch)")
    print(f"           {loader['moved_gbps']:9.2f} GB/s moved = {100 * loader['fraction_of_copy_bandwidth']:.0f}% of one-thread copy bandwidth {loader['copy_gbps']:.2f} GB/s")
    gen, _ = bench_generation(episodes=episodes)
    print(f"generation {gen['total_s']:9.1f} s for {gen['steps']:.0f} steps in 3 sites + probes (target <= 120 s, one process)")
    for site, emb in DEFAULT_SITES:
        print(f"           {site} {emb:15s} simulate {gen[f'{site}.simulate_s']:5.1f} s ({gen[f'{site}.ms_per_step']:.2f} ms/step), "
              f"store {gen[f'{site}.store_s']:4.2f} s, index {gen[f'{site}.index_s']:4.2f} s")
    guard = _print_guard(bench_guard(args.params))
    return {"loader": loader, "generation": gen, "guard": guard}


def _print_guard(guard: dict[str, float]) -> dict[str, float]:
    print(f"guard      {1e3 * guard['guard_s']:9.1f} ms per site and round = {100 * guard['guard_fraction_of_round']:.2f}% of a "
          f"{guard['round_s']:.1f} s round (target <= 1%; {guard['inner_steps']:.0f} inner steps, {guard['federated_params']:.0f} params, "
          f"{guard['image_size']:.0f}px)")
    print(f"           update alone {1e3 * guard['update_release_s']:.1f} ms with the index, {1e3 * guard['update_release_without_index_s']:.1f} ms "
          f"without; index build at prepare {guard['index_build_s_at_prepare']:.2f} s ({guard['index_keys']:.0f} keys)")
    print(f"           exchange-tree leak scan {1e3 * guard['exchange_tree_scan_s']:.1f} ms per site and round "
          f"({guard['exchange_tree_bytes'] / 1e6:.2f} MB) = {100 * guard['exchange_tree_scan_fraction_of_round']:.2f}% of the round")
    return guard


if __name__ == "__main__":
    main()
