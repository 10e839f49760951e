"""Federation checkpoints: bitwise round trip, every kind of damage refused, crash-safe commit, SIGKILL resume."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from lensemble.errors import IntegrityError
from lensemble.federation import checkpoint as ck
from lensemble.federation.checkpoint import (FederationCheckpoint, capture_rng, commit_site_state, load_checkpoint, prune_site_states,
                                             restore_rng, restore_sites, save_checkpoint)
from lensemble.federation.outer import state_hash

REPO = Path(__file__).resolve().parents[1]
RUN = "run-0123456789ab"


def _key(tmp_path: Path) -> Path:
    """The coordinator key of a test (created by the first save)."""
    return tmp_path / "keys" / "coordinator.hmac"


def _site_state(path: Path, seed: int) -> Path:
    """A site working state in `site_train`'s format: model and AdamW state dicts."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return path


def _checkpoint(tmp_path: Path, round_idx: int = 3, momentum: bool = True) -> FederationCheckpoint:
    gen = torch.Generator().manual_seed(round_idx)
    params = {"encoder.w": torch.randn(5, 7, generator=gen), "predictor.b": torch.randn(11, generator=gen).double()}
    refs = {s: commit_site_state(_site_state(tmp_path / "work" / f"{s}.pt", i), tmp_path / "sites" / s, round_idx - 1) for i, s in enumerate(["site_a", "site_b"])}
    mom = {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in params.items()} if momentum else None
    history = [{"round": r, "seconds": 0.1 * r + 1 / 3, "sites": {"site_a": {"loss/pred": float("nan")}}} for r in range(round_idx)]
    return FederationCheckpoint(RUN, round_idx, params, mom, refs, capture_rng(), history)


def _same(a: FederationCheckpoint, b: FederationCheckpoint) -> None:
    assert (a.run_id, a.round_idx, a.site_states.keys()) == (b.run_id, b.round_idx, b.site_states.keys())
    assert state_hash(a.global_params) == state_hash(b.global_params)
    assert (a.momentum is None and b.momentum is None) or state_hash(a.momentum) == state_hash(b.momentum)
    assert torch.equal(a.rng.torch_state, b.rng.torch_state) and a.rng.numpy_state == b.rng.numpy_state and a.rng.python_state == b.rng.python_state
    assert {s: (r.path.resolve(), r.sha256, r.round_idx) for s, r in a.site_states.items()} == {s: (r.path, r.sha256, r.round_idx) for s, r in b.site_states.items()}
    assert repr(a.history) == repr(b.history)  # repr: NaN != NaN, and floats must come back exactly


@pytest.mark.parametrize("momentum", [True, False])
def test_round_trip_is_bitwise(tmp_path, momentum):
    ckpt = _checkpoint(tmp_path, momentum=momentum)
    save_checkpoint(tmp_path / "coord" / "fed.ckpt", ckpt, _key(tmp_path))
    back = load_checkpoint(tmp_path / "coord" / "fed.ckpt", expected_run=RUN, key_path=_key(tmp_path))
    _same(ckpt, back)
    assert back.global_params["predictor.b"].dtype == torch.float64


def test_missing_checkpoint_is_a_fresh_start(tmp_path):
    assert load_checkpoint(tmp_path / "none.ckpt", expected_run=RUN, key_path=_key(tmp_path)) is None


def test_rng_states_restore_exactly():
    outer = capture_rng()
    try:
        torch.manual_seed(1)
        np.random.seed(1)
        random.seed(1)
        np.random.normal(), random.gauss(0, 1)  # cached gaussians are part of the state
        state = capture_rng()
        first = (torch.rand(3), np.random.normal(size=3), random.gauss(0, 1), random.random())
        restore_rng(state)
        again = (torch.rand(3), np.random.normal(size=3), random.gauss(0, 1), random.random())
        assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1]) and first[2:] == again[2:]
    finally:
        restore_rng(outer)


