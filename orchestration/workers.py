"""Worker processes for a stage's CPU-bound site work: the thread budget split into processes.

The stages' site work (a round's inner steps, the head re-fit, the local-only baselines, each site's
closed-loop evaluation) runs as Prefect tasks on threads. Threads share one interpreter lock and one
torch intra-op pool, which this project's small models use badly: on the 2-core reference machine one
process trains at ~36 steps/s with 2 intra-op threads and ~28 with one, two single-threaded processes
at ~56 together, and 2 intra-op threads fall to ~10 steps/s as soon as another process holds a core
(they spin at barriers). So the budget `run.torch_threads` is split into `run.workers` processes of
`torch_threads // workers` threads each (`thread_split`); the task stays a Prefect task on its
thread (its run, retries, timeout and logs in the UI) and hands its body to a worker with
`WorkerPool.call`.

Log records a body emits in a worker come back to the calling thread and are handled there, so they
reach the console and the Logs tab of the task run that called, as if emitted in-process. A worker
is a spawned interpreter (no state inherited from the coordinator), started once per stage and
reused; exceptions come back as the body raised them.
"""
from __future__ import annotations

import importlib
import itertools
import logging
import logging.handlers
import math
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from lensemble.device import resolve_device
from orchestration.heap import freeze_long_lived, skip_final_collection

