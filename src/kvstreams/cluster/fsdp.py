"""The learner on FSDP2: ``cluster.learner_world_size`` ranks, Ray actors in one torch.distributed
group (gloo on CPU, NCCL on CUDA), each holding a shard of every parameter and of its optimizer state.

Data parallel over micro-batches, with the single-process loss: every rank gets the whole batch (one
object-store copy, read in place on a node), builds the same micro-batches and the same correction
(Sparse-RL's rejections and TIS's weights are decided over the whole batch, so ranks gather the
learner's log-probs before deciding), and runs micro-batches ``rank, rank + W, ...``. Each micro-batch's
loss is already divided by the whole batch's normaliser, so the ranks' gradients are *summed*
(``set_gradient_divide_factor(1)``), not averaged: step-1 loss and gradient are the single process's
to float rounding. FSDP2 all-gathers parameters in every forward and reduce-scatters gradients in
every backward, so ranks must run as many micro-batches as each other: one with fewer runs a stand-in
that keeps no token (:class:`~kvstreams.train.learner.SingleProcess` documents the interface).

Checkpoints stay the single-process format (safetensors, gathered on rank 0 by
``get_model_state_dict(full_state_dict=True)``): the trainer's process holds a full copy of the
weights and optimizer state to write them, and a run resumes with any number of ranks or workers.
The frozen reference of the KL term is a full replica on each rank (no gradient, no optimizer).
"""

from __future__ import annotations

from typing import Any

import torch

from kvstreams.cluster.launch import actor_threads, free_port, start_ray
from kvstreams.cluster.wire import state_from_bytes, state_to_bytes
from kvstreams.train.config import Config, validate_config
from kvstreams.train.learner import Learner, TrainItem


class FSDPGroup:
    """:class:`~kvstreams.train.learner.SingleProcess`'s interface over the ranks of the default
    torch.distributed group."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def assign(self, n: int) -> list[tuple[int, bool]]:
        mine = [(i, True) for i in range(self.rank, n, self.world)]
        per_rank = -(-n // self.world)  # what rank 0 runs: the most any rank runs
        return mine + [(0, False)] * (per_rank - len(mine))

    def _all(self, value: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def gather(self, parts: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        merged: dict[int, torch.Tensor] = {}
        for part in self._all(parts):
            merged.update(part)
        return merged

    def reduce(self, sums: dict[str, float]) -> dict[str, float]:
        total: dict[str, float] = {}
        for part in self._all(sums):
            for key, value in part.items():
                combine = max if key.endswith("_max_abs_dev") else (lambda a, b: a + b)
                total[key] = combine(total[key], value) if key in total else value
        return total

    def all(self, flag: bool) -> bool:
        return all(self._all(bool(flag)))


def shard(model: torch.nn.Module) -> None:
    """FSDP2 over a Hugging Face decoder: each decoder layer one unit, the rest (embeddings, norm,
    head: tied weights stay together) the root; ranks' gradients are summed."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM


class LearnerRank:
    """One FSDP2 rank (a Ray actor)."""

    def __init__(self, config: dict[str, Any], rank: int, world: int, threads: int) -> None:
        torch.set_num_threads(threads)
        self.cfg: Config = validate_config(config)
        self.rank, self.world = rank, world

    def rendezvous(self) -> str:
        """Rank 0's address for the group: this node's IP and a free port."""
        import ray

        return f"tcp://{ray.util.get_node_ip_address()}:{free_port()}"

    def setup(self, init_method: str, weights: bytes, optimizer: dict[str, Any] | None) -> None:
        """Join the group, load the trainer's weights (and optimizer state, when resuming), shard."""
        import torch.distributed as dist

        from kvstreams.models import load_model

        cfg = self.cfg
        backend = "nccl" if cfg.model.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.world)
        model, _ = load_model(cfg.model.path, dtype=cfg.model.dtype, device=cfg.model.device)
        model.load_state_dict(state_from_bytes(weights), strict=True)
        reference = None
        if cfg.loss.kl_coef > 0:
            path = cfg.model.reference or cfg.model.path
            reference = load_model(path, dtype=cfg.model.dtype, device=cfg.model.device)[0]
        shard(model)
        torch.manual_seed(cfg.train.seed)
        self.learner = Learner(model, cfg, reference, group=FSDPGroup(self.rank, self.world))
        if optimizer is not None:
            self.load_optimizer(optimizer)

    def step(self, items: list[tuple[bytes, float]]) -> dict[str, float]:
        from kvstreams.trace import Trace
        from kvstreams.train.learner import trained_positions

        traces = [Trace.from_bytes(data, where=f"learner rank {self.rank}") for data, _ in items]
        batch = [TrainItem(t, a, trained_positions(t)) for t, (_, a) in zip(traces, items, strict=True)]
        return self.learner.step(batch)

    def weights_finite(self) -> bool:
        return self.learner.weights_finite()

    def full_weights(self) -> bytes | None:
        """The full weights (a collective: every rank calls it); rank 0 returns them."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.learner.model, options=options)
        return state_to_bytes(state) if self.rank == 0 else None

    def full_optimizer(self) -> dict[str, Any] | None:
        """The optimizer and scheduler state as a single process's ``state_dict()`` (parameters by
        index), gathered on rank 0 (a collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(self.learner.model, self.learner.optimizer, options=options)
        if self.rank != 0:
            return None
        index = {name: i for i, (name, _) in enumerate(self.learner.model.named_parameters())}
        return {
            "optimizer": {
                "state": {index[k]: v for k, v in state["state"].items()},
                "param_groups": [
                    {**g, "params": [index[p] for p in g["params"]]} for g in state["param_groups"]
                ],
            },
            "scheduler": self.learner.scheduler.state_dict(),
        }

    def load_optimizer(self, full: dict[str, Any]) -> None:
        """The inverse of :meth:`full_optimizer` (every rank gets the full state and keeps its shard)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = [name for name, _ in self.learner.model.named_parameters()]
        state = full["optimizer"]
        by_name = {
            "state": {names[int(i)]: v for i, v in state["state"].items()},
            "param_groups": [
                {**g, "params": [names[int(p)] for p in g["params"]]} for g in state["param_groups"]
            ],
        }
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(self.learner.model, self.learner.optimizer, by_name, options=options)
        self.learner.scheduler.load_state_dict(full["scheduler"])


class LearnerGroup:
    """The trainer's handle on the FSDP2 ranks, in place of a :class:`Learner`. ``mirror`` is a
    single-process learner in the trainer's process that never steps: it holds the weights and the
    optimizer state to start the ranks from (a fresh run or a checkpoint) and, after :meth:`gather`,
    what the ranks hold, for checkpoints, evaluation and the rollout workers' weights."""

    def __init__(self, cfg: Config, mirror: Learner, resumed: bool) -> None:
        c = cfg.cluster
        self.ray = start_ray(c)
        self.mirror = mirror
        actor = self.ray.remote(LearnerRank).options(num_cpus=c.learner_cpus, num_gpus=c.learner_gpus)
        config, threads = cfg.model_dump(), actor_threads(c.learner_cpus)
        self.ranks = [
            actor.remote(config, r, c.learner_world_size, threads) for r in range(c.learner_world_size)
        ]
        init_method = self.ray.get(self.ranks[0].rendezvous.remote())
        weights = self.ray.put(state_to_bytes(mirror.model.state_dict()))
        optimizer = _optimizer_state(mirror) if resumed else None
        self.ray.get([r.setup.remote(init_method, weights, optimizer) for r in self.ranks])

    @property
    def model(self):
        return self.mirror.model

    @property
    def optimizer(self):
        return self.mirror.optimizer

    @property
    def scheduler(self):
        return self.mirror.scheduler

    def _all(self, method: str, *args) -> list[Any]:
        return self.ray.get([getattr(r, method).remote(*args) for r in self.ranks])

    def step(self, items: list[TrainItem]) -> dict[str, float]:
        """One learner step on every rank (each rank returns the same metrics; rank 0's are kept)."""
        wire = self.ray.put([(i.trace.to_bytes(), float(i.advantage)) for i in items])
        return self._all("step", wire)[0]

    def weights_finite(self) -> bool:
        return all(self._all("weights_finite"))

    def gather(self, optimizer: bool = False) -> None:
        """Bring the ranks' weights (and, for a checkpoint, optimizer and scheduler state) into the
        mirror."""
        self.mirror.model.load_state_dict(state_from_bytes(self._all("full_weights")[0]), strict=True)
        if optimizer:
            full = self._all("full_optimizer")[0]
            self.mirror.optimizer.load_state_dict(full["optimizer"])
            self.mirror.scheduler.load_state_dict(full["scheduler"])

    def close(self) -> None:
        for rank in self.ranks:
            self.ray.kill(rank)


def _optimizer_state(learner: Learner) -> dict[str, Any]:
    return {"optimizer": learner.optimizer.state_dict(), "scheduler": learner.scheduler.state_dict()}