def test_unserialisable_history_is_a_clear_error(tmp_path):
    ckpt = _checkpoint(tmp_path)
    ckpt.history.append({"loss": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="JSON-serialisable"):
        save_checkpoint(tmp_path / "fed.ckpt", ckpt, _key(tmp_path))
    assert not (tmp_path / "fed.ckpt").exists()


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {
    "flip_header": lambda p, c: _flip(p, 5),
    "flip_meta": lambda p, c: _flip(p, p.read_bytes().index(b"\n") + 10),
    "flip_tensor": lambda p, c: _flip(p, p.stat().st_size - 100),
    "truncate": lambda p, c: p.write_bytes(p.read_bytes()[:-7]),
    "truncate_to_header": lambda p, c: p.write_bytes(p.read_bytes()[: p.read_bytes().index(b"\n")]),
    "append": lambda p, c: p.write_bytes(p.read_bytes() + b"\0"),
    "empty": lambda p, c: p.write_bytes(b""),
    "site_missing": lambda p, c: c.site_states["site_b"].path.unlink(),
    "site_modified": lambda p, c: _flip(c.site_states["site_a"].path, 40),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_checkpoint_is_refused_naming_the_file(tmp_path, damage):
    path = tmp_path / "fed.ckpt"
    ckpt = _checkpoint(tmp_path)
    save_checkpoint(path, ckpt, _key(tmp_path))
    DAMAGE[damage](path, ckpt)
    with pytest.raises(IntegrityError, match=str(path)) as info:
        load_checkpoint(path, expected_run=RUN, key_path=_key(tmp_path))
    if damage.startswith("site"):
        assert "site_" in str(info.value)


def test_wrong_run_is_refused(tmp_path):
    path = tmp_path / "fed.ckpt"
    save_checkpoint(path, _checkpoint(tmp_path), _key(tmp_path))
    with pytest.raises(IntegrityError, match=f"{path}.*belongs to run '{RUN}'"):
        load_checkpoint(path, expected_run="another-run", key_path=_key(tmp_path))


def test_crash_between_temp_write_and_rename_keeps_previous(tmp_path, monkeypatch):
    path = tmp_path / "fed.ckpt"
    before = _checkpoint(tmp_path, round_idx=2)
    save_checkpoint(path, before, _key(tmp_path))
    after = _checkpoint(tmp_path, round_idx=3)  # site snapshots of round 2 committed, as in the protocol

    def crash(src, dst):
        raise OSError("simulated power loss before rename")

    monkeypatch.setattr(ck.os, "replace", crash)
    with pytest.raises(OSError, match="power loss"):
        save_checkpoint(path, after, _key(tmp_path))
    monkeypatch.undo()
    assert list(tmp_path.glob(".fed.ckpt.tmp-*")), "the temporary file is what a crash leaves"
    _same(before, load_checkpoint(path, expected_run=RUN, key_path=_key(tmp_path)))
    save_checkpoint(path, _checkpoint(tmp_path, round_idx=4), _key(tmp_path))  # the next commit clears the leftover
    assert not list(tmp_path.glob(".fed.ckpt.tmp-*"))
    assert load_checkpoint(path, expected_run=RUN, key_path=_key(tmp_path)).round_idx == 4


def test_site_snapshots_restore_and_prune(tmp_path):
    work = _site_state(tmp_path / "work" / "a.pt", 0)
    ref1 = commit_site_state(work, tmp_path / "site_a", 1)
    committed = work.read_bytes()
    _site_state(work, 1)  # the round in flight overwrites the working file...
    ref2 = commit_site_state(work, tmp_path / "site_a", 2)
    assert prune_site_states(tmp_path / "site_a", keep=ref2) == [ref1.path]
    _site_state(work, 2)
    ckpt = FederationCheckpoint(RUN, 3, {"w": torch.zeros(1)}, None, {"site_a": ref2}, capture_rng())
    restore_sites(ckpt, {"site_a": work, "site_b": tmp_path / "work" / "b.pt"})
    assert work.read_bytes() == ref2.path.read_bytes() != committed
    (tmp_path / "work" / "b.pt").write_bytes(b"left by the crashed round")
    restore_sites(ckpt, {"site_b": tmp_path / "work" / "b.pt"})  # no committed state: start fresh
    assert not (tmp_path / "work" / "b.pt").exists()


# A toy DiLoCo loop with the commit protocol of checkpoint.py's docstring: 2 sites, a linear model,
# H AdamW steps per round, the real outer Nesterov step. Randomness comes from two sources, so the
# test covers both ways a resumed run can reproduce it: site batches from seeds derived per (round,
# site) (lensemble.seeds.generator, as the real site_train does), and coordinator noise drawn from
# the global torch / numpy / random RNGs, reproducible only because the checkpoint restores them.
# TOY_PAUSE="round:k" sleeps after round k's site training (working state files already overwritten);
# "commit:k" sleeps after round k's checkpoint is written to its temporary file, before the rename.
TOY = textwrap.dedent('''
    import os, random, sys, time
    from pathlib import Path
    import numpy as np
    import torch
    from lensemble.federation import checkpoint as ck
    from lensemble.federation.outer import nesterov_step, state_hash
    from lensemble.seeds import generator

    RUN, SITES, H = "toy-run", ("site_a", "site_b"), 4


    def site_train(work, site, r, global_params):
        model = torch.nn.Linear(8, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        if work.is_file():
            saved = torch.load(work, weights_only=True)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
        model.load_state_dict(global_params)
        gen = generator(7, "toy/batches", r, site)
        scale = 1.0 if site == "site_a" else -0.5
        for _ in range(H):
            x = torch.randn(16, 8, generator=gen)
            y = scale * x[:, :2] + 0.1 * torch.randn(16, 2, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        work.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, work)
        return {k: v - global_params[k] for k, v in model.state_dict().items()}


    def main(root, rounds, pause):
        torch.set_num_threads(1)
        ckpt_path = root / "coordinator" / "federation.ckpt"
        work = {s: root / "work" / s / "state.pt" for s in SITES}
        snapshots = {s: root / "sites" / s / "checkpoints" for s in SITES}
        key = root / "keys" / "coordinator.hmac"
        ckpt = ck.load_checkpoint(ckpt_path, expected_run=RUN, key_path=key)
        ck.restore_sites(ckpt, work)
        if ckpt is None:
            torch.manual_seed(0); np.random.seed(0); random.seed(0)
            params, momentum, refs, history, start = dict(torch.nn.Linear(8, 2).state_dict()), None, {}, [], 0
        else:
            ck.restore_rng(ckpt.rng)
            params, momentum, refs, history, start = ckpt.global_params, ckpt.momentum, ckpt.site_states, ckpt.history, ckpt.round_idx
        print(f"start {start}", flush=True)
        for r in range(start, rounds):
            deltas = [site_train(work[s], s, r, params) for s in SITES]
            if pause == ["round", str(r)]:
                print(f"paused in round {r}", flush=True); time.sleep(120)
            mean = {k: sum(d[k] for d in deltas) / len(deltas) for k in params}
            noise = 1e-3 * (torch.rand(()) + float(np.random.normal()) + random.gauss(0.0, 1.0))
            mean = {k: v + noise for k, v in mean.items()}
            params, momentum = nesterov_step(params, mean, momentum, lr=0.7, momentum=0.9)
            history.append({"round": r, "noise": float(noise)})
            refs = {s: ck.commit_site_state(work[s], snapshots[s], r) for s in SITES}
            if pause == ["commit", str(r)]:
                real_replace = os.replace
                def slow_replace(src, dst):
                    print(f"paused in commit {r}", flush=True); time.sleep(120); real_replace(src, dst)
                os.replace = slow_replace
            ck.save_checkpoint(ckpt_path, ck.FederationCheckpoint(RUN, r + 1, params, momentum, refs, ck.capture_rng(), history), key)
            for s in SITES:
                ck.prune_site_states(snapshots[s], keep=refs[s])
            print(f"round {r} done", flush=True)
        print(f"final {state_hash(params)} {len(history)}", flush=True)


    if __name__ == "__main__":
        main(Path(sys.argv[1]), int(sys.argv[2]), os.environ.get("TOY_PAUSE", "none:-1").split(":"))
''')
TOY_ROUNDS = 5


def _start_toy(tmp_path: Path, root: Path, pause: str | None) -> subprocess.Popen:
    script = tmp_path / "toy_diloco.py"
    script.write_text(TOY)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOY_PAUSE": pause or "none:-1"}
    return subprocess.Popen([sys.executable, str(script), str(root), str(TOY_ROUNDS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finish_toy(proc: subprocess.Popen, pause: str | None = None) -> list[str]:
    """Read the toy's stdout to the end, or SIGKILL it as soon as it reports being paused; its lines."""
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if pause is not None and lines[-1].startswith("paused"):
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    if pause is None:
        assert proc.returncode == 0, proc.stderr.read()
    else:
        assert proc.returncode == -signal.SIGKILL, (lines, proc.stderr.read())
    return lines


def _toy(tmp_path: Path, root: Path, pause: str | None = None) -> list[str]:
    return _finish_toy(_start_toy(tmp_path, root, pause), pause)


def test_sigkill_mid_round_and_mid_commit_resume_bitwise(tmp_path):
    crashed = tmp_path / "crashed"
    lines = _toy(tmp_path, crashed, pause="round:2")  # killed in round 2, after the sites trained
    assert lines == ["start 0", "round 0 done", "round 1 done", "paused in round 2"]
    snapshot = crashed / "sites" / "site_a" / "checkpoints" / "round-000001.pt"
    assert snapshot.read_bytes() != (crashed / "work" / "site_a" / "state.pt").read_bytes(), "the crash left a dirty working state"

    lines = _toy(tmp_path, crashed, pause="commit:3")  # resumes at 2, killed between temp write and rename of round 3
    assert lines == ["start 2", "round 2 done", "paused in commit 3"]
    assert list((crashed / "coordinator").glob(".federation.ckpt.tmp-*"))

    lines = _toy(tmp_path, crashed)
    # The reference runs in its own process too: in the test process, threads left by earlier tests
    # (Prefect clients, timed-out site tasks) may draw from the global `random`/numpy/torch RNGs while
    # it runs, which changed its result in 2 of 5 full-suite runs.
    reference = _toy(tmp_path, tmp_path / "uninterrupted")
    assert reference[0] == "start 0" and reference[-1].endswith(f" {TOY_ROUNDS}")
    assert lines[0] == "start 3" and lines[-1] == reference[-1]  # same state_hash, same history length
    assert sorted(p.name for p in (crashed / "sites" / "site_b" / "checkpoints").iterdir()) == [f"round-{TOY_ROUNDS - 1:06d}.pt"]