T = TypeVar("T")
_DONE = "done"  # (_DONE, call id): the last message of every call, after everything it logged
_worker_call: str | None = None  # in a worker: the id of the call running now
_records = None  # in a worker: the queue back to the coordinator
_share: CoreShare | None = None  # in a background worker: the cores it shares with the site work
_holding = False  # in a background worker: whether it holds one of the shared cores now


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def thread_split(torch_threads: int, workers: int | str) -> tuple[int, int]:
    """(processes, intra-op threads each) for a budget of `torch_threads` threads; `auto`: one thread a process."""
    n = torch_threads if workers == "auto" else int(workers)
    n = max(1, min(n, torch_threads))
    return n, max(1, torch_threads // n)


class _TagCall(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.worker_call = _worker_call
        return True


class CoreShare:
    """The cores a stage's site work (foreground) and its background work (the local-only baselines) share, held by
    count rather than by scheduling priority.

    The coordinator counts the foreground calls running (queued calls wait for a worker and use no core); a
    background body takes a core before each training step (`background_turn`) only while foreground + background
    steps leave one free, and gives it back after the step. So the background trains on exactly the cores the
    rounds leave idle, as lowest-priority workers did, without their failure: at niceness 19 a background worker
    gets ~1.5% of a core against any normal process on the machine, and on a loaded machine the baselines the
    stage waits for at its end starved (a 5-round micro federation under two busy processes took 212.5 s with
    its baselines, 8.1 s without). Counts live in shared memory; a background step in flight when a site call
    starts finishes first (one step, tens of ms)."""

    def __init__(self, cores: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.cores = cores
        self._lock = ctx.Lock()
        self._foreground = ctx.RawValue("i", 0)
        self._background = ctx.RawValue("i", 0)
        self._calls: dict[int, tuple[int, int, int]] = {}  # coordinator side: pool id -> (calls in flight, workers, threads)
        self._coordinator = 0  # coordinator side: > 0 while it works a round (its exchange, outer step, gauge, record)

    def __getstate__(self) -> dict:  # a worker reads the counts; the coordinator's bookkeeping stays here
        return {**self.__dict__, "_calls": {}, "_coordinator": 0}

    def _publish(self) -> None:
        """Foreground cores: the running site calls (min(calls in flight, workers) a pool), or, while the coordinator
        works a round and no site call runs, the coordinator's own core (it waits while they run)."""
        running = sum(min(c, w) * t for c, w, t in self._calls.values())
        self._foreground.value = max(running, 1 if self._coordinator > 0 else 0)

    def foreground_calls(self, pool: WorkerPool, delta: int) -> None:
        """A call of `pool` submitted (+1) or done (-1)."""
        with self._lock:
            calls = self._calls.get(id(pool), (0,))[0] + delta
            self._calls[id(pool)] = (calls, pool.workers, pool.threads)
            self._publish()

    def coordinator_working(self, delta: int) -> None:
        """The coordinator starts (+1) or ends (-1) a round's work."""
        with self._lock:
            self._coordinator += delta
            self._publish()

    def take_background(self, poll: float = 0.005) -> None:
        while True:
            with self._lock:
                if self._foreground.value + self._background.value < self.cores:
                    self._background.value += 1
                    return
            time.sleep(poll)

    def give_background(self) -> None:
        with self._lock:
            self._background.value = max(0, self._background.value - 1)

    def reset_background(self) -> None:
        """The background workers were stopped: none holds a core."""
        with self._lock:
            self._background.value = 0

    def counts(self) -> tuple[int, int]:
        """(foreground cores, background cores) in use now."""
        with self._lock:
            return self._foreground.value, self._background.value


def background_turn() -> None:
    """Between two training steps of a background body: give back this worker's core and wait for one the site work
    leaves free. A no-op anywhere else (site workers, the coordinator, an inline run)."""
    global _holding
    if _share is None:
        return
    if _holding:
        _share.give_background()
    _share.take_background()
    _holding = True


def _init_worker(threads: int, records, share: CoreShare | None = None) -> None:
    """Worker start: its torch threads, the queue its log records go back to the coordinator on, and (a background
    worker) the cores it shares with the site work."""
    global _records, _share
    skip_final_collection()  # a pool's close waits for its workers' exits: 2.0-2.4 s each with the last collection, 0.3 s without
    torch.set_num_threads(threads)
    _records = records
    _share = share
    _route_records()


def _route_records() -> None:
    """Every record of the `lensemble` loggers (INFO and up) onto the queue, tagged with the running call; other
    loggers' warnings too. Redone at each call: an import in a body (Prefect's, say) may reconfigure logging."""
    handler = logging.handlers.QueueHandler(_records)
    handler.addFilter(_TagCall())
    lens = logging.getLogger("lensemble")
    lens.handlers[:] = [handler]
    lens.setLevel(logging.INFO)
    lens.propagate = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)


def _warm(modules: tuple[str, ...]) -> None:
    """Import the modules of the bodies the pool will run, so a worker's first call pays no import; then freeze them
    out of every later collection (`orchestration.heap`)."""
    for name in modules:
        importlib.import_module(name)
    freeze_long_lived()


class PackedTensors:
    """A dict of CPU tensors on its way to a worker: one flat buffer per dtype, rebuilt there as views of it.

    Each tensor in a call's arguments crosses to the worker through its own shared-memory segment, at a
    cost per tensor whatever its size: on a quiet 2-core machine a call with the default federated state
    (81 tensors) and the probe took 29-43 ms, one with a single tensor of the state's size 1-7 ms; in a
    default federation this cut the rounds' orchestration share from 6.8-7.1% to 6.0%.
    `unpack` gives the same names in the same order and bit-identical values (contiguous views)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.names = list(tensors)
        self.shapes = [tuple(t.shape) for t in tensors.values()]
        self.dtypes = [t.dtype for t in tensors.values()]
        self.buffers = {dtype: torch.cat([t.reshape(-1) for t, d in zip(tensors.values(), self.dtypes) if d == dtype])
                        for dtype in dict.fromkeys(self.dtypes)}

    @staticmethod
    def packable(value: Any) -> bool:
        """A dict of two or more contiguous CPU tensors that need no gradient (a state dict, a federated state)."""
        return (type(value) is dict and len(value) > 1
                and all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad
                        for t in value.values()))

    def unpack(self) -> dict[str, torch.Tensor]:
        parts = {dtype: iter(buf.split([math.prod(s) for s, d in zip(self.shapes, self.dtypes) if d == dtype]))
                 for dtype, buf in self.buffers.items()}
        return {name: next(parts[dtype]).view(shape) for name, shape, dtype in zip(self.names, self.shapes, self.dtypes)}


def _pack(value: Any) -> Any:
    return PackedTensors(value) if PackedTensors.packable(value) else value


def _unpack(value: Any) -> Any:
    return value.unpack() if isinstance(value, PackedTensors) else value


def _run_call(call_id: str, fn: Callable[..., T], args: tuple, kwargs: dict) -> T:
    global _worker_call, _holding
    _worker_call = call_id
    _route_records()
    try:
        background_turn()
        return fn(*(_unpack(a) for a in args), **{k: _unpack(v) for k, v in kwargs.items()})
    finally:
        if _holding:
            _share.give_background()
            _holding = False
        _worker_call = None
        _records.put((_DONE, call_id))  # after the body's records (one queue, one feeder thread: in order)


class WorkerPool:
    """`workers` spawned processes, each running torch with `threads` intra-op threads. With a `share`, a site pool
    counts its running calls there, and a `background` pool's bodies train only on the cores those leave free
    (`CoreShare`)."""

    def __init__(self, workers: int, threads: int, warm: tuple[str, ...] = (), share: CoreShare | None = None,
                 background: bool = False) -> None:
        self.workers, self.threads, self.warm = workers, threads, warm
        self.share, self.background = share, background
        self._ctx = multiprocessing.get_context("spawn")
        self._records = self._ctx.Queue()
        self._lock = threading.Lock()
        self._executor = self._start()
        self._generation = 0  # +1 at every restart (`_abandon`)
        self._inboxes: dict[str, queue.Queue] = {}
        self._ids = itertools.count()
        self._relay = threading.Thread(target=self._route, name="lensemble-worker-logs", daemon=True)
        self._relay.start()

    def _start(self) -> ProcessPoolExecutor:
        """A fresh executor whose workers start now (spawn and import, ~2-3 s), not inside the first call's timeout."""
        executor = ProcessPoolExecutor(self.workers, mp_context=self._ctx, initializer=_init_worker,
                                       initargs=(self.threads, self._records, self.share if self.background else None))
        self._warming = [executor.submit(_warm, self.warm) for _ in range(self.workers)]
        return executor

    def wait_ready(self) -> None:
        """Block until every worker has started and imported its `warm` modules (so a first call pays none of it)."""
        for future in self._warming:
            future.result()

    def _route(self) -> None:
        """Hand each record from the workers to the inbox of the call that emitted it."""
        while True:
            record = self._records.get()
            if record is None:
                return
            call = record[1] if isinstance(record, tuple) else getattr(record, "worker_call", None)
            with self._lock:
                inbox = self._inboxes.get(call or "")
            if inbox is not None:
                inbox.put(record)
            elif not isinstance(record, tuple):  # emitted outside any call (worker start-up): handle it here
                logging.getLogger(record.name).handle(record)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) in a worker (fn importable by name, arguments picklable); its log records are
        handled on this thread as they arrive; its result, or its exception raised here.

        A call abandoned while it runs (a task timeout, an interrupt) may never finish: its workers are
        stopped and the pool restarted, and the other calls that were running are run again from the start."""
        call_id = f"{os.getpid()}-{next(self._ids)}"
        args, kwargs = tuple(_pack(a) for a in args), {k: _pack(v) for k, v in kwargs.items()}
        inbox: queue.Queue = queue.Queue()
        with self._lock:
            self._inboxes[call_id] = inbox
        future, generation = None, -1
        counted = self.share is not None and not self.background
        if counted:
            self.share.foreground_calls(self, +1)
        try:
            while True:
                with self._lock:
                    future, generation = self._executor.submit(_run_call, call_id, fn, args, kwargs), self._generation
                try:
                    self._relay_until_done(future, inbox)
                    return future.result()
                except BrokenProcessPool:
                    if generation == self._generation:
                        raise  # a worker died on its own (killed, out of memory)
        except BaseException:
            if future is not None and not future.done():
                self._abandon(generation)
            raise
        finally:
            if counted:
                self.share.foreground_calls(self, -1)
            with self._lock:
                self._inboxes.pop(call_id, None)

    @staticmethod
    def _relay_until_done(future, inbox: queue.Queue) -> None:
        """Handle the call's records here until its last one (or, if its worker died, a while after it ended)."""
        deadline = None
        while True:
            try:
                record = inbox.get(timeout=0.1)
            except queue.Empty:
                if future.done():  # its last records are in flight, or its worker died and none will come
                    deadline = deadline or time.monotonic() + 5.0
                    if time.monotonic() > deadline:
                        return
                continue
            if isinstance(record, tuple):  # (_DONE, call id): the call's last record
                return
            logging.getLogger(record.name).handle(record)

    def _abandon(self, generation: int) -> None:
        """Stop the workers (one of them runs a call nobody waits for) and start fresh ones, once per generation."""
        with self._lock:
            if generation != self._generation:
                return
            old, self._executor = self._executor, self._start()
            self._generation += 1
        for process in list(getattr(old, "_processes", {}).values()):
            process.terminate()
        old.shutdown(wait=False, cancel_futures=True)
        if self.background and self.share is not None:
            self.share.reset_background()

    def terminate(self) -> None:
        """Stop the workers now, whatever they run (a stage that failed does not wait for its background work)."""
        for process in list(getattr(self._executor, "_processes", {}).values()):
            process.terminate()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.background and self.share is not None:
            self.share.reset_background()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._records.put(None)
        self._relay.join(timeout=5)
        self._records.close()


class InlinePool:
    """The same interface, in this process and thread: one worker, the whole thread budget."""

    workers = 1

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        torch.set_num_threads(self.threads)
        return fn(*args, **kwargs)

    def wait_ready(self) -> None:
        pass

    def close(self) -> None:
        pass


_pools: dict[tuple[int, int, bool], WorkerPool] = {}  # (workers, threads, background) -> pool
_pools_lock = threading.Lock()


def in_worker_processes(params) -> bool:
    """Whether a stage's site work runs in worker processes under `params`: not on Dask (its workers are processes
    already), not where the thread split is one process, not with the model on a GPU."""
    workers, _ = thread_split(params.run.torch_threads, params.run.workers)
    return params.federate.task_runner != "dask" and workers > 1 and resolve_device(params.run.device).type != "cuda"


def site_pool(params, warm: tuple[str, ...] = ()) -> WorkerPool | InlinePool:
    """Where a stage runs its sites' CPU-bound work under `params`: a shared `WorkerPool` (its workers import the
    `warm` modules as they start); in-process when the split is one process or the model runs on a GPU; in the
    task's own process on Dask (its workers are processes already), with the same threads a worker would have,
    so both runners compute the same bits."""
    workers, threads = thread_split(params.run.torch_threads, params.run.workers)
    if params.federate.task_runner == "dask":
        return InlinePool(threads)
    if not in_worker_processes(params):
        return InlinePool(params.run.torch_threads)
    with _pools_lock:
        pool = _pools.get((workers, threads, False))
        if pool is None:
            pool = _pools[(workers, threads, False)] = WorkerPool(workers, threads, warm, share=_core_share(params))
        return pool


_share_here: CoreShare | None = None  # the coordinator's: one for the stage's pools


@contextmanager
def coordinator_round():
    """Around a federation round in the coordinator: its serial work (exchange, outer step, gauge, record) keeps a core
    the background bodies do not take. A no-op where no pool shares cores."""
    share = _share_here
    if share is None:
        yield
        return
    share.coordinator_working(+1)
    try:
        yield
    finally:
        share.coordinator_working(-1)


def _core_share(params) -> CoreShare:
    """The stage's `CoreShare` over its thread budget (called under `_pools_lock`)."""
    global _share_here
    if _share_here is None:
        _share_here = CoreShare(params.run.torch_threads)
    return _share_here


def background_pool(params, warm: tuple[str, ...] = ()) -> WorkerPool | None:
    """A second pool, one worker a site with `site_pool`'s threads each, for work that no result of the stage waits on
    until its end (the local-only baselines): its bodies train on the cores the site work leaves free (`CoreShare`:
    a round's site steps fill 1.5 of 2 workers with 3 sites, and the aggregation between site steps fills none), and
    on every core once nothing else runs. None where `site_pool` would not start processes (one worker, a GPU, Dask):
    there the work runs after the rounds, as before."""
    if not in_worker_processes(params):
        return None
    workers, threads = thread_split(params.run.torch_threads, params.run.workers)
    # one worker a site: every baseline advances on the idle time (with two workers the third waited for the first
    # two and then trained alone on one core: federate 306 s against 313 s with no background at all)
    workers = max(workers, len(params.data.sites))
    with _pools_lock:
        pool = _pools.get((workers, threads, True))
        if pool is None:
            pool = _pools[(workers, threads, True)] = WorkerPool(workers, threads, warm, share=_core_share(params), background=True)
        return pool


def terminate_background_pools() -> None:
    """Stop the background workers now (a stage that failed); `close_pools` would wait for what they run."""
    with _pools_lock:
        pools = [k for k in _pools if k[2]]
        dropped = [_pools.pop(k) for k in pools]
    for pool in dropped:
        pool.terminate()


def site_slots(params) -> int | None:
    """How many sites' work runs at once under `params` in this process's pool: its workers; None when every site
    runs at once (threads, Dask, a GPU, sovereign sites at home)."""
    if params.federate.execution == "sovereign" or not in_worker_processes(params):
        return None
    return thread_split(params.run.torch_threads, params.run.workers)[0]


def makespan(seconds: list[float], slots: int | None) -> float:
    """Wall time of jobs taking `seconds`, submitted in this order to `slots` workers that each take the next job when
    free (the pool's first-in first-out queue); None: all at once. The critical path of a round's site work."""
    if slots is None or slots >= len(seconds):
        return max(seconds, default=0.0)
    free = [0.0] * slots
    for s in seconds:
        i = free.index(min(free))
        free[i] += s
    return max(free)


def close_pools() -> None:
    """Stop every worker this process started (the end of a stage)."""
    global _share_here
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
        _share_here = None
    for pool in pools:
        pool.close()
