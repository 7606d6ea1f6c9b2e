"""Parallelism settings of the trainer (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.errors import ConfigError

# torchrun's rendezvous variables: a process that forms a world of its own (an engine, a
# benchmark's `megatron-rl train`) must not inherit its launcher's.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class ParallelConfig:
    """Megatron-Core model parallelism. Data parallelism is what remains of the world size."""

    tensor: int = 1  # tensor-parallel size (TP)
    pipeline: int = 1  # pipeline-parallel stages (PP)
    expert: int = 1  # expert-parallel size (EP, MoE models)
    # Tensor parallelism inside experts. 1 (experts whole, spread by expert parallelism) is the
    # usual choice for MoE and the only one modelopt 0.47's packed Llama-4 expert import slices
    # correctly (it cuts the fused gate/up tensor contiguously across ranks).
    expert_tensor: int = 1
    # context-parallel size (CP): only 1; the forward splits no sequence across CP ranks
    context: int = 1
    sequence_parallel: bool = False  # Megatron sequence parallelism (needs tensor > 1)
    timeout_minutes: int = 30  # collectives time out instead of hanging forever

    def validate(self) -> None:
        for name in ("tensor", "pipeline", "expert", "context", "timeout_minutes"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.expert_tensor < 1:
            raise ConfigError("expert_tensor", f"must be >= 1, got {self.expert_tensor}")
        if self.context > 1:
            # megatron-core's GPTModel leaves the split of each sequence (and of its positions
            # and packed boundaries) across context-parallel ranks to the caller; ours passes
            # whole sequences, so every CP rank would train on wrong positions, silently.
            raise ConfigError(
                "context",
                f"must be 1, got {self.context}: context parallelism is not implemented (the "
                "trainer's forward does not split sequences across context-parallel ranks)",
            )
        if self.sequence_parallel and self.tensor == 1:
            raise ConfigError("sequence_parallel", "needs parallel.tensor > 1")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor * self.pipeline * self.context
