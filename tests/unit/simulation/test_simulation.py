"""The cluster simulator: cost model by hand, conservation and lag bound on the real
RolloutSource, utilisation ordering (tiny configs: each test runs in well under 10 s)."""

from __future__ import annotations

import pytest
from support.tiny_sim import TINY_LENGTHS, tiny_costs

from megatron_rl.simulation.costs import HARDWARE, active_parameters, cost_model
from megatron_rl.simulation.run import SimSettings, simulate


def tiny_settings(mode: str, k: int, **changes) -> SimSettings:
    fields = dict(
        mode=mode,
        k=k,
        prompts_per_step=4,
        samples_per_prompt=4,
        engines=2,
        max_num_seqs=16,
        generator_gpus=2,
        trainer_gpus=1,
        steps=32,
        warmup=4,
    )
    fields.update(changes)
    return SimSettings(**fields)


# Loading a recipe imports the config package: ~3 s of CPU, but a minute of wall time on a
# loaded shared machine.
@pytest.mark.timeout(240)
def test_decode_step_and_train_step_by_hand():
    from megatron_rl.config import load_run_config

    costs = cost_model(load_run_config("recipes/scalerl_8b.yaml", []), "gb200")
    # Llama-3.1-8B: 32 layers, 8 KV heads of 128, bf16: K and V of one token on all layers.
    assert costs.kv_read_bytes_per_token == 2 * 8 * 128 * 2 * 32
    assert costs.engine_weight_bytes == pytest.approx(2 * 8.03e9, rel=1e-3)  # 8.03B params
    # HBM roofline on a GB200 (8 TB/s at 70%): weights + 1,000 context tokens, + 2 ms.
    expected = (16.0605e9 + 131072 * 1000) / (8e12 * 0.7) + 0.002
    assert costs.decode_step(1, 1000) == pytest.approx(expected, rel=1e-4)
    # 6 x active params x tokens (+ causal attention) over 16 GPUs x 2.5 PFLOP/s x 40% MFU.
    n = 7.50e9  # 8.03B less the 0.53B input embedding (128,256 x 4,096)
    attention = 3 * 32 * 2 * 4096 * 1000 * 1000
    expected = (6 * n * 1000 + attention) / (16 * 2.5e15 * 0.4)
    assert costs.train_step([1000]) == pytest.approx(expected, rel=1e-3)
    # Push: 8.03B params in bf16 (the FP32 head too) over 400 Gb/s IB at 80%.
    assert costs.push() == pytest.approx(2 * 8.03e9 / (50e9 * 0.8), rel=1e-3)


@pytest.mark.timeout(240)
def test_moe_flops_use_active_parameters():
    from megatron_rl.config import load_run_config
    from megatron_rl.planning.shapes import model_shapes

    config = load_run_config("recipes/scalerl_scout.yaml", [])
    shapes = model_shapes(config.model)
    # Llama-4 Scout: 17B active of 109B total (Meta's model card; ~108B in megatron's count);
    # the card's 17B counts the input embedding, which does no matmul.
    embedding = shapes.vocab * shapes.hidden
    assert active_parameters(shapes) + embedding == pytest.approx(17e9, rel=0.03)
    assert shapes.total_parameters() == pytest.approx(108e9, rel=0.02)


@pytest.mark.parametrize(("mode", "k"), [("pipeline_rl", 1), ("pipeline_rl", 4), ("ppo", 4)])
def test_every_prompt_trained_once_and_lag_bounded(mode, k):
    result = simulate(tiny_costs(), TINY_LENGTHS, tiny_settings(mode, k))
    trained = result.trained_prompts
    assert len(trained) == len(set(trained))  # nothing twice
    assert set(result.submitted_prompts) == set(trained) | set(result.in_flight_prompts)
    assert not set(trained) & set(result.in_flight_prompts)  # nothing dropped, nothing lost
    bound = k if mode == "pipeline_rl" else k - 1  # PPO minibatch j trains at lag j
    assert result.max_lag <= bound
    assert sum(result.lag_tokens.values()) > 0
    assert 0 < result.generator_busy <= 1 and 0 < result.trainer_busy <= 1


def test_trained_fraction_scales_the_update_and_never_slows_a_step():
    """PPO-off-policy-1 generates the same batches whatever the update costs (seeded
    lengths, nothing overlaps): half the groups trained on is exactly half the update time."""
    full = simulate(tiny_costs(), TINY_LENGTHS, tiny_settings("ppo", 1, warmup=0))
    half = simulate(
        tiny_costs(), TINY_LENGTHS, tiny_settings("ppo", 1, warmup=0, trained_fraction=0.5)
    )
    assert half.trained_prompts == full.trained_prompts
    update = lambda r: r.trainer_busy * r.seconds  # noqa: E731
    assert update(half) == pytest.approx(update(full) / 2, rel=1e-9)
    assert half.seconds == pytest.approx(full.seconds - update(full) / 2, rel=1e-9)
    pipeline = [
        simulate(tiny_costs(), TINY_LENGTHS, tiny_settings("pipeline_rl", 4, trained_fraction=f))
        for f in (1.0, 0.5)
    ]
    assert pipeline[1].seconds_per_step <= pipeline[0].seconds_per_step * 1.01
    with pytest.raises(ValueError, match="trained_fraction"):
        tiny_settings("ppo", 1, trained_fraction=0.0)


