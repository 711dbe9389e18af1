"""Where a sweep's independent trials run: in this process (the default, no service) or on a Ray cluster.

A sweep hands a backend its tasks (small, picklable: a layer and a precision), a ``setup`` that builds
the per-worker state from one ``payload`` (the model and the evaluation tokens), and ``fn(state, task)``.
``LocalBackend`` runs them one after another in this process, as the workbench always has.
``ProcessBackend`` runs them on worker processes of this machine, forked from this one: each inherits the
caller's state (the model, its reference outputs, the baseline) copy-on-write, so nothing is pickled or
loaded twice and no service is started. ``RayBackend`` puts the payload into Ray's object store once, starts one actor per worker that builds
its state once, and streams each result back as it finishes; the caller stores every result as it
arrives, so a stopped sweep resumes from what was finished, on either backend.

Ray is imported only here and only when asked for, after ``RAY_ENV`` is applied (its usage-statistics
report off, its dashboard not started). ``--ray auto`` starts a private Ray on 127.0.0.1 for this
process; ``--ray ADDRESS`` joins a running cluster.
"""
from __future__ import annotations

import contextlib
import logging
import os
import resource
from typing import Any, Callable, Iterable

from ..errors import WorkbenchError
from .load import stored_bytes

__all__ = ["RAY_ENV", "RAY_INSTALL", "LocalBackend", "ProcessBackend", "RayBackend", "backend_for", "default_workers",
           "import_ray", "model_bytes"]

RAY_INSTALL = "pip install ray==2.60.0 -c constraints.txt"
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",  # Ray reports usage statistics by default; read when it loads
    "RAY_USAGE_STATS_PROMPT_ENABLED": "0",
    "RAY_DISABLE_IMPORT_WARNING": "1",
}
log = logging.getLogger("workbench")


def import_ray():
    """``ray``, imported after ``RAY_ENV`` is set (a value the user set is kept); a one-line error if absent."""
    for name, value in RAY_ENV.items():
        os.environ.setdefault(name, value)
    try:
        import ray
    except ImportError:
        raise WorkbenchError(f"running a sweep on Ray needs the ray package: {RAY_INSTALL}") from None
    return ray


DEAD_END_PROXY = "http://127.0.0.1:9"  # the discard port: nothing listens, a connection is refused at once


@contextlib.contextmanager
def loopback_http_proxy():
    """Ray's processes started inside this block send HTTP to a refused loopback port instead of the network.

    Even with usage statistics and the dashboard off, the API server Ray 2.60 always starts asks the
    cloud-metadata addresses (169.254.169.254, metadata.google.internal) which cloud it is on, through
    ``requests``, which honours the proxy variables; loopback stays direct (``no_proxy``), so Ray's own
    gRPC between its processes is untouched. The variables are restored when the block ends."""
    names = {"http_proxy": DEAD_END_PROXY, "HTTP_PROXY": DEAD_END_PROXY, "https_proxy": DEAD_END_PROXY,
             "HTTPS_PROXY": DEAD_END_PROXY, "no_proxy": "127.0.0.1,localhost,::1", "NO_PROXY": "127.0.0.1,localhost,::1"}
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(names)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Backend:
    """``with backend:`` holds what a backend starts (a Ray, its workers) across several runs; a no-op here."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class LocalBackend(_Backend):
    """Every task in this process, in order: what a sweep does without ``--ray``."""

    name = "local"

    def run(self, tasks: Iterable, fn: Callable[[Any, Any], Any], on_result: Callable[[Any, Any], None], *,
            state: Any = None, setup: Callable[[Any], Any] | None = None, payload: Any = None) -> None:
        if state is None:
            state = setup(payload)
        for task in tasks:
            on_result(task, fn(state, task))


def peak_resident_bytes() -> int:
    """This process's peak resident memory (Linux ``ru_maxrss``; pages shared with a parent count in full)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def private_bytes() -> int:
    """This process's own memory now: resident pages no other process shares (0 where /proc is missing)."""
    try:
        text = open("/proc/self/smaps_rollup", encoding="ascii").read()
    except OSError:
        return 0
    return sum(int(line.split()[1]) * 1024 for line in text.splitlines()
               if line.startswith(("Private_Clean:", "Private_Dirty:")))


