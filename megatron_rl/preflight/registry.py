"""The preflight's checks, by name, in the order they run (later ones use what earlier ones
built: the trainer, then the engines)."""

from __future__ import annotations

from megatron_rl.preflight import collectives, engines, environment, model, trainer
from megatron_rl.preflight.context import Check

CHECKS: tuple[Check, ...] = (
    Check("environment", environment.check_versions, "versions against the pins"),
    Check("fp8", environment.check_fp8, "Transformer Engine and the GPU's FP8 recipes"),
    Check("model", model.check_model, "model.hf_path, its config and tokenizer"),
    Check("disk", environment.check_disk, "free disk for the checkpoints", ("model",)),
    Check("collectives", collectives.check_collectives, "bus bandwidth of the layout"),
    Check("trainer", trainer.check_trainer, "the production set-up builds", ("model",)),
    Check("engines", engines.check_engines, "engines start, push, log-prob gap", ("trainer",)),
    Check("update", trainer.check_update, "one policy update, peak memory", ("trainer",)),
    Check("checkpoint", trainer.check_checkpoint, "dist checkpoint save + load", ("update",)),
    Check("validation", engines.check_validation, "one validation pass's time", ("engines",)),
)

CHECK_NAMES: tuple[str, ...] = tuple(c.name for c in CHECKS)


def select(names: list[str] | None) -> tuple[Check, ...]:
    """The checks called ``names`` with every check they need, in run order (None: all).
    Raises ValueError naming an unknown check."""
    if not names:
        return CHECKS
    unknown = sorted(set(names) - set(CHECK_NAMES))
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(unknown)}; known: {', '.join(CHECK_NAMES)}")
    by_name = {c.name: c for c in CHECKS}
    wanted, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo.extend(by_name[name].needs)
    return tuple(c for c in CHECKS if c.name in wanted)
