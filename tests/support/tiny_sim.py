"""A tiny cost model and length model for simulator tests (shared with the layering test)."""

from __future__ import annotations

from megatron_rl.simulation.costs import HARDWARE, CostModel
from megatron_rl.simulation.workload import LengthModel


def tiny_costs(**changes) -> CostModel:
    model = CostModel(
        hardware=HARDWARE["h200"],
        total_params=10**9,
        active_params=10**9,
        engine_tp=1,
        engine_weight_bytes=2 * 10**9,
        kv_read_bytes_per_token=10**5,
        kv_capacity_tokens=10**7,
        push_bytes=2 * 10**9,
        trainer_gpus=1,
        attention_dims=((1024, None),) * 4,
        recompute=False,
    )
    return model.with_(**changes)


TINY_LENGTHS = LengthModel(
    max_prompt_tokens=64,
    max_tokens=600,
    thinking_budget=(400, 500),
    answer_budget=50,
    prompt_median=32,
    think_median=120,
    think_sigma=1.0,  # a heavy tail: stragglers make k matter
    answer_median=20,
)
