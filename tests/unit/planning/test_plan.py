"""`megatron-rl plan`: the memory planner against what megatron-core really allocates and saves.

Exactness is checked on CPU with the trainer's own builders (``build_model``, ``wrap_model``,
``build_optimizer``): parameter, gradient-buffer and optimizer-state bytes after one step
equal the prediction to the byte. The distributed optimizer (GPU only) is checked against
megatron's own buffer layout and shard ranges (a DDP built with ``use_distributed_optimizer``
on CPU, and ``DistributedOptimizer._build_model_gbuf_range``). Activations: the unique
storages a forward saves for backward (``torch.autograd.graph.saved_tensors_hooks``) on the
tiny CPU recipe's micro-batch shape.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from megatron_rl.config import load_run_config
from megatron_rl.models import PRESETS, ModelConfig
from megatron_rl.planning.activations import ActivationSettings, activation_bytes
from megatron_rl.planning.engine import engine_bytes
from megatron_rl.planning.plan import Layout, micro_batch_shape, plan_run
from megatron_rl.planning.shapes import (
    ParamSpec,
    model_shapes,
    rank_parameters,
    shapes_from_fields,
)
from megatron_rl.planning.states import buffer_layout, state_bytes

ROOT = Path(__file__).resolve().parents[3]
TINY = ("tiny-llama", "tiny-llama4")


def tiny_micro_batch() -> tuple[int, int]:
    """(tokens, sequence length) of the tiny CPU recipe's micro-batches (as the planner reads
    it: ``batch.micro_batch_tokens`` filled with sequences of the longest length)."""
    return micro_batch_shape(load_run_config(ROOT / "recipes/tiny_cpu.yaml"))


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors``."""
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure_saved(ddp, model, tokens: torch.Tensor, backward: bool = False) -> int:
    """Bytes of the distinct storages the forward (model + FP32-head log-probs) saves for
    backward, parameters excluded."""
    from megatron_rl.models.logprobs import forward_logits, logits_to_logprobs

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs = logits_to_logprobs(forward_logits(ddp, tokens), tokens)
    if backward:
        logprobs.sum().backward()
    return sum(saved.values())


def optimizer_state_bytes(optimizer) -> int:
    tensors = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
    return storage_bytes(tensors)


def trainer_pieces(preset: str, parallel, recompute: bool = False):
    """Model, DDP and optimizer exactly as ``build_run`` / ``policy_update`` make them."""
    from megatron_rl.config.sections import OptimizerConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.trainer.optim import build_optimizer, wrap_model

    torch.manual_seed(0)
    model_cfg = ModelConfig(preset=preset, dtype="float32", recompute_activations=recompute)
    model = build_model(model_cfg, parallel)
    ddp = wrap_model(model)
    optim = build_optimizer(ddp, OptimizerConfig(lr=1e-3, warmup_steps=0)).optimizer
    return model_cfg, model, ddp, optim


def one_step(ddp, optim, tokens: torch.Tensor) -> None:
    from megatron_rl.models.logprobs import forward_logits, logits_to_logprobs

    ddp.zero_grad_buffer()
    optim.zero_grad()
    logits_to_logprobs(forward_logits(ddp, tokens), tokens).sum().backward()
    ddp.finish_grad_sync()
    optim.step()


def measured_states(model, ddp, optim) -> dict[str, int]:
    buffers = ddp.buffers + ddp.expert_parallel_buffers
    return {
        "params": storage_bytes(model.parameters()),
        "grads": sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
        "optimizer": optimizer_state_bytes(optim),
    }


def predicted_states(model_cfg, tensor=1, expert=1, dp=1, expert_dp=1) -> dict[str, int]:
    specs = rank_parameters(model_shapes(model_cfg), tensor=tensor, expert=expert)
    st = state_bytes(
        specs, 4, dp, expert_dp, distributed=False, overlap_grad_reduce=False, step_tensors=True
    )
    return {"params": st.params, "grads": st.grads, "optimizer": st.optimizer}