def test_kv_cache_overflow_preempts_and_still_finishes_everything():
    costs = tiny_costs(kv_capacity_tokens=1500)  # a few sequences' worth
    result = simulate(costs, TINY_LENGTHS, tiny_settings("pipeline_rl", 2))
    assert result.preemptions > 0
    assert len(result.trained_prompts) == len(set(result.trained_prompts))
    assert result.max_lag <= 2


def test_larger_k_never_lowers_generator_utilisation():
    busy = []
    for k in (1, 2, 4, 8):
        busy.append(simulate(tiny_costs(), TINY_LENGTHS, tiny_settings("pipeline_rl", k)))
    for small, large in zip(busy, busy[1:]):
        assert large.generator_busy >= small.generator_busy - 0.01
        assert large.seconds_per_step <= small.seconds_per_step * 1.01
    # PPO-off-policy-k: k x B prompts in flight at once fill more of the engines' slots.
    ppo = [simulate(tiny_costs(), TINY_LENGTHS, tiny_settings("ppo", k, warmup=0)) for k in (1, 8)]
    assert ppo[1].generator_occupancy > ppo[0].generator_occupancy


@pytest.mark.timeout(240)
def test_simulate_run_tool_prints_a_table_and_a_plot(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    plot = tmp_path / "util.png"
    out = subprocess.run(
        [
            sys.executable,
            str(root / "tools/simulate_run.py"),
            "recipes/tiny_cpu.yaml",
            "--k",
            "1",
            "2",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--plot",
            str(plot),
        ],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith(("| PipelineRL", "| PPO"))]
    assert len(rows) == 4  # 2 modes x 2 k
    assert plot.stat().st_size > 0


@pytest.mark.timeout(240)
def test_simulator_imports_no_torch():
    import subprocess
    import sys

    code = (
        "import sys, megatron_rl.simulation.run, megatron_rl.simulation.costs; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_cost_constant_cites_a_source_or_says_assumption():
    """Every number of simulation/costs.py's module-level constants and hardware table carries
    'source:', 'assumption' or 'fitted:' on its line or in the comment lines right above it."""
    import re
    from pathlib import Path

    import megatron_rl.simulation.costs as costs

    lines = Path(costs.__file__).read_text().splitlines()
    tags = re.compile(r"#.*(source:|assumption|fitted:)", re.IGNORECASE)
    number = re.compile(r"(?<![\w.])\d[\d_]*(\.\d+)?(e-?\d+)?")
    checked, bare = 0, []
    in_table = False
    for i, line in enumerate(lines):
        code = line.split("#")[0]
        if re.match(r"^(HARDWARE|CALIBRATED)\b", line):
            in_table = True
        elif in_table and line.startswith("}"):
            in_table = False
        constant = re.match(r"^[A-Z][A-Z0-9_]* = ", line) or (
            in_table and re.match(r"^\s+(\w+=|\"\w+\": )", code)
        )
        if not constant or not number.search(code.split("=", 1)[-1].split(":", 1)[-1]):
            continue
        if "source=" in code or "name=" in code:
            continue
        checked += 1
        j, context = i - 1, [line]
        while j >= 0 and lines[j].strip().startswith("#"):
            context.append(lines[j])
            j -= 1
        if not any(tags.search(c) for c in context):
            bare.append(f"costs.py:{i + 1}: {line.strip()}")
    assert checked >= 29  # three GPUs x 5 numbers, 2 units, 9 factors, 3 fitted ones
    assert not bare, "constants without a source or 'assumption':\n" + "\n".join(bare)


def test_h100_hardware_from_its_datasheet():
    h100 = HARDWARE["h100"]
    assert h100.hbm_bytes_per_s == 3.35e12 and h100.bf16_dense_flops == 0.989e15
    assert h100.memory_bytes == 81559 * 2**20 and h100.nvlink_domain_gpus == 8


def test_dp_imbalance_of_modulo_and_balanced_assignments():
    import random
    import statistics

    from megatron_rl.simulation.run import dp_imbalance

    # by hand: 4 groups on 2 ranks, all kept
    assert dp_imbalance([10, 1, 10, 1], [True] * 4, 2, "modulo") == pytest.approx(20 / 11)
    assert dp_imbalance([10, 1, 10, 1], [True] * 4, 2, "balanced") == pytest.approx(1.0)
    assert dp_imbalance([10, 1, 10, 1], [True] * 4, 2, "ideal") == 1.0
    # issue 31 section 3: 48 groups of 16, DP 8, half kept, lognormal lengths: group % DP
    # carries a median ~1.6x the mean on the busiest rank, a greedy by tokens ~1.1x
    rng = random.Random(0)
    modulo, balanced = [], []
    for _ in range(200):
        groups = [sum(int(rng.lognormvariate(8.3, 0.6)) for _ in range(16)) for _ in range(48)]
        kept = [rng.random() < 0.5 for _ in groups]
        modulo.append(dp_imbalance(groups, kept, 8, "modulo"))
        balanced.append(dp_imbalance(groups, kept, 8, "balanced"))
    assert 1.35 < statistics.median(modulo) < 1.8
    assert statistics.median(balanced) < 1.12


def test_calibrated_model_slows_generation_and_update_by_the_fitted_factors():
    from megatron_rl.simulation.costs import CALIBRATED

    limit = tiny_costs()
    expected = limit.calibrated()
    assert expected.generation_efficiency == CALIBRATED["generation_efficiency"] < 1
    gen = CALIBRATED["generation_efficiency"]
    step = limit.decode_step(8, 1000) - limit.step_overhead
    assert expected.decode_step(8, 1000) - expected.step_overhead == pytest.approx(step / gen)
    assert expected.train_step([1000]) == pytest.approx(
        limit.train_step([1000]) * limit.train_mfu / CALIBRATED["train_mfu_dense"]
    )
    # two extra forwards (old and reference log-probs) on 3 passes: 5/3 of the FLOPs
    assert limit.with_(logprob_passes=2).train_flops([100]) == pytest.approx(
        limit.train_flops([100]) * 5 / 3
    )
    # today's host push at 1 GB/s vs the link
    assert limit.with_(push_bytes_per_s=1e9).push() == pytest.approx(2.0)


def test_median_for_mean_of_a_clipped_lognormal():
    import random
    import statistics

    from megatron_rl.simulation.calibration import median_for_mean

    m = median_for_mean(3199, 0.7, 3997)
    rng = random.Random(1)
    draws = [min(rng.lognormvariate(__import__("math").log(m), 0.7), 3997) for _ in range(40000)]
    assert statistics.fmean(draws) == pytest.approx(3199, rel=0.01)
    with pytest.raises(ValueError, match="mean length"):
        median_for_mean(5000, 0.7, 4000)


@pytest.mark.timeout(600)
def test_calibration_cases_reproduce_published_runs():
    """Every fit and check case within +-25% of its published number under the stored
    factors (the fit cases within 7%: the stored factors are the fit's)."""
    from megatron_rl.simulation.calibration import TOLERANCE, evaluate

    rows = evaluate()
    assert {r.role for r in rows} == {"fit", "check"} and len(rows) >= 7
    for r in rows:
        assert abs(r.ratio - 1) <= TOLERANCE, (r.case, r.published, r.predicted)
        if r.role == "fit" and "Qwen3" not in r.case:
            assert abs(r.ratio - 1) <= 0.07, (r.case, r.published, r.predicted)


@pytest.mark.timeout(900)
def test_simulate_run_calibrate_prints_cases_with_sources_and_a_plot(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    plot = tmp_path / "calibration.png"
    out = subprocess.run(
        [sys.executable, str(root / "tools/simulate_run.py"), "--calibrate", "--no-predictions",
         "--calibrate-plot", str(plot)],
        cwd=root, capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    ).stdout  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith(("| NeMo-RL", "| PipelineRL vs"))]
    assert len(rows) == 7 and all(line.rstrip().endswith("| yes |") for line in rows)
    assert "docs.nvidia.com/nemo/rl" in out and "arxiv.org/abs/2509.19128" in out
    assert "train_mfu_dense = " in out and plot.stat().st_size > 0


def test_what_if_switches_move_push_and_update_the_right_way():
    from megatron_rl.simulation.costs import HOST_PUSH_BYTES_PER_S, UNFUSED_KERNEL_SLOWDOWN
    from megatron_rl.simulation.predict import BEFORE, TODAY, Switches

    assert TODAY.apply(tiny_costs())[1] == "balanced"  # trainer/balance.py
    costs, assignment = BEFORE.apply(tiny_costs())
    assert assignment == "modulo" and costs.kernel_slowdown == UNFUSED_KERNEL_SLOWDOWN
    assert costs.push() == pytest.approx(2e9 / HOST_PUSH_BYTES_PER_S)
    done, assignment = Switches().apply(tiny_costs())
    assert assignment == "balanced" and done.push() == pytest.approx(tiny_costs().push())
    # the same batches (PPO-1: nothing overlaps) on 4 DP ranks, half the groups kept: the
    # update under group % DP is never shorter than balanced, and ideal is the shortest
    update = {}
    for how in ("ideal", "balanced", "modulo"):
        settings = tiny_settings(
            "ppo", 1, warmup=0, dp=4, dp_assignment=how, trained_fraction=0.5, prompts_per_step=8
        )
        r = simulate(tiny_costs(), TINY_LENGTHS, settings)
        update[how] = r.trainer_busy * r.seconds
    assert update["ideal"] < update["balanced"] < update["modulo"]
    with pytest.raises(ValueError, match="dp_assignment"):
        tiny_settings("ppo", 1, dp_assignment="round-robin")