_INHERITED: tuple | None = None  # (fn, state) while a ProcessBackend runs: what its forked workers inherit


def _worker_start(threads: int) -> None:
    import signal

    import torch
    torch.set_num_threads(threads)  # OpenMP's pool is not carried across fork: the worker sizes its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the caller, which stops the workers


def _worker_task(task):
    fn, state = _INHERITED
    result = fn(state, task)
    return result, os.getpid(), peak_resident_bytes(), private_bytes()


class ProcessBackend(_Backend):
    """Tasks on ``workers`` processes of this machine, forked from this one after the state is built.

    Each worker inherits the caller's state copy-on-write (the model's weights stay one copy in memory), runs
    with ``threads`` torch threads, and returns each result as it finishes. A worker that dies (the
    kernel's out-of-memory killer, a signal) stops the run with an error; the results already handed to
    ``on_result`` stay kept, so the sweep resumes from them. Linux and macOS (fork); no service, no Ray.
    """

    name = "processes"

    def __init__(self, workers: int = 2, *, threads: int = 1):
        if workers < 1:
            raise WorkbenchError(f"a sweep needs at least 1 worker, got {workers}")
        self.workers, self.threads = int(workers), max(1, int(threads))
        self.peaks: dict[int, int] = {}  # worker pid -> its peak resident bytes (shared model pages included)
        self.private: dict[int, int] = {}  # worker pid -> its largest private bytes (its own, after a task)

    def run(self, tasks: Iterable, fn: Callable[[Any, Any], Any], on_result: Callable[[Any, Any], None], *,
            state: Any = None, setup: Callable[[Any], Any] | None = None, payload: Any = None) -> None:
        global _INHERITED
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed
        from concurrent.futures.process import BrokenProcessPool
        tasks = list(tasks)
        if state is None:
            state = setup(payload)  # built once, here: every worker inherits it
        n = min(self.workers, len(tasks))
        self.peaks, self.private = {}, {}
        if n <= 1:
            LocalBackend().run(tasks, fn, on_result, state=state)
            return
        try:
            context = multiprocessing.get_context("fork")
        except ValueError:
            raise WorkbenchError("local worker processes need fork (Linux, macOS); use --workers 1 or --ray auto") \
                from None
        _INHERITED = (fn, state)
        pool = ProcessPoolExecutor(n, mp_context=context, initializer=_worker_start, initargs=(self.threads,))
        try:
            futures = {pool.submit(_worker_task, task): task for task in tasks}
            for future in as_completed(futures):
                try:
                    result, pid, peak, private = future.result()
                except BrokenProcessPool:
                    raise WorkbenchError(f"a sweep worker process died (out of memory, or killed) after "
                                         f"{sum(f.done() for f in futures)} of {len(tasks)} tasks; the finished "
                                         "ones are kept: rerun to resume, with fewer --workers if memory ran "
                                         "out") from None
                self.peaks[pid] = max(self.peaks.get(pid, 0), peak)
                self.private[pid] = max(self.private.get(pid, 0), private)
                on_result(futures[future], result)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            _INHERITED = None