# -- shapes ------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_shapes_agree_with_the_model_builder(name):
    """The planner reads presets as plain dicts; megatron_rl.models reads them through
    transformers. Both must give the same per-layer layout and widths."""
    from megatron_rl.models.arch import architecture_from_hf
    from megatron_rl.models.presets import preset_hf_config

    hf = preset_hf_config(name)
    arch = architecture_from_hf(hf)
    shapes = shapes_from_fields(PRESETS[name], name)
    layout = arch.layout
    assert shapes.moe == layout.moe and shapes.rope == layout.rope
    assert shapes.qk_norm == layout.qk_l2_norm and shapes.chunk == layout.chunk_size
    assert shapes.temperature == tuple(t is not None for t in layout.temperature)
    assert shapes.head_dim == hf.head_dim and shapes.kv_heads == hf.num_key_value_heads


@pytest.mark.timeout(60)
def test_parameter_counts_match_published_models():
    """Llama-3.1-8B has 8,030,261,248 parameters (its HF model card / safetensors index);
    Llama-4 Scout is '17B active' with one of 16 routed experts plus the shared one."""
    llama = shapes_from_fields(PRESETS["llama3-8b"])
    assert llama.total_parameters() == 8_030_261_248
    scout = shapes_from_fields(PRESETS["llama4-scout"])
    routed = scout.layers * scout.experts * 3 * scout.hidden * scout.expert_ffn
    active = scout.total_parameters() - routed * (scout.experts - 1) // scout.experts
    assert 16.5e9 < active < 17.5e9


@pytest.mark.timeout(60)
def test_buffer_layout_pads_like_megatron_by_hand():
    """Two parameters (100 and 30 elements) placed in reverse order; the distributed
    optimizer aligns starts to 64 elements and pads the bucket to lcm(DP 3, 128) = 384."""
    params = [ParamSpec("a", 100), ParamSpec("b", 30)]
    plain = buffer_layout(params, 2, 4, dp=3, distributed=False, bucket_size=None)
    assert plain.ranges == {"b": (0, 30), "a": (30, 130)} and plain.numel == 130
    dist = buffer_layout(params, 2, 4, dp=3, distributed=True, bucket_size=None)
    assert dist.ranges == {"b": (0, 30), "a": (64, 164)} and dist.numel == 384
    # shards of 128: rank 0 owns b and 64 of a's elements, rank 1 the other 36, rank 2 padding
    assert [dist.shard_numel(r) for r in range(3)] == [{"b": 30, "a": 64}, {"a": 36}, {}]
    assert dist.owned_per_rank() == [(94, 2), (36, 1), (0, 0)]
    split = buffer_layout(params, 2, 4, dp=1, distributed=True, bucket_size=20)
    assert split.buckets == ((0, 128), (128, 256))  # a bucket closes once it holds >= 20


# -- single rank: exact states, activations within tolerance ----------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("preset", TINY)
def test_states_equal_what_megatron_allocates(megatron_single_rank, preset):
    from megatron_rl.platform import ParallelConfig

    model_cfg, model, ddp, optim = trainer_pieces(preset, ParallelConfig())
    specs = rank_parameters(model_shapes(model_cfg))
    assert [(n, p.numel()) for n, p in model.named_parameters()] == [
        (s.name, s.numel) for s in specs
    ]
    tokens = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    one_step(ddp, optim, tokens)
    measured = measured_states(model, ddp, optim)
    assert measured["optimizer"] > 0  # the step created Adam's state
    assert measured == predicted_states(model_cfg)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("preset", TINY)
