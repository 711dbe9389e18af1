"""Where a sweep's independent trials run: in this process (the default, no service) or on a Ray cluster.

A sweep hands a backend its tasks (small, picklable: a layer and a precision), a ``setup`` that builds
the per-worker state from one ``payload`` (the model and the evaluation tokens), and ``fn(state, task)``.
``LocalBackend`` runs them one after another in this process, as the workbench always has.
``RayBackend`` puts the payload into Ray's object store once, starts one actor per worker that builds
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
from typing import Any, Callable, Iterable

from .errors import WorkbenchError

__all__ = ["RAY_ENV", "RAY_INSTALL", "LocalBackend", "RayBackend", "backend_for", "import_ray"]

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


class LocalBackend:
    """Every task in this process, in order: what a sweep does without ``--ray``."""

    name = "local"

    def run(self, tasks: Iterable, fn: Callable[[Any, Any], Any], on_result: Callable[[Any, Any], None], *,
            state: Any = None, setup: Callable[[Any], Any] | None = None, payload: Any = None) -> None:
        if state is None:
            state = setup(payload)
        for task in tasks:
            on_result(task, fn(state, task))


class RayBackend:
    """Tasks on Ray actors: one per worker, each building its state once from the payload in the object store.

    ``address``: ``auto`` starts a Ray for this process on 127.0.0.1 (no dashboard); anything else is a
    running cluster's address to join. A process already connected to Ray (``ray.is_initialized()``)
    uses that connection. ``workers`` defaults to the cluster's CPUs / ``worker_cpus``; ``threads`` is
    each worker's torch thread count. Actors are spread over the nodes and restarted elsewhere when a node
    is lost; the task they held is retried there, and the move is logged.
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
            if self.started:
                ray.shutdown()
                self.started = False

    def _run(self, ray, tasks, fn, on_result, setup, payload) -> None:
        worker_cls = ray.remote(_Worker).options(num_cpus=self.worker_cpus, max_restarts=-1, max_task_retries=-1,
                                                 scheduling_strategy="SPREAD")
        n = self.workers or max(1, int(ray.cluster_resources().get("CPU", 1) // self.worker_cpus))
        ref = ray.put(payload)  # once: every actor reads it from the object store, no task carries it
        actors = [worker_cls.remote(setup, ref, self.threads) for _ in range(min(n, len(tasks)))]
        queue = list(reversed(tasks))
        running: dict[Any, tuple[int, Any]] = {}
        self.nodes, self.peaks = {}, {}

        def submit(i: int) -> None:
            task = queue.pop()
            running[actors[i].run.remote(fn, task)] = (i, task)

        try:
            self._stream(ray, actors, queue, running, submit, on_result)
        finally:  # a stopped sweep leaves no actor holding the cluster's CPUs
            for actor in actors:
                ray.kill(actor)

    def _stream(self, ray, actors, queue, running, submit, on_result) -> None:
        last_node: dict[int, str] = {}
        for i in range(len(actors)):
            submit(i)
        while running:
            done, _ = ray.wait(list(running), num_returns=1)
            i, task = running.pop(done[0])
            result, node, peak = ray.get(done[0])
            self.peaks[i] = max(self.peaks.get(i, 0), peak)
            if i in last_node and last_node[i] != node:
                log.warning(f"Ray worker {i} moved from node {last_node[i][:8]} to {node[:8]} (a node was lost); "
                            "its task was retried there")
            last_node[i] = node
            self.nodes[task] = node
            on_result(task, result)
            if queue:
                submit(i)


class _Worker:
    """One Ray actor: builds its state once, then runs tasks on it; returns each result with its node."""

    def __init__(self, setup, payload, threads: int):
        import torch
        torch.set_num_threads(max(1, threads))
        self.state = setup(payload)

    def run(self, fn, task):
        import resource

        import ray
        result = fn(self.state, task)
        return result, ray.get_runtime_context().get_node_id(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def backend_for(ray_address: str | None, **kw):
    """``LocalBackend()`` without an address, else a ``RayBackend`` for it (``auto``: a Ray on 127.0.0.1)."""
    return LocalBackend() if not ray_address else RayBackend(ray_address, **kw)
