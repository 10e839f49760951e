"""The worker pool that splits the thread budget into processes (orchestration/workers.py)."""
from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

import pytest
import torch

from lensemble.errors import DataError
from orchestration.workers import (
    CoreShare,
    InlinePool,
    WorkerPool,
    background_pool,
    makespan,
    thread_split,
)
from tests.conftest import micro_params


def _worker_facts(n: int) -> tuple[int, int, float]:
    """(pid, torch threads, a float computed there) — run in a worker."""
    logging.getLogger("lensemble.progress").info("working on %d", n)
    logging.getLogger("lensemble.progress").debug("not at INFO: stays in the worker")
    return os.getpid(), torch.get_num_threads(), float(torch.arange(n, dtype=torch.float32).sum())


def _fails(what: str) -> None:
    logging.getLogger("lensemble.progress").warning("about to fail on %s", what)
    raise DataError(f"site store {what} is truncated: regenerate it (lensemble run prepare)")


@pytest.mark.parametrize("threads, workers, expected", [
    (2, "auto", (2, 1)), (8, "auto", (8, 1)), (8, 2, (2, 4)), (8, 3, (3, 2)), (2, 4, (2, 1)), (1, "auto", (1, 1)), (4, 1, (1, 4)),
])
def test_thread_split_never_exceeds_the_budget(threads, workers, expected):
    n, each = thread_split(threads, workers)
    assert (n, each) == expected
    assert n * each <= threads


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2, 1, warm=("orchestration.site_work",))
    p.wait_ready()  # both workers started and imported it
    yield p
    p.close()


def test_calls_run_in_other_processes_with_their_thread_share(pool, caplog):
    caplog.set_level(logging.INFO, logger="lensemble.progress")
    results = [pool.call(_worker_facts, n) for n in (10, 100, 1000)]
    assert all(pid != os.getpid() for pid, _, _ in results)
    assert {threads for _, threads, _ in results} == {1}
    assert [total for _, _, total in results] == [45.0, 4950.0, 499500.0]
    messages = [r.getMessage() for r in caplog.records if r.name == "lensemble.progress"]
    assert messages == ["working on 10", "working on 100", "working on 1000"]  # relayed in order, DEBUG left behind


