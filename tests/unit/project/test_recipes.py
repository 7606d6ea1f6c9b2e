"""Every shipped recipe loads; each published recipe has its distinguishing settings
(docs/paper.md sections 2-4); each leave-one-out variant differs from ScaleRL in exactly its
one component."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import diff_keys, load_run_config, to_yaml

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
ALL = sorted(RECIPES.glob("*.yaml"))


def load(name: str):
    return load_run_config(RECIPES / f"{name}.yaml")


def test_recipes_are_shipped():
    names = {p.stem for p in ALL}
    expected = {
        "base_scalerl", "scalerl_8b", "scalerl_scout", "deepseek_grpo", "qwen25_dapo",
        "magistral", "minimax_m1", "tiny_cpu", "tiny_cpu_ppo", "scalerl_8b_math_code",
        "tiny_cpu_math_code", "scalerl_8b_tool", *LOO,
    }  # fmt: skip
    assert expected <= names


@pytest.mark.parametrize("path", ALL, ids=[p.stem for p in ALL])
def test_every_recipe_loads_validates_and_round_trips(path, tmp_path):
    cfg = load_run_config(path)
    assert cfg.name == path.stem
    again = tmp_path / path.name
    again.write_text(to_yaml(cfg))
    assert load_run_config(again) == cfg


def test_scalerl_8b_is_the_paper_run():
    cfg = load("scalerl_8b")
    assert cfg.model.preset == "llama3-8b" and cfg.model.fp32_head and cfg.rollout.fp32_head
    assert cfg.data.source == "POLARIS-Project/Polaris-Dataset-53K" and cfg.data.val_size == 1000
    assert (cfg.batch.prompts_per_step, cfg.batch.samples_per_prompt) == (48, 16)
    assert cfg.rollout.samples_per_prompt == 16
    # 14k generation with interruptions: thinking cut in [10k, 12k] of 12,288 + 2,048 answer.
    intr = cfg.rollout.interruption
    assert intr.enabled and tuple(intr.thinking_budget) == (10240, 12288)
    assert intr.answer_budget == 2048 and cfg.rollout.max_tokens == 12288 + 2048
    assert cfg.data.max_prompt_tokens + cfg.rollout.max_tokens == 16384
    a = cfg.algorithm
    assert (a.loss, a.aggregation, a.advantage_normalization) == ("cispo", "prompt", "batch")
    assert a.zero_variance_filter and a.npr_threshold == 0.9 and not a.length_penalty
    assert (cfg.off_policy.mode, cfg.off_policy.max_lag) == ("pipeline_rl", 8)
    o = cfg.optimizer
    assert (o.lr, o.warmup_steps, o.eps, o.weight_decay) == (5e-7, 100, 1e-15, 0.01)
    assert (cfg.validation.every_steps, cfg.validation.samples_per_prompt) == (100, 16)
    c = cfg.cluster
    assert (c.nodes, c.gpus_per_node, c.trainer_gpus, c.generator_gpus) == (20, 4, 16, 64)
    assert cfg.rollout.engines * cfg.rollout.tensor_parallel == 64
    assert (cfg.training.max_steps, cfg.training.max_gpu_hours) == (7400, 100000)


def test_scalerl_scout_uses_expert_parallelism():
    cfg = load("scalerl_scout")
    assert cfg.model.preset == "llama4-scout" and cfg.parallel.expert > 1
    assert 16 % cfg.parallel.expert == 0  # Scout's 16 experts
    assert (cfg.training.max_steps, cfg.training.max_gpu_hours) == (7100, 50000)
    c = cfg.cluster
    assert c.trainer_gpus + c.generator_gpus == c.nodes * c.gpus_per_node
    # The ScaleRL recipe itself is unchanged: only model, layout, budget and cluster differ.
    changed = {k.split(".")[0] for k in diff_keys(load("scalerl_8b"), cfg)}
    assert changed == {"name", "model", "parallel", "rollout", "training", "cluster"}
    assert {k for k in diff_keys(load("scalerl_8b"), cfg) if k.startswith("rollout")} == {
        "rollout.engines",
        "rollout.tensor_parallel",
        "rollout.expert_parallel",  # each engine GPU holds whole experts
        "rollout.kv_cache_gb",  # 20% of the engine GPU left free (megatron-rl plan)
    }
    assert cfg.rollout.expert_parallel and cfg.rollout.tensor_parallel >= 2


# recipe -> (loss, eps_low, eps_high, aggregation, normalization, off-policy mode, k or lag,
#            prompts per step, zero-variance filter, fp32 head, NPR threshold)
PUBLISHED = {
    "deepseek_grpo": ("ppo_clip", 0.2, 0.2, "sample", "group", "ppo", 8, 48, False, False, None),
    "qwen25_dapo": ("ppo_clip", 0.2, 0.28, "prompt", "group", "ppo", 8, 80, True, False, None),
    "magistral": ("ppo_clip", 0.2, 0.26, "prompt", "batch", "pipeline_rl", 8, 48, True, False,
                  None),
    "minimax_m1": ("cispo", None, None, "prompt", "group", "ppo", 8, 80, True, True, None),
    "scalerl_8b": ("cispo", None, None, "prompt", "batch", "pipeline_rl", 8, 48, True, True, 0.9),
}  # fmt: skip
DYNAMIC_SAMPLING = {"qwen25_dapo", "magistral"}  # DAPO section 3.2; Magistral section 2.1
# The paper each compared recipe's YAML cites for its settings.
SOURCES = {
    "deepseek_grpo": "arXiv 2402.03300",
    "qwen25_dapo": "arXiv 2503.14476",
    "magistral": "arXiv 2506.10344",
    "minimax_m1": "arXiv 2506.13585",
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_recipe_settings(name):
    loss, low, high, agg, norm, mode, k, prompts, zvf, fp32, npr = PUBLISHED[name]
    cfg = load(name)
    a = cfg.algorithm
    assert (a.loss, a.eps_low, a.eps_high) == (loss, low, high)
    assert (a.aggregation, a.advantage_normalization) == (agg, norm)
    assert cfg.off_policy.mode == mode
    assert (cfg.off_policy.k if mode == "ppo" else cfg.off_policy.max_lag) == k
    assert (cfg.batch.prompts_per_step, cfg.batch.samples_per_prompt) == (prompts, 16)
    assert a.zero_variance_filter is zvf and a.npr_threshold == npr
    assert cfg.model.fp32_head is fp32 and cfg.rollout.fp32_head is fp32
    assert cfg.data.dynamic_sampling is (name in DYNAMIC_SAMPLING)
    if name in SOURCES:  # the YAML names its source and ScaleRL's re-implementation
        text = (RECIPES / f"{name}.yaml").read_text()
        assert SOURCES[name] in text and "arXiv 2510.13786" in text
    # Same model and data as ScaleRL: the comparison changes only the recipe.
    assert cfg.model.preset == "llama3-8b" and "Polaris" in cfg.data.source


def test_dapo_clip_is_asymmetric_and_grpo_symmetric():
    dapo, grpo = load("qwen25_dapo").algorithm, load("deepseek_grpo").algorithm
    assert dapo.loss_params() == {"eps_low": 0.2, "eps_high": 0.28}  # DAPO section 4.1
    assert grpo.loss_params() == {"eps_low": 0.2, "eps_high": 0.2}
    assert load("minimax_m1").algorithm.loss_params() == {"eps_max": 4.0}


def test_dapo_has_its_overlong_reward_shaping_and_dynamic_sampling_cap():
    cfg = load("qwen25_dapo")
    a = cfg.algorithm
    # DAPO section 3.4: soft overlong punishment on every response, a 4,096-token cache,
    # here ending at ScaleRL's generation budget, instead of forced interruptions.
    assert (a.length_penalty, a.length_penalty_on, a.length_penalty_l_cache) == (True, "all", 4096)
    assert a.length_penalty_l_max == cfg.rollout.max_tokens
    assert not cfg.rollout.interruption.enabled
    # verl recipe/dapo: max_num_gen_batches 10 of 3 x B prompts
    assert cfg.data.dynamic_sampling_max_rounds == 30


# Leave-one-out variant -> the exact keys in which it differs from ScaleRL (same budget).
LOO = {
    "loo_prompt_adv_norm": {"algorithm.advantage_normalization"},
    "loo_length_penalty": {"algorithm.length_penalty", "rollout.interruption.enabled"},
    "loo_no_zero_variance_filter": {"algorithm.zero_variance_filter"},
    "loo_ppo_off_policy": {"off_policy.mode"},
    "loo_no_fp32_head": {"model.fp32_head", "rollout.fp32_head"},
    "loo_sample_average": {"algorithm.aggregation"},
    "loo_dapo_loss": {"algorithm.loss", "algorithm.eps_low", "algorithm.eps_high"},
}


@pytest.mark.parametrize("name", sorted(LOO))
def test_leave_one_out_differs_in_exactly_its_component(name):
    base, variant = load("base_scalerl"), load(name)
    assert diff_keys(base, variant) - {"name"} == LOO[name]
    assert variant.training.max_gpu_hours == 16000  # the paper's 16k GPU-h per variant


def test_routing_replay_recipe_adds_only_routing_replay_to_scout():
    base, variant = load("scalerl_scout"), load("scalerl_scout_routing_replay")
    assert diff_keys(base, variant) - {"name"} == {
        "algorithm.routing_replay",
        "rollout.enforce_eager",
    }
    assert variant.algorithm.routing_replay and not base.algorithm.routing_replay
    assert not any(
        load_run_config(p).algorithm.routing_replay for p in ALL if "routing" not in p.stem
    )


def test_shipped_recipes_keep_the_loss_ratio_against_the_generator():
    """The paper's recipes have no train-inference mismatch correction (issue 39: off by
    default, named in new recipes only)."""
    assert {load_run_config(p).algorithm.mismatch for p in ALL} == {"none"}


def test_leave_one_out_values():
    assert load("loo_prompt_adv_norm").algorithm.advantage_normalization == "group"
    lp = load("loo_length_penalty").algorithm
    assert (lp.length_penalty, lp.length_penalty_l_max, lp.length_penalty_l_cache) == (
        True,
        14336,
        2048,
    )
    assert load("loo_ppo_off_policy").off_policy.k == 8
    assert load("loo_sample_average").algorithm.aggregation == "sample"
    dapo = load("loo_dapo_loss").algorithm
    assert (dapo.loss, dapo.eps_low, dapo.eps_high) == ("ppo_clip", 0.2, 0.26)


def test_tiny_recipes_run_the_full_recipe_at_cpu_scale():
    tiny = load("tiny_cpu")
    assert tiny.model.preset == "tiny-llama" and tiny.model.dtype == "float32"
    assert tiny.data.source == "synthetic" and tiny.warm_start.steps > 0
    assert tiny.rollout.interruption.enabled and tiny.rollout.max_tokens <= 64
    assert tiny.batch.prompts_per_step * tiny.batch.samples_per_prompt <= 128
    assert tiny.validation.every_steps <= 10 and tiny.data.val_size > 0
    # The ScaleRL algorithm is inherited unchanged from the base.
    base = load("base_scalerl")
    assert not {k for k in diff_keys(base, tiny) if k.startswith("algorithm")}
    assert tiny.off_policy.mode == "pipeline_rl"
    ppo = load("tiny_cpu_ppo")
    assert diff_keys(tiny, ppo) - {"name"} == {"off_policy.mode", "off_policy.k"}
    assert (ppo.off_policy.mode, ppo.off_policy.k) == ("ppo", 1)


def test_scalerl_8b_math_code_is_the_paper_run_on_polaris_and_deepcoder():
    main, joint = load("scalerl_8b"), load("scalerl_8b_math_code")
    # The ScaleRL recipe is unchanged: only the data and the number of code sandboxes.
    assert diff_keys(main, joint) - {"name"} == {"data.sources", "reward.num_workers"}
    sources = joint.data.resolve()
    math = [s for s in sources if s.domain == "math"]
    code = [s for s in sources if s.domain == "code"]
    assert [s.config.source for s in math] == ["POLARIS-Project/Polaris-Dataset-53K"]
    assert {s.config.source for s in code} == {"agentica-org/DeepCoder-Preview-Dataset"}
    assert all(s.config.format == "deepcoder" and s.config.fields()[2] == "tests" for s in code)
    # 1,000 held-out prompts of each domain (docs/paper.md section 1).
    assert sum(s.config.val_size for s in math) == sum(s.config.val_size for s in code) == 1000
    assert sum(s.weight for s in math) == pytest.approx(sum(s.weight for s in code))


def test_scalerl_8b_tool_is_the_8b_run_with_llama3_python_tool_episodes():
    """Issue 38: the production tool recipe changes only the episodes (turns, environment)
    and the system turn that switches Llama-3.1's code interpreter on; the episode's token
    budget and every ScaleRL setting stay those of scalerl_8b."""
    main, tool = load("scalerl_8b"), load("scalerl_8b_tool")
    changed = diff_keys(main, tool) - {"name"}
    assert {k.split(".")[0] for k in changed} == {"data", "rollout"}
    assert {k for k in changed if k.startswith("data")} == {"data.system_prompt"}
    assert {k for k in changed if k.startswith("rollout")} - {"rollout.max_turns"} == {
        k for k in changed if k.startswith("rollout.environment")
    }
    # Meta's switch, "Environment: ipython", is the chat template's (builtin_tools), not ours
    assert "Environment: ipython" not in tool.data.system_prompt
    from megatron_rl.trainer.setup import template_kwargs

    assert template_kwargs(tool, None) == {"builtin_tools": ["code_interpreter"]}
    env = tool.rollout.environment
    assert (tool.rollout.max_turns, env.name, env.tool_format) == (4, "python_tool", "llama3")
    assert tool.rollout.max_tokens == main.rollout.max_tokens == 14336
    assert tool.rollout.interruption == main.rollout.interruption
    # the tool's output of all calls is a small part of the budget
    assert (tool.rollout.max_turns - 1) * env.max_tool_output_tokens <= tool.rollout.max_tokens / 8


def test_tiny_math_code_mixes_the_arithmetic_and_code_tasks_at_cpu_scale():
    tiny, joint = load("tiny_cpu"), load("tiny_cpu_math_code")
    sources = joint.data.resolve()
    assert [(s.domain, s.config.source) for s in sources] == [
        ("math", "synthetic"),
        ("code", "synthetic_code"),
    ]
    assert all(s.config.val_size > 0 and s.config.solution_field for s in sources)
    assert not {k for k in diff_keys(tiny, joint) if k.startswith(("algorithm", "off_policy"))}
    assert joint.rollout.interruption.enabled and joint.warm_start.steps > 0