def test_activations_match_saved_tensors(megatron_single_rank, preset, recompute):
    from megatron_rl.platform import ParallelConfig

    model_cfg, model, ddp, _ = trainer_pieces(preset, ParallelConfig(), recompute=recompute)
    tokens_n, seq = tiny_micro_batch()
    tokens = torch.randint(
        3, 128, (tokens_n // seq, seq), generator=torch.Generator().manual_seed(1)
    )
    measured = measure_saved(ddp, model, tokens, backward=recompute)  # recompute really trains
    settings = ActivationSettings(
        tokens=tokens_n, seq_len=seq, dtype_bytes=4, kernels="cpu", recompute=recompute
    )
    predicted = activation_bytes(model_shapes(model_cfg), settings).saved_total
    print(
        f"{preset} recompute={recompute}: measured {measured} predicted {predicted} "
        f"ratio {predicted / measured:.4f}"
    )
    assert abs(predicted / measured - 1) < 0.05
    # and the other recompute setting's prediction is far off: the check discriminates
    other = activation_bytes(
        model_shapes(model_cfg),
        ActivationSettings(
            tokens=tokens_n, seq_len=seq, dtype_bytes=4, kernels="cpu", recompute=not recompute
        ),
    ).saved_total
    assert abs(other / measured - 1) > 0.5


# -- two ranks: TP 2 with sequence parallelism, EP 2, the distributed optimizer's layout -------


def _two_rank_worker(tokens_n: int, seq: int) -> dict:
    """One gloo rank: measured vs predicted numbers of three layouts (see the test)."""
    import torch.distributed as dist

    from megatron_rl.platform import ParallelConfig, init_distributed

    out = {}
    for name, preset, parallel in (
        ("tp2", "tiny-llama", ParallelConfig(tensor=2, sequence_parallel=True)),
        ("ep2", "tiny-llama4", ParallelConfig(expert=2)),
    ):
        init_distributed(parallel)
        model_cfg, model, ddp, optim = trainer_pieces(preset, parallel)
        tokens = torch.randint(
            3, 128, (tokens_n // seq, seq), generator=torch.Generator().manual_seed(1)
        )
        saved = measure_saved(ddp, model, tokens)
        one_step(ddp, optim, tokens[:2, :16])
        dp = dist.get_world_size() // parallel.tensor
        expert_dp = dist.get_world_size() // parallel.expert
        settings = ActivationSettings(
            tokens=tokens_n,
            seq_len=seq,
            dtype_bytes=4,
            kernels="cpu",
            tensor=parallel.tensor,
            sequence_parallel=parallel.sequence_parallel,
            expert=parallel.expert,
        )
        out[name] = {
            "measured": measured_states(model, ddp, optim),
            "predicted": predicted_states(
                model_cfg, parallel.tensor, parallel.expert, dp, expert_dp
            ),
            "saved": saved,
            "saved_predicted": activation_bytes(model_shapes(model_cfg), settings).saved_total,
        }
    out["distributed_optimizer"] = _distributed_optimizer_layout()
    return out


def _distributed_optimizer_layout() -> dict:
    """tiny-llama4 in bf16 (FP32 head: bf16 weight) under EP 2 (dense DP 2, expert DP 1), in megatron's DDP
    with the distributed optimizer's layout and small buckets: buffer sizes and this rank's
    optimizer shard per parameter, from megatron and from the planner."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_rl.models.provider import build_model
    from megatron_rl.planning.states import FP32
    from megatron_rl.platform import ParallelConfig, init_distributed

    parallel = ParallelConfig(expert=2)
    init_distributed(parallel)
    model_cfg = ModelConfig(preset="tiny-llama4", dtype="bfloat16")
    model = build_model(model_cfg, parallel)
    names = {p: n for n, p in model.named_parameters()}
    bucket = 100_000
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=True,
        use_distributed_optimizer=True,
        bucket_size=bucket,
    )
    model.config.calculate_per_token_loss = True
    ddp = DistributedDataParallel(model.config, ddp_cfg, model)
    real = {"buffers": [], "shard": {}}
    for buf in ddp.buffers + ddp.expert_parallel_buffers:
        real["buffers"].append(
            (
                buf.param_data.numel() * buf.param_data.element_size(),
                buf.grad_data.numel() * buf.grad_data.element_size(),
            )
        )
        for r in DistributedOptimizer._build_gbuf_range_map(buf)[(buf.param_dtype, buf.grad_dtype)]:
            for p, ranges in r["param_map"].items():
                real["shard"][names[p]] = real["shard"].get(names[p], 0) + ranges["param"].size
    specs = rank_parameters(model_shapes(model_cfg), expert=2)
    planned = {"buffers": [], "shard": {}}
    for expert in (False, True):  # dense over DP 2, routed experts over expert-DP 1
        group = [s for s in specs if s.expert == expert]
        lay = buffer_layout(group, 2, FP32, 1 if expert else 2, True, bucket)
        planned["buffers"].append((lay.numel * 2, lay.numel * FP32))
        planned["shard"].update(lay.shard_numel(0 if expert else ddp.dp_group.rank()))
    return {"real": real, "planned": planned}


@pytest.mark.timeout(600)
def test_two_rank_layouts_tp2_ep2_and_distributed_optimizer():
    from megatron_rl.platform import run_local_ranks

    tokens_n, seq = tiny_micro_batch()
    results = run_local_ranks(_two_rank_worker, 2, tokens_n, seq)
    for rank, res in enumerate(results):
        for name in ("tp2", "ep2"):
            r = res[name]
            assert r["measured"] == r["predicted"], (rank, name)
            ratio = r["saved_predicted"] / r["saved"]
            print(
                f"rank {rank} {name}: activations measured {r['saved']} predicted "
                f"{r['saved_predicted']} ratio {ratio:.4f}"
            )
            assert abs(ratio - 1) < 0.05, (rank, name)
        do = res["distributed_optimizer"]
        assert len(do["real"]["buffers"]) == 2  # bf16 dense (head included), bf16 experts
        assert sorted(do["real"]["buffers"]) == sorted(do["planned"]["buffers"])
        assert do["real"]["shard"] == do["planned"]["shard"]
    # the two DP ranks own different halves of the dense parameters
    shards = [res["distributed_optimizer"]["real"]["shard"] for res in results]
    assert shards[0] != shards[1]


# -- plans of the production recipes -------------------------------------------------------------


@pytest.mark.timeout(300)
def test_engine_kv_cache_by_hand():
    """Llama-3.1-8B on one GPU: 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB
    per token, 2 GiB per 16384-token sequence: rollout.kv_cache_gb 100 holds 50 of them."""
    config = load_run_config(ROOT / "recipes/scalerl_8b.yaml")
    e = engine_bytes(model_shapes(config.model), config.rollout, "bfloat16")
    assert e.kv_bytes_per_sequence == 2 * 2**30
    assert e.sequences_in_kv == 50
    assert e.weights == 8_030_261_248 * 2


def test_engine_expert_parallel_weights_by_hand():
    """Engine TP 4: split in width, a GPU holds a quarter of every expert; placed whole
    (rollout.expert_parallel), the fullest GPU holds ceil(E / 4) experts. Scout's 16 experts
    cost the same either way; 6 experts: 2 whole vs 6 quarters, per MoE layer."""
    import dataclasses

    config = load_run_config(ROOT / "recipes/scalerl_scout.yaml")
    width = dataclasses.replace(config.rollout, expert_parallel=False)
    whole = dataclasses.replace(config.rollout, expert_parallel=True)
    shapes = model_shapes(config.model)
    assert engine_bytes(shapes, whole, "bfloat16").weights == (
        engine_bytes(shapes, width, "bfloat16").weights
    )
    six = dataclasses.replace(shapes, experts=6)
    h, f, moe_layers = shapes.hidden, shapes.expert_ffn, sum(map(bool, shapes.moe))
    extra = moe_layers * 3 * h * (2 * f - 6 * (f // 4)) * 2  # bf16
    diff = (
        engine_bytes(six, whole, "bfloat16").weights - engine_bytes(six, width, "bfloat16").weights
    )
    assert diff == extra > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", ["scalerl_8b", "scalerl_8b_tool", "scalerl_scout"])
def test_production_recipes_fit_with_headroom(recipe):
    plan = plan_run(load_run_config(ROOT / f"recipes/{recipe}.yaml"), search=False)
    assert plan.trainer.headroom >= 0.20, plan.trainer.total
    assert plan.engine.headroom >= 0.20, plan.engine.bytes.parts  # Scout's was 6% (issue 27)


def test_gpu_capacities_are_what_the_driver_reports_in_gib():
    """nvidia-smi's memory.total on each GPU (public logs), not the datasheets' numbers read
    as decimal GB: an H200's "141 GB" is 143771 MiB = 140.4 GiB, 7% more than 141e9 bytes."""
    from megatron_rl.planning.gpus import GPUS
    from megatron_rl.planning.report import gb, markdown

    assert GPUS["gb200"].memory_bytes == 189471 * 2**20
    assert GPUS["h200"].memory_bytes == 143771 * 2**20
    assert GPUS["h100"].memory_bytes == 81559 * 2**20
    assert gb(GPUS["h200"].memory_bytes) == "140.4" and gb(GPUS["gb200"].memory_bytes) == "185.0"
    plan = plan_run(load_run_config(ROOT / "recipes/scalerl_scout.yaml"), search=False)
    md = markdown(plan)
    assert "| part | GiB | how |" in md and "of 185.0 GiB" in md
    assert not re.search(r"\d GB\b", md)  # no decimal gigabytes left


def test_engine_counts_cuda_graphs_nvls_and_fragmentation():
    """vLLM 0.32 captures [1, 2, 4] + 8..248 step 8 + 256..512 step 16 = 3 + 31 + 17 = 51
    batch sizes for max_num_seqs 256 (min(2 x 256, 512)), in FULL and PIECEWISE mode."""
    import dataclasses

    config = load_run_config(ROOT / "recipes/scalerl_scout.yaml")
    shapes = model_shapes(config.model)
    e = engine_bytes(shapes, config.rollout, "bfloat16")
    assert e.graph_captures == 2 * 51 and e.cuda_graphs > 0 and e.nvls == 0
    assert e.fragmentation > 0
    eager_rollout = dataclasses.replace(config.rollout, enforce_eager=True)
    eager = engine_bytes(shapes, eager_rollout, "bfloat16")
    assert (eager.cuda_graphs, eager.graph_captures) == (0, 0)
    nvls = engine_bytes(shapes, config.rollout, "bfloat16", nvls=True)
    assert nvls.nvls == 2**30  # one NVLS communicator: the engine's TP group
    # the plan passes the recipe's engine NVLS setting through
    with_nvls = ["cluster.engine_nccl_nvls=true"]
    on = plan_run(load_run_config(ROOT / "recipes/scalerl_scout.yaml", with_nvls), search=False)
    off = plan_run(config, search=False)
    assert on.engine.total - off.engine.total == 2**30


def test_trainer_counts_nvls_per_nccl_group_unless_the_recipe_turns_it_off():
    """Scout: TP 4, DP 8, EP 16, expert-DP 2: four NCCL groups of more than one rank."""
    recipe = ROOT / "recipes/scalerl_scout.yaml"
    default = plan_run(load_run_config(recipe), search=False)
    off = plan_run(load_run_config(recipe, ["cluster.nccl_nvls=false"]), search=False)
    assert default.trainer.nvls == 4 * 2**30 and off.trainer.nvls == 0
    assert default.trainer.total - off.trainer.total == 4 * 2**30
    assert default.trainer.fragmentation == int(0.10 * default.trainer.activations.peak)


def test_nccl_m2n_plans_the_buffers_of_a_communicator_per_engine():
    """``nccl_m2n`` on the 8B recipe: 64 engines of TP 1, trainer TP 2 (two source ranks).
    A source rank joins 64 communicators, one peer each; an engine worker one communicator
    with two peers. NCCL_BUFFSIZE 4 MiB per channel per peer, 2 channels per peer (the
    assumption in gpus.py): 64 x 1 x 2 x 4 MiB = 512 MiB and 2 x 2 x 4 MiB = 16 MiB."""
    from megatron_rl.planning.report import engine_rows, trainer_rows

    recipe = ROOT / "recipes/scalerl_8b.yaml"
    base = plan_run(load_run_config(recipe), search=False)
    m2n = plan_run(load_run_config(recipe, ["rollout.weight_transport=nccl_m2n"]), search=False)
    assert (base.trainer.transfer, base.engine.transfer) == (0, 0)
    assert m2n.trainer.transfer == 512 * 2**20
    assert m2n.engine.transfer == 16 * 2**20
    assert m2n.trainer.total - base.trainer.total == 512 * 2**20
    assert m2n.engine.total - base.engine.total == 16 * 2**20
    label = "weight-transfer NCCL buffers (estimate)"
    assert [r.bytes for r in trainer_rows(m2n) if r.label == label] == [512 * 2**20]
    assert [r.bytes for r in engine_rows(m2n) if r.label == label] == [16 * 2**20]
    assert label not in [r.label for r in trainer_rows(base) + engine_rows(base)]


@pytest.mark.timeout(300)
def test_old_scout_layout_does_not_fit_and_the_suggestion_passes_the_checks():
    """The Scout layout before the re-plan (TP 4, EP 8, no recompute) does not fit a GB200;
    the planner's smallest fitting change loads as a recipe (every config check passes) and
    fits when planned again."""
    old = ["parallel.expert=8", "model.recompute_activations=false"]
    recipe = ROOT / "recipes/scalerl_scout.yaml"
    plan = plan_run(load_run_config(recipe, old))
    assert plan.trainer.headroom < 0 and plan.suggestion is not None
    changes = plan.suggestion.layout.changes_from(Layout.of(load_run_config(recipe, old)))
    overrides = old + [f"{k}={json.dumps(v)}" for k, v in changes.items()]
    again = plan_run(load_run_config(recipe, overrides), search=False)
    assert again.trainer.total == plan.suggestion.total and again.trainer_fits


@pytest.mark.timeout(300)
def test_cli_plan(capsys):
    from megatron_rl.cli import main

    recipe = str(ROOT / "recipes/scalerl_scout.yaml")
    assert main(["plan", recipe, "rollout.kv_cache_gb=60", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| **total** |" in out and "fits" in out
    assert main(["plan", recipe, "parallel.expert=8", "model.recompute_activations=false"]) == 1
    assert "Smallest change that fits" in capsys.readouterr().out
    assert main(["plan", recipe, "parallel.expert=3"]) == 2  # a config check fails


@pytest.mark.timeout(180)
def test_planner_imports_no_torch():
    """`megatron-rl plan` runs on a login node: the planner imports neither torch nor megatron."""
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from megatron_rl.cli import main\n"
        "rc = main(['plan', 'recipes/scalerl_scout.yaml', '--markdown'])\n"
        "assert rc in (0, 1), rc\n"
        "heavy = [m for m in ('torch', 'megatron.core', 'vllm') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| **total** |" in proc.stdout


def test_packed_micro_batch_fills_the_token_budget_in_the_plan():
    """Packed micro-batches (batch.pack, null on a GPU) are filled first-fit to
    micro_batch_tokens with shorter sequences: the planner's activations must count the whole
    budget (4096 here), not only the longest sequences that fit it whole (51 x 80 = 4080)."""
    keys = ["batch.micro_batch_tokens=4096", "rollout.max_tokens=64"]  # longest 16 + 64 = 80
    padded = load_run_config(ROOT / "recipes/tiny_cpu.yaml", [*keys, "batch.pack=false"])
    assert micro_batch_shape(padded) == (51 * 80, 80)
    packed = load_run_config(ROOT / "recipes/tiny_cpu.yaml", [*keys, "batch.pack=true"])
    assert micro_batch_shape(packed) == (4096, 80)
    default = load_run_config(ROOT / "recipes/tiny_cpu.yaml", keys)  # pack null
    assert micro_batch_shape(default) == (4096, 80)  # the GPU plan: packed
    assert micro_batch_shape(default, gpu=False) == (51 * 80, 80)


def test_episode_plan_of_the_tool_recipe_by_hand():
    """Issue 38: multi-turn episodes in the plan. rollout.max_tokens (14,336) is the budget
    of model and tool tokens together, so the longest sequence (trainer micro-batch, an
    engine request's KV) is the single-turn one; what changes is counted per episode:
    3 calls x 512 tool tokens prefilled and never decoded, and later turns prefilled again,
    one KV block (16) each with a prefix-cache hit, the whole context without."""
    from megatron_rl.planning.episodes import kv_block_size
    from megatron_rl.planning.report import markdown

    tool = plan_run(load_run_config(ROOT / "recipes/scalerl_8b_tool.yaml"), search=False)
    single = plan_run(load_run_config(ROOT / "recipes/scalerl_8b.yaml"), search=False)
    e = tool.episode
    assert single.episode is None and e is not None
    assert (e.max_turns, e.calls, e.tool_format, e.environment) == (4, 3, "llama3", "python_tool")
    assert (e.prompt, e.budget, e.longest_sequence) == (2048, 14336, 2048 + 14336)
    assert tool.seq_len == single.seq_len == 16384 and tool.tokens == single.tokens
    # KV of one 16,384-token request: 32 layers x K and V x 8 heads x 128 x 2 bytes x 16,384
    per_seq = 32 * 2 * 8 * 128 * 2 * 16384
    assert tool.engine.bytes.kv_bytes_per_sequence == per_seq
    assert single.engine.bytes.kv_bytes_per_sequence == per_seq
    assert (e.tool_tokens, e.model_tokens) == (1536, 14336 - 1536)
    assert e.block == 16 and e.prefix_caching
    assert e.prefill_cached == 2048 + 1536 + 3 * 16
    assert e.prefill_uncached == 2048 + 3 * 16384
    assert (e.tool_workers, tool.engines_per_node) == (16, 4)
    assert e.tool_memory_bytes == 16 * 2048 * 2**20  # 32 GiB of host memory per engine
    text = markdown(tool)
    assert "| tool tokens (prefilled, never decoded) | <= 1536 |" in text
    assert "| prefill, no hits | <= 51200 |" in text
    assert "| tool calls at once | 16 / 64 |" in text
    assert "| tool sandboxes' host memory (GiB) | 32.0 / 128.0 |" in text
    assert "Episodes" not in markdown(single)
    # Prefix caching off (engines returning routed experts): every later turn is a miss;
    # tool output larger than the budget: every turn still decodes its stop token.
    off = load_run_config(
        ROOT / "recipes/scalerl_8b_tool.yaml",
        ["rollout.prefix_caching=false", "rollout.environment.max_tool_output_tokens=8000"],
    )
    e = plan_run(off, search=False).episode
    assert e.tool_tokens == 14336 - 4 and e.model_tokens == 4
    assert e.prefill_cached == e.prefill_uncached == 2048 + 3 * 16384
    # Chunked local attention (Llama-4, chunk 8192): the engine's blocks are 128 tokens.
    assert kv_block_size((8192, 8192, None)) == 128 and kv_block_size((None,)) == 16


def test_engines_that_do_not_fit_get_the_change_that_makes_them():
    """`plan --gpu h100` said the 8B engines do not fit by 59% and suggested nothing for them
    (rollout.kv_cache_gb=40 fits). The suggestion is checked by planning the recipe again with
    the suggested overrides as a user would pass them."""
    from megatron_rl.planning.report import notes

    recipe = ROOT / "recipes" / "scalerl_8b.yaml"
    plan = plan_run(load_run_config(recipe), gpu="h100")
    assert not plan.engine_fits and plan.engine_fix is not None
    changes, fixed = plan.engine_fix
    assert changes == ("rollout.kv_cache_gb=37",)
    again = plan_run(load_run_config(recipe, list(changes)), gpu="h100")
    assert again.engine_fits and again.engine.total == fixed.total
    assert again.engine.bytes.sequences_in_kv >= 1
    assert any("The engines fit with `rollout.kv_cache_gb=37`" in n for n in notes(plan))
    # Scout on an H100: no KV cache alone fits; twice the engines' TP (half the engines)
    scout = ROOT / "recipes" / "scalerl_scout.yaml"
    plan = plan_run(load_run_config(scout), gpu="h100")
    changes, _ = plan.engine_fix
    assert changes[:2] == ("rollout.tensor_parallel=8", "rollout.engines=12")
    assert plan_run(load_run_config(scout, list(changes)), gpu="h100").engine_fits
    # engines that fit get no advice
    assert plan_run(load_run_config(recipe), gpu="gb200").engine_fix is None