class RayBackend(_Backend):
    """Tasks on Ray actors: one per worker, each building its state once from the payload in the object store.

    ``address``: ``auto`` starts a Ray for this process on 127.0.0.1 (no dashboard); anything else is a
    running cluster's address to join. A process already connected to Ray (``ray.is_initialized()``)
    uses that connection. ``workers`` defaults to the cluster's CPUs / ``worker_cpus``; ``threads`` is
    each worker's torch thread count. Actors are spread over the nodes and restarted elsewhere when a node
    is lost; the task they held is retried there, and the move is logged. Inside ``with backend:`` the Ray
    and its actors outlive each run: a later run with the same ``setup`` and ``payload`` object reuses the
    actors' state (the refinement's rounds), and everything is released when the block ends.
    """

    name = "ray"

    def __init__(self, address: str = "auto", *, workers: int | None = None, worker_cpus: float = 1.0,
                 threads: int = 1):
        if not address:
            raise WorkbenchError("give --ray auto (a Ray on this machine) or a cluster's address such as 10.0.0.5:6379")
        if workers is not None and workers < 1:
            raise WorkbenchError(f"a Ray sweep needs at least 1 worker, got {workers}")
        self.address, self.workers, self.worker_cpus, self.threads = address, workers, float(worker_cpus), int(threads)
        self.started = False  # whether this backend started the Ray it uses (and shuts it down)
        self.nodes: dict[Any, str] = {}  # task -> the node that ran it, for the last run
        self.peaks: dict[int, int] = {}  # worker -> its peak resident bytes (Linux ru_maxrss), for the last run
        self.private: dict[int, int] = {}  # worker -> its largest private bytes (the object store's pages excluded)
        self._held = False  # inside ``with``: keep Ray and the actors between runs
        self._actors: tuple | None = None  # ((setup, id(payload)), actors) of the last run

    def __enter__(self):
        self._connect()
        self._held = True
        return self

    def __exit__(self, *exc) -> None:
        self._held = False
        self._release(import_ray())

    def _release(self, ray) -> None:
        """Kill the kept actors (a stopped sweep leaves none holding the cluster's CPUs); stop a Ray we started."""
        if self._actors is not None:
            for actor in self._actors[1]:
                ray.kill(actor)
            self._actors = None
        if self.started:
            ray.shutdown()
            self.started = False

    def _connect(self):
        if self.address == "auto":  # single-machine mode: every Ray process takes 127.0.0.1 as its address,
            # instead of probing the outbound route (a UDP connect to 8.8.8.8) and serving on the host's address
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        ray = import_ray()
        if not ray.is_initialized():
            if self.address == "auto":
                with loopback_http_proxy():
                    ray.init(address="local", num_cpus=self.workers and int(self.workers * self.worker_cpus + 0.999),
                             include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                             configure_logging=False)
                self.started = True
            else:
                ray.init(address=self.address, log_to_driver=False, configure_logging=False)
        return ray

    def run(self, tasks: Iterable, fn: Callable[[Any, Any], Any], on_result: Callable[[Any, Any], None], *,
            state: Any = None, setup: Callable[[Any], Any] | None = None, payload: Any = None) -> None:
        tasks = list(tasks)
        if not tasks:
            return
        if setup is None:
            raise WorkbenchError("a Ray sweep needs a setup function to build each worker's state")
        ray = self._connect()
        try:
            self._run(ray, tasks, fn, on_result, setup, payload)
        finally:
            if not self._held:
                self._release(ray)

    def _workers_for(self, ray, setup, payload, wanted: int) -> list:
        """The actors for this setup and payload: the kept ones when they match, else new ones."""
        key = (setup, id(payload))
        if self._actors is not None and self._actors[0] == key:
            return self._actors[1]
        if self._actors is not None:
            for actor in self._actors[1]:
                ray.kill(actor)
        worker_cls = ray.remote(_Worker).options(num_cpus=self.worker_cpus, max_restarts=-1, max_task_retries=-1,
                                                 scheduling_strategy="SPREAD")
        n = self.workers or max(1, int(ray.cluster_resources().get("CPU", 1) // self.worker_cpus))
        _warn_if_the_store_is_small(ray, payload)
        with _tensors_shared_in_the_store(ray):  # once: every actor maps it from the object store, no task carries it
            ref = ray.put(payload)
        n = n if self._held else min(n, wanted)  # kept actors serve later, larger runs too
        self._actors = (key, [worker_cls.remote(setup, ref, self.threads) for _ in range(n)])
        return self._actors[1]

    def _run(self, ray, tasks, fn, on_result, setup, payload) -> None:
        actors = self._workers_for(ray, setup, payload, len(tasks))
        queue = list(reversed(tasks))
        running: dict[Any, tuple[int, Any]] = {}
        self.nodes, self.peaks, self.private = {}, {}, {}

        def submit(i: int) -> None:
            task = queue.pop()
            running[actors[i].run.remote(fn, task)] = (i, task)

        self._stream(ray, actors[:len(tasks)], queue, running, submit, on_result)

    def _stream(self, ray, actors, queue, running, submit, on_result) -> None:
        last_node: dict[int, str] = {}
        for i in range(len(actors)):
            submit(i)
        while running:
            done, _ = ray.wait(list(running), num_returns=1)
            i, task = running.pop(done[0])
            result, node, peak, private = ray.get(done[0])
            self.peaks[i] = max(self.peaks.get(i, 0), peak)
            self.private[i] = max(self.private.get(i, 0), private)
            if i in last_node and last_node[i] != node:
                log.warning(f"Ray worker {i} moved from node {last_node[i][:8]} to {node[:8]} (a node was lost); "
                            "its task was retried there")
            last_node[i] = node
            self.nodes[task] = node
            on_result(task, result)
            if queue:
                submit(i)


def _tensor_from_store(parts: tuple):
    """A tensor over the object store's bytes, not a copy (read-only there: a sweep's trials swap weights, never
    write them)."""
    import warnings

    import torch
    array, dtype, shape = parts
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch notes that the store's array is not writable
        return torch.from_numpy(array).view(getattr(torch, dtype.rpartition(".")[2])).reshape(shape)


def _tensor_to_store(tensor) -> tuple:
    """A CPU tensor as its raw bytes (a NumPy array, which pickle 5 hands Ray out of band), its dtype and shape."""
    import torch
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy(), str(tensor.dtype), tuple(tensor.shape)


def model_bytes(payload: Any) -> int:
    """The bytes of the parameters in a payload's models (a ``LoadedModel``, a module, or a tuple holding them)."""
    import torch

    items = payload if isinstance(payload, (tuple, list)) else (payload,)
    modules = (getattr(item, "model", item) for item in items)
    return sum(stored_bytes(m) for m in modules if isinstance(m, torch.nn.Module))


def _warn_if_the_store_is_small(ray, payload: Any) -> None:
    """Say so when a node's object store cannot hold the model: its actors then each keep a copy of their own."""
    size = model_bytes(payload)
    stores = [n["Resources"].get("object_store_memory", 0) for n in ray.nodes() if n.get("Alive")]
    if size and stores and min(stores) < size:
        log.warning(f"the model ({size / 1e9:.2f} GB) is larger than a node's object store "
                    f"({min(stores) / 1e9:.2f} GB): each Ray worker will hold a copy of its own; start the nodes "
                    "with a larger store (ray start --object-store-memory BYTES)")


@contextlib.contextmanager
def _tensors_shared_in_the_store(ray):
    """While a payload is put, its tensors travel as raw bytes: every actor on a node then maps the one copy in
    the node's object store instead of unpickling a model of its own (a 1.5B model is 6 GB per worker else).
    Whatever serializer was registered for tensors before is put back."""
    import torch
    dispatch = ray.cloudpickle.CloudPickler.dispatch
    before = dispatch.get(torch.Tensor)
    ray.util.register_serializer(torch.Tensor, serializer=_tensor_to_store,
                                 deserializer=_tensor_from_store)
    try:
        yield
    finally:
        if before is None:
            ray.util.deregister_serializer(torch.Tensor)
        else:
            dispatch[torch.Tensor] = before


class _Worker:
    """One Ray actor: builds its state once, then runs tasks on it; returns each result with its node."""

    def __init__(self, setup, payload, threads: int):
        import torch
        torch.set_num_threads(max(1, threads))
        self.state = setup(payload)

    def run(self, fn, task):
        import ray
        result = fn(self.state, task)
        return result, ray.get_runtime_context().get_node_id(), peak_resident_bytes(), private_bytes()


def default_workers() -> int:
    """Worker processes a measured sweep runs on when none is named: one per CPU of this machine, where fork is
    available (``bench/sweeps.py``: two forked one-thread workers finish a 2-core machine's sweep sooner than
    one two-thread process, the same values; the model's pages are shared, not copied)."""
    import multiprocessing
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return max(1, os.cpu_count() or 1)


def backend_for(ray_address: str | None = None, workers: int | None = None):
    """Where a sweep runs: a ``RayBackend`` when an address is given (``auto``: a Ray on 127.0.0.1; ``workers``
    None: one per CPU of the cluster), else ``workers`` local processes (``ProcessBackend``), else this
    process (``LocalBackend``, for ``workers`` None or 1). The CLI and the app name ``default_workers()``."""
    if ray_address:
        return RayBackend(ray_address, workers=workers)
    return ProcessBackend(workers) if workers and workers > 1 else LocalBackend()
