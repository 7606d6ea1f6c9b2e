"""Where the two roles of a run go in a Slurm job (imports no torch).

GPUs are laid out in order: the trainer takes the first ``cluster.trainer_gpus`` GPUs of the
job, the generator engines the rest. On several nodes each role owns whole nodes (the trainer
the first ``trainer_gpus / gpus_per_node`` nodes of the allocation, which also hold
``MASTER_ADDR``); on one node the two roles share it. Trainer tasks own one GPU each (one
torch.distributed rank per GPU); generator tasks own one vLLM engine each, with
``rollout.tensor_parallel`` GPUs, never across nodes.

On a machine without GPUs (``device="cpu"``) the same layout holds with "GPUs" read as task
slots: nothing is requested from Slurm's GRES, and each task gets CPUs instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_rl.config.loader import ConfigError

if TYPE_CHECKING:
    from megatron_rl.config.schema import RunConfig

DEVICES: tuple[str, ...] = ("gpu", "cpu")


@dataclass(frozen=True)
class RoleLayout:
    """One role's Slurm step.

    Attributes:
        name: "trainer" or "generator" (also the step name, ``srun --job-name``).
        tasks: Slurm tasks of the step (trainer: ranks; generator: engines).
        nodes: nodes the step spans.
        tasks_per_node: at most this many tasks on one node.
        gpus_per_node: GPUs the step takes on each of its nodes.
        gpus_per_task: GPUs one task uses (trainer 1; generator ``rollout.tensor_parallel``).
        first_node: index of the step's first node in the job's host list.
        tasks_sharing_node: tasks of both roles on one of this step's nodes (the node's CPUs
            are split evenly among them unless a CPU count per task is given).
    """

    name: str
    tasks: int
    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    gpus_per_task: int
    first_node: int
    tasks_sharing_node: int


@dataclass(frozen=True)
class JobLayout:
    """The whole job: ``nodes`` x ``gpus_per_node`` split between the trainer and generator."""

    nodes: int
    gpus_per_node: int
    trainer: RoleLayout
    generator: RoleLayout
    device: str = "gpu"

    @property
    def shared_node(self) -> bool:
        """Both roles run on the one node of the job."""
        return self.nodes == 1

    def summary(self) -> str:
        """One line: the allocation and the split."""
        unit = "GPUs" if self.device == "gpu" else "slots"
        t, g = self.trainer, self.generator
        return (
            f"{self.nodes} node(s) x {self.gpus_per_node} {unit} = "
            f"{t.tasks * t.gpus_per_task} trainer {unit} ({t.tasks} rank(s) on {t.nodes} "
            f"node(s)) + {g.tasks * g.gpus_per_task} generator {unit} ({g.tasks} vLLM "
            f"engine(s) x {g.gpus_per_task} on {g.nodes} node(s))"
        )


def _fail(key: str, message: str) -> None:
    raise ConfigError(key, message)


def plan_job(config: RunConfig, device: str = "gpu") -> JobLayout:
    """The job layout of a validated RunConfig (``RunConfig.validate`` has already checked
    that the split adds up). Raises ConfigError, naming the key, for what only a Slurm job
    rules out: a trainer that does not fill whole nodes of a multi-node job, an engine wider
    than a node, or generator GPUs that no engine would use."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {device!r}")
    c, rollout = config.cluster, config.rollout
    trainer_gpus, generator_gpus, per_node = c.trainer_gpus, c.generator_gpus, c.gpus_per_node
    if trainer_gpus + generator_gpus != c.nodes * per_node:  # RunConfig.validate checks it too
        _fail(
            "cluster.trainer_gpus",
            f"trainer_gpus {trainer_gpus} + generator_gpus {generator_gpus} must equal nodes "
            f"{c.nodes} x gpus_per_node {per_node}",
        )
    tp = rollout.tensor_parallel
    if tp > per_node:
        _fail(
            "rollout.tensor_parallel",
            f"an engine of {tp} GPUs does not fit on one node of cluster.gpus_per_node "
            f"{per_node} (engines never span nodes)",
        )
    if rollout.engines * tp != generator_gpus:
        _fail(
            "rollout.engines",
            f"{rollout.engines} engine(s) x rollout.tensor_parallel {tp} = "
            f"{rollout.engines * tp} GPUs, but cluster.generator_gpus is {generator_gpus}: "
            f"every generator GPU of the job should run an engine (set rollout.engines to "
            f"{generator_gpus // tp})",
        )
    if c.nodes == 1:
        both = trainer_gpus + rollout.engines
        trainer = RoleLayout("trainer", trainer_gpus, 1, trainer_gpus, trainer_gpus, 1, 0, both)
        generator = RoleLayout(
            "generator", rollout.engines, 1, rollout.engines, generator_gpus, tp, 0, both
        )
        return JobLayout(1, per_node, trainer, generator, device)
    if trainer_gpus % per_node:
        _fail(
            "cluster.trainer_gpus",
            f"{trainer_gpus} is not a multiple of cluster.gpus_per_node {per_node}: on several "
            "nodes the trainer and the generator each own whole nodes",
        )
    if per_node % tp:
        _fail(
            "rollout.tensor_parallel",
            f"{tp} does not divide cluster.gpus_per_node {per_node}: generator nodes would "
            "hold a part of an engine",
        )
    trainer_nodes = trainer_gpus // per_node
    trainer = RoleLayout("trainer", trainer_gpus, trainer_nodes, per_node, per_node, 1, 0, per_node)
    engines_per_node = per_node // tp
    generator = RoleLayout(
        "generator",
        rollout.engines,
        c.nodes - trainer_nodes,
        engines_per_node,
        per_node,
        tp,
        trainer_nodes,
        engines_per_node,
    )
    return JobLayout(c.nodes, per_node, trainer, generator, device)


def segment_nodes(config: RunConfig, layout: JobLayout) -> int | None:
    """Nodes per ``#SBATCH --segment`` of a GPU job (None: no request). A segment lies inside
    one block of Slurm's topology/block (an NVL72 rack), and the trainer takes the first
    ``trainer.nodes`` nodes of the allocation, so a segment at least that large keeps the
    trainer inside one NVLink domain: its EP all-to-all and TP collectives never cross to
    InfiniBand. (That reasoning holds when each block's node names form one sorted range, so the
    first names of the allocation are one block's.) Raises ConfigError for an explicit
    ``cluster.segment`` that cannot do that."""
    c = config.cluster
    if layout.device != "gpu" or layout.nodes == 1 or c.segment == 0:
        return None
    domain = c.nvlink_domain_gpus // c.gpus_per_node  # nodes of one NVLink domain
    need = layout.trainer.nodes
    if c.segment is not None:
        if layout.nodes % c.segment:
            _fail("cluster.segment", f"{c.segment} does not divide cluster.nodes {layout.nodes}")
        if c.segment < need:
            _fail(
                "cluster.segment",
                f"{c.segment} nodes cannot hold the trainer's {need} nodes in one segment",
            )
        if domain > 1 and c.segment > domain:
            _fail(
                "cluster.segment",
                f"{c.segment} nodes exceed one NVLink domain ({c.nvlink_domain_gpus} GPUs = "
                f"{domain} nodes, cluster.nvlink_domain_gpus)",
            )
        return c.segment
    if domain <= 1 or need > domain:  # no NVLink between nodes, or the trainer outgrows a rack
        return None
    fits = [n for n in range(need, domain + 1) if layout.nodes % n == 0]
    return fits[0] if fits else None
