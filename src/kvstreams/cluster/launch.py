"""Starting or joining Ray, and the free port a torch.distributed group rendezvouses on."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from kvstreams.errors import KVStreamsError
from kvstreams.train.config import ClusterSection


def start_ray(cluster: ClusterSection):
    """The ``ray`` module, initialised: joins ``cluster.address`` or starts Ray on this machine with
    enough logical CPUs for every actor (Ray schedules by reservation; 2 physical cores can host a
    driver, 2 workers and 2 ranks that take turns). Reused when already initialised."""
    try:
        import ray
    except ImportError:
        raise KVStreamsError("the cluster needs Ray: pip install 'kvstreams[cluster]'") from None
    if ray.is_initialized():
        return ray
    if cluster.address:
        ray.init(address=cluster.address, log_to_driver=True)
        return ray
    needed = cluster.rollout_workers * cluster.worker_cpus + cluster.learner_world_size * cluster.learner_cpus
    ray.init(
        num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)),
        include_dashboard=False,
        # workers import kvstreams from wherever this process does (an editable install or PYTHONPATH)
        runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}},
    )
    return ray


@contextmanager
def ray_session(cluster: ClusterSection) -> Iterator[None]:
    """Ray for the duration of a run when the run is distributed; shut down afterwards if this
    started it (a Ray the caller had started, or a cluster joined, is left as it was)."""
    if not cluster.distributed:
        yield
        return
    import importlib

    started = not importlib.import_module("ray").is_initialized() and not cluster.address
    ray = start_ray(cluster)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def actor_threads(cpus: float) -> int:
    """torch threads for an actor that reserved ``cpus`` CPUs (at least one)."""
    return max(1, int(cpus))
