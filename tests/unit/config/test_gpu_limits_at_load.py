"""GPU-only paths a recipe asks for are refused at load, naming the key (issue 36, item 6):
``nccl_m2n`` on a layout its source mesh cannot describe, an FP8 recipe the cluster's GPU
does not run; and the FP8 table follows Transformer Engine's own checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_run_config
from megatron_rl.config.checks import m2n_layout_problem
from megatron_rl.planning.gpus import GPUS, fp8_recipes

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
SCOUT = RECIPES / "scalerl_scout.yaml"


def _error(recipe: Path, overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_run_config(recipe, overrides)
    return info.value


def test_scout_with_nccl_m2n_is_refused_at_load_naming_the_key():
    # Scout: TP 4, EP 16: the m2n source mesh would be 16 ranks, over which TP 4 cannot be
    # described (TP and EP must each be 1 or max(TP, EP)).
    err = _error(SCOUT, ["rollout.weight_transport=nccl_m2n"])
    assert err.key == "rollout.weight_transport"
    assert "parallel.tensor 4" in err.message and "max 16" in err.message
    # The layouts m2n takes load: TP = EP, or one of them 1.
    for ok in (["parallel.expert=4"], ["parallel.tensor=1", "parallel.sequence_parallel=false"]):
        config = load_run_config(SCOUT, ["rollout.weight_transport=nccl_m2n", *ok])
        assert config.rollout.weight_transport == "nccl_m2n"


@pytest.mark.parametrize(
    ("layout", "named"),
    [
        ((2, 4, 1, 1), "parallel.tensor 2"),  # TP 2 over a mesh of EP 4
        ((8, 2, 1, 1), "parallel.expert 2"),
        ((2, 1, 2, 1), "parallel.pipeline 1 (got 2)"),
        ((1, 2, 1, 2), "parallel.expert_tensor 1 (got 2)"),
    ],
)
def test_m2n_layout_limits(layout, named):
    assert named in m2n_layout_problem(*layout)


def test_m2n_layouts_it_takes():
    for layout in ((1, 1, 1, 1), (4, 4, 1, 1), (8, 1, 1, 1), (1, 16, 1, 1)):
        assert m2n_layout_problem(*layout) is None


def test_fp8_recipes_follow_transformer_engine_by_capability_and_cuda():
    # TE 2.9-2.11 quantization.py: delayed / tensorwise from sm_89 (CUDA >= 12.1 on Ada),
    # blockwise from sm_90 with CUDA >= 12.9, MXFP8 on sm_100 and sm_110, not sm_120.
    assert fp8_recipes(None) == () and fp8_recipes((8, 0)) == ()
    assert fp8_recipes((8, 9), "12.0") == () and fp8_recipes((8, 9), "12.4") == (
        "delayed",
        "tensorwise",
    )
    assert fp8_recipes((9, 0), "12.8") == ("delayed", "tensorwise")
    assert fp8_recipes((9, 0), "12.9") == ("delayed", "tensorwise", "blockwise")
    assert fp8_recipes((10, 0), "13.0") == ("delayed", "tensorwise", "blockwise", "mxfp8")
    assert "mxfp8" not in fp8_recipes((12, 0), "13.0")
    assert GPUS["h200"].fp8_recipes == ("delayed", "tensorwise", "blockwise")
    assert "mxfp8" in GPUS["gb200"].fp8_recipes and "mxfp8" not in GPUS["h100"].fp8_recipes


def test_an_fp8_recipe_the_cluster_gpu_lacks_is_refused_at_load():
    fp8 = ["model.fp8=e4m3", "model.fp8_recipe=mxfp8"]
    err = _error(SCOUT, ["cluster.gpu=h200", *fp8])
    assert err.key == "model.fp8_recipe" and "'mxfp8'" in err.message and "h200" in err.message
    assert load_run_config(SCOUT, ["cluster.gpu=gb200", *fp8]).model.fp8_recipe == "mxfp8"
    # blockwise runs on Hopper and Blackwell (CUDA >= 12.9): listed for both
    for gpu in ("h100", "gb200"):
        load_run_config(
            SCOUT, [f"cluster.gpu={gpu}", "model.fp8=e4m3", "model.fp8_recipe=blockwise"]
        )
    assert _error(SCOUT, ["cluster.gpu=v100"]).key == "cluster.gpu"  # not in the table
    # the A100 is (compute capability 8.0): no FP8 recipe runs there
    assert _error(SCOUT, ["cluster.gpu=a100", *fp8]).key == "model.fp8_recipe"


def test_plan_plans_for_the_recipes_gpu_unless_told_otherwise():
    from megatron_rl.planning import plan_run

    config = load_run_config(SCOUT, ["cluster.gpu=h100"])
    assert plan_run(config, search=False).gpu.name == "h100"
    assert plan_run(config, gpu="gb200", search=False).gpu.name == "gb200"


def test_context_parallelism_is_refused_at_load_naming_the_key():
    """No forward of ours splits sequences across context-parallel ranks (megatron's GPTModel
    leaves it to the caller): CP > 1 would train every rank on whole sequences at wrong
    positions. Refused at load; no shipped recipe asks for it."""
    err = _error(SCOUT, ["parallel.context=2"])
    assert err.key == "parallel.context" and "must be 1, got 2" in err.message
    for recipe in sorted(RECIPES.glob("*.yaml")):
        assert load_run_config(recipe).parallel.context == 1, recipe.name
