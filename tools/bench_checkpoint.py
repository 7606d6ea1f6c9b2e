"""How long the training loop blocks per checkpoint: synchronous vs async saves (CPU, one rank).

For each model (the tiny preset, and a wider one with a few hundred MB of model + Adam
state) and each mode, a trainer-like loop makes ``--saves`` checkpoints with
``CheckpointManager`` (model + megatron optimizer + loop state, as the trainer saves them),
each followed by steps until the save is complete. A "step" changes every parameter in place
and then sleeps ``--step-seconds`` (on a GPU the host mostly waits while the device computes);
the loop polls ``finalize()`` once per step, as ``trainer/loop.py`` does.

Printed per model and mode: the state's size, the time the loop blocked per save (``save``
plus every ``finalize`` poll, publication included; median over the saves), and for async
saves the part of it spent in ``save`` (planning, staging, forking the writers; the rest is
the publication at ``finalize``: manifest, renames, pruning), the time until the checkpoint
was complete and the steps made meanwhile.

Usage: python tools/bench_checkpoint.py [--saves 3] [--step-seconds 0.5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

MODELS = {
    "tiny-llama": {},
    "wide (4 x 640)": {
        "num_hidden_layers": 4,
        "hidden_size": 640,
        "intermediate_size": 1792,
        "num_attention_heads": 10,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 8192,
    },
}


def build(overrides: dict):
    import torch

    from megatron_rl.config.sections import OptimizerConfig
    from megatron_rl.models import ModelConfig, preset_hf_config
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig
    from megatron_rl.trainer.optim import _materialize_state, build_optimizer, wrap_model

    torch.manual_seed(0)
    hf_config = preset_hf_config("tiny-llama", **overrides)
    model = build_model(
        ModelConfig(preset="tiny-llama", dtype="float32"), ParallelConfig(), hf_config
    )
    optimizer = build_optimizer(wrap_model(model), OptimizerConfig(lr=1e-3)).optimizer
    _materialize_state(optimizer)  # Adam moments, as after the first step
    return model, optimizer


def state_bytes(model, optimizer) -> int:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return 3 * params  # fp32 weights + two fp32 Adam moments


def run(model, optimizer, root: Path, async_save: bool, saves: int, step_seconds: float):
    import torch

    from megatron_rl.trainer.state import CheckpointManager

    manager = CheckpointManager(root, keep_last=2, async_save=async_save)
    blocked, in_save, complete, steps_in_flight = [], [], [], []
    step = 0
    for _ in range(saves):
        started = time.perf_counter()
        path = manager.save(step, model, {"step": step}, optimizer=optimizer)
        waited = time.perf_counter() - started
        in_save.append(waited)
        made = 0
        while True:  # training steps until this checkpoint is complete
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1e-3)
            time.sleep(step_seconds)
            step += 1
            made += 1
            t = time.perf_counter()
            done = manager.finalize() if async_save else path
            waited += time.perf_counter() - t
            if done is not None:
                break
        blocked.append(waited)
        complete.append(time.perf_counter() - started)
        steps_in_flight.append(made - 1 if async_save else 0)
        assert manager.damage(path) is None, path
    return {
        "blocked_s": statistics.median(blocked),
        "in_save_s": statistics.median(in_save),  # the rest: finalize polls (publication)
        "complete_s": statistics.median(complete) if async_save else statistics.median(blocked),
        "steps_while_writing": statistics.median(steps_in_flight),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--step-seconds", type=float, default=0.5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from megatron_rl.platform import ParallelConfig, init_distributed

    init_distributed(ParallelConfig())
    rows = []
    for name, overrides in MODELS.items():
        model, optimizer = build(overrides)
        size = state_bytes(model, optimizer)
        for mode in ("sync", "async"):
            with tempfile.TemporaryDirectory() as tmp:
                # one warm-up save (imports, plan caches), not counted
                run(model, optimizer, Path(tmp) / "warm", mode == "async", 1, 0.0)
                result = run(
                    model, optimizer, Path(tmp), mode == "async", args.saves, args.step_seconds
                )
            rows.append({"model": name, "state_mb": size / 1e6, "mode": mode, **result})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(
        f"{'model':16} {'state MB':>9} {'mode':6} {'blocked s':>10} {'in save s':>10} "
        f"{'complete s':>11} steps"
    )
    for r in rows:
        print(
            f"{r['model']:16} {r['state_mb']:9.1f} {r['mode']:6} {r['blocked_s']:10.3f} "
            f"{r['in_save_s']:10.3f} {r['complete_s']:11.2f} {r['steps_while_writing']:5.0f}"
        )


if __name__ == "__main__":
    main()