def _tensor_facts(state: dict, other: dict) -> dict:
    """What a worker received: per argument, each tensor's (name, shape, dtype, bytes) and how many storages hold them."""
    def facts(d: dict) -> tuple[list, int]:
        return ([(k, tuple(t.shape), str(t.dtype), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
                 for k, t in d.items()], len({t.untyped_storage().data_ptr() for t in d.values() if t.numel()}))
    return {"state": facts(state), "other": facts(other), "type": type(state).__name__}


def test_a_state_crosses_to_a_worker_as_one_buffer_per_dtype_with_every_bit_kept(pool):
    """A dict of contiguous CPU tensors travels packed (one storage per dtype in the worker, not one segment per tensor);
    names, order, shapes, dtypes and bytes arrive unchanged. A dict with a strided view travels as it is."""
    g = torch.Generator().manual_seed(0)
    state = {"z.weight": torch.randn(5, 3, generator=g), "a.bias": torch.randn(3, generator=g), "count": torch.tensor(7),
             "scale": torch.tensor(0.5, dtype=torch.float64), "empty": torch.zeros(0, 4), "ids": torch.arange(6).view(2, 3),
             "nan": torch.tensor([float("nan"), -0.0, float("inf")])}
    strided = {"t": torch.randn(4, 6, generator=g).t(), "u": torch.randn(2, generator=g)}
    sent = _tensor_facts(state, strided)
    got = pool.call(_tensor_facts, state, other=strided)
    assert got["state"][0] == sent["state"][0] and got["other"][0] == sent["other"][0]
    assert got["type"] == "dict"
    assert got["state"][1] == 3  # float32, int64, float64: three buffers for the seven tensors
    assert got["other"][1] == 2  # not packable (a transposed view): each tensor its own


def test_a_body_s_error_comes_back_as_raised_with_its_last_records(pool, caplog):
    caplog.set_level(logging.INFO, logger="lensemble.progress")
    with pytest.raises(DataError, match="site store site_b is truncated: regenerate it"):
        pool.call(_fails, "site_b")
    assert "about to fail on site_b" in [r.getMessage() for r in caplog.records]
    assert pool.call(_worker_facts, 3)[2] == 3.0  # the pool survives a failed call


def test_concurrent_calls_each_get_their_own_records(pool, caplog):
    from concurrent.futures import ThreadPoolExecutor

    caplog.set_level(logging.INFO, logger="lensemble.progress")
    with ThreadPoolExecutor(3) as ex:
        totals = list(ex.map(lambda n: pool.call(_worker_facts, n)[2], range(20, 26)))
    assert totals == [float(n * (n - 1) // 2) for n in range(20, 26)]
    assert sorted(r.getMessage() for r in caplog.records) == sorted(f"working on {n}" for n in range(20, 26))


def test_inline_pool_runs_here_with_the_whole_budget():
    before = torch.get_num_threads()
    try:
        pid, threads, total = InlinePool(2).call(_worker_facts, 4)
        assert (pid, threads, total) == (os.getpid(), 2, 6.0)
    finally:
        torch.set_num_threads(before)


def _hangs(pid_file: str) -> None:
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(0.05)


def _slow_square(x: int) -> int:
    time.sleep(1.0)
    return x * x


def _interrupt(thread: threading.Thread, exc: type[BaseException]) -> None:
    """Raise `exc` in `thread` at its next bytecode, as Prefect's timeout does to a task on a worker thread."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc))


def test_an_abandoned_call_stops_its_worker_and_the_others_run_again(tmp_path):
    pool = WorkerPool(2, 1)
    outcome: dict = {}
    try:
        def run(name, fn, *args):
            try:
                outcome[name] = pool.call(fn, *args)
            except BaseException as exc:  # noqa: BLE001 - the test reads what each call raised
                outcome[name] = exc

        pid_file = tmp_path / "hung.pid"
        hung = threading.Thread(target=run, args=("hung", _hangs, str(pid_file)))
        other = threading.Thread(target=run, args=("other", _slow_square, 7))
        hung.start()
        other.start()
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        hung_pid = int(pid_file.read_text())
        _interrupt(hung, TimeoutError)
        hung.join(30)
        other.join(60)
        assert isinstance(outcome["hung"], TimeoutError)
        assert outcome["other"] == 49  # lost with the old workers, run again on the new ones
        time.sleep(0.5)
        with pytest.raises(ProcessLookupError):
            os.kill(hung_pid, 0)  # the worker that ran the abandoned call is gone
        assert pool.call(_slow_square, 3) == 9
    finally:
        pool.close()


@pytest.mark.parametrize("seconds, slots, expected", [
    ([2.0, 2.0, 2.0], 2, 4.0),  # the third waits for the first worker to free
    ([2.0, 2.0, 2.0], None, 2.0),  # all at once
    ([2.0, 2.0, 2.0], 3, 2.0), ([1.0, 3.0, 1.0, 1.0], 2, 3.0), ([3.0, 1.0, 1.0, 1.0], 2, 3.0), ([5.0], 2, 5.0), ([], 2, 0.0),
])
def test_makespan_is_the_first_in_first_out_schedule_of_the_pool(seconds, slots, expected):
    assert makespan(seconds, slots) == expected


def _priority_and_bits(seed: int) -> tuple[int, int, bytes]:
    """(niceness, torch threads, the bits of a few seeded AdamW steps) — run in a worker."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 64, generator=gen, requires_grad=True)
    opt = torch.optim.AdamW([w], lr=1e-2)
    for _ in range(5):
        x = torch.randn(32, 64, generator=gen)
        loss = (x @ w).tanh().square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return os.nice(0), torch.get_num_threads(), w.detach().numpy().tobytes()


def test_background_workers_compute_the_same_bits_at_the_same_priority(pool):
    background = WorkerPool(2, 1, share=CoreShare(2), background=True)
    try:
        bg = [background.call(_priority_and_bits, s) for s in (0, 1)]
        normal = [pool.call(_priority_and_bits, s) for s in (0, 1)]
    finally:
        background.close()
    assert {n for n, _, _ in bg} == {n for n, _, _ in normal} == {os.nice(0)}  # not niced: a busy machine cannot starve it
    assert [t for _, t, _ in bg] == [1, 1]
    assert [b for _, _, b in bg] == [b for _, _, b in normal]  # the share changes when, never what
    assert bg[0][2] != bg[1][2]


def _held(release: str) -> int:
    """A site call that runs until `release` exists."""
    while not os.path.exists(release):
        time.sleep(0.01)
    return os.getpid()


def _background_steps(steps: int, log: str) -> int:
    """A background body: `steps` steps, each after waiting for a free core, each logged."""
    from orchestration.workers import background_turn

    for i in range(steps):
        background_turn()
        with open(log, "a") as f:
            f.write(f"{i}\n")
    return steps


def test_background_steps_wait_while_the_site_calls_fill_every_core(tmp_path):
    """Two site calls running on a 2-core share leave no core: a background body takes no step until one ends. The
    coordinator counts running calls (3 in flight on 2 workers hold 2 cores), and every count returns to 0."""
    share = CoreShare(2)
    sites = WorkerPool(2, 1, share=share)
    background = WorkerPool(1, 1, share=share, background=True)
    release, log = tmp_path / "release", tmp_path / "steps.log"
    results: dict = {}

    def run(name, pool, fn, *args):
        results[name] = pool.call(fn, *args)

    try:
        sites.wait_ready()
        background.wait_ready()
        held = [threading.Thread(target=run, args=(f"site{i}", sites, _held, str(release))) for i in range(3)]
        for t in held:
            t.start()
        deadline = time.monotonic() + 60
        while share.counts()[0] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert share.counts() == (2, 0)  # three calls in flight, two workers: two cores
        steps = threading.Thread(target=run, args=("background", background, _background_steps, 5, str(log)))
        steps.start()
        time.sleep(1.0)
        assert not log.exists()  # blocked before its first step
        release.touch()
        for t in (*held, steps):
            t.join(60)
        assert results["background"] == 5 and log.read_text().split() == ["0", "1", "2", "3", "4"]
        assert share.counts() == (0, 0)
    finally:
        release.touch()
        sites.close()
        background.close()


def test_core_share_counts_running_site_calls_and_the_coordinator_s_serial_work():
    """Foreground cores: min(calls in flight, workers) x threads a pool; while the coordinator works a round, at least
    its own core (it waits while site calls run, so they are not added); a background step takes a core only
    while one is free."""
    from types import SimpleNamespace

    share = CoreShare(2)
    sites = SimpleNamespace(workers=2, threads=1)
    share.foreground_calls(sites, +3)
    assert share.counts() == (2, 0)  # the third waits for a worker
    share.foreground_calls(sites, -2)
    assert share.counts() == (1, 0)
    share.take_background()
    assert share.counts() == (1, 1)
    share.give_background()
    share.foreground_calls(sites, -1)
    share.coordinator_working(+1)
    assert share.counts() == (1, 0)  # the exchange and the outer step: one core kept
    share.foreground_calls(sites, +2)
    assert share.counts() == (2, 0)  # the coordinator waits on them
    share.foreground_calls(sites, -2)
    share.coordinator_working(-1)
    assert share.counts() == (0, 0)  # after the rounds: every core for the baselines
    share.take_background()
    share.take_background()
    assert share.counts() == (0, 2)
    share.reset_background()
    assert share.counts() == (0, 0)


def test_terminate_stops_background_work_without_waiting_for_it(tmp_path):
    background = WorkerPool(1, 1, share=CoreShare(1), background=True)
    pid_file = tmp_path / "bg.pid"
    outcome: dict = {}

    def run() -> None:
        try:
            background.call(_hangs, str(pid_file))
        except BaseException as exc:  # noqa: BLE001 - the test reads what the call raised
            outcome["raised"] = exc

    caller = threading.Thread(target=run, daemon=True)
    caller.start()
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(pid_file.read_text())
    t0 = time.monotonic()
    background.terminate()
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the background worker still runs after terminate()")
    assert time.monotonic() - t0 < 30  # generous CI ceiling: it did not wait for the endless call
    caller.join(30)
    assert "raised" in outcome  # the call waiting on it came back with an error instead of hanging


@pytest.mark.parametrize("run, federate, expected", [
    ({"workers": 2}, {}, (2, 1, True)),  # the default split on 2 sites: a background twin of the site pool
    ({"workers": 2, "torch_threads": 4}, {}, (2, 2, True)),  # the site pool's threads: the same bits as after the rounds
    ({"workers": 1}, {}, None),  # one process: nothing idles beside the rounds, the baselines run after them
    ({"workers": 2}, {"task_runner": "dask"}, None),  # Dask workers are processes already
])
def test_background_pool_only_where_site_work_runs_in_worker_processes(run, federate, expected):
    from lensemble.config import parse_params
    from orchestration.workers import close_pools

    raw = micro_params()
    raw["run"].update(run)
    raw["federate"].update(federate)
    bg = background_pool(parse_params(raw))
    try:
        assert (bg if bg is None else (bg.workers, bg.threads, bg.background)) == expected
    finally:
        close_pools()


def test_background_pool_has_a_worker_for_every_site():
    from lensemble.config import parse_params
    from orchestration.workers import close_pools

    raw = micro_params()
    raw["run"].update(workers=2)
    raw["data"]["sites"].append({"name": "site_c", "embodiment": "grid_point", "episodes": 3})
    bg = background_pool(parse_params(raw))
    try:
        assert (bg.workers, bg.threads, bg.background) == (3, 1, True)  # no baseline waits for another
    finally:
        close_pools()


def _baseline_coordinator(sites: list[str]):
    from types import SimpleNamespace

    from lensemble.config import parse_params

    raw = micro_params()
    raw["federate"].update(head_adapt_steps=0, local_only=True)
    return SimpleNamespace(p=parse_params(raw), sites=sites, sovereign=False)


def test_background_baselines_are_collected_after_the_rounds():
    from concurrent.futures import Future

    from orchestration.federation import baselines

    futures = {s: Future() for s in ("site_a", "site_b")}
    for s, f in futures.items():
        f.set_result({"site": s, "steps": 3})
    head_adapt, local_only = baselines(None, _baseline_coordinator(["site_a", "site_b"]), {}, futures)
    assert head_adapt == {} and local_only == {"site_a": {"site": "site_a", "steps": 3}, "site_b": {"site": "site_b", "steps": 3}}


def test_a_background_baseline_that_never_finishes_is_a_one_line_error_after_the_site_wait(monkeypatch):
    from concurrent.futures import Future

    from orchestration import federation

    done, stuck = Future(), Future()
    done.set_result({"steps": 3})
    monkeypatch.setattr(federation, "wait_seconds", lambda p: 0.5)  # the site steps' wait (timeout x attempts), shortened
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        federation.baselines(None, _baseline_coordinator(["site_a", "site_b"]), {}, {"site_a": done, "site_b": stuck})
    assert time.monotonic() - t0 < 30  # generous CI ceiling: it waited about the site wait, not for ever
    message = str(err.value)
    assert "\n" not in message and message.startswith("site_b's local-only baseline did not finish within 0 s of the last round")
    assert "federate.site_timeout_seconds" in message and "federate.local_only: false" in message
