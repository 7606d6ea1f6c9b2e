"""Everything a run needs, built from its RunConfig (the loop itself lives in loop.py)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_rl.config.checks import check_start_weights
from megatron_rl.config.schema import RunConfig
from megatron_rl.trainer import console
from megatron_rl.trainer.hf_export import HFExporter

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from transformers import PreTrainedTokenizerBase

    from megatron_rl.algorithms.pass_rate import PassRateTracker
    from megatron_rl.data import MixedPromptSampler, PromptData, PromptSampler
    from megatron_rl.rewards import RewardPool
    from megatron_rl.trainer.compute import ComputeClock
    from megatron_rl.trainer.metrics import MetricsLogger
    from megatron_rl.trainer.rundir import Claim
    from megatron_rl.trainer.state import CheckpointManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Run:
    """The components of one training run on this rank, built once by :func:`build_run`
    (the loop's own state, such as the optimizer built after the warm start, lives in
    ``trainer.loop.Trainer``)."""

    config: RunConfig  # as loaded: never changed (what the run derives lives beside it)
    run_dir: Path
    hf_dir: Path  # the HF directory the run starts from: model.hf_path, or RUN_DIR/hf_init
    tokenizer: PreTrainedTokenizerBase
    model: GPTModel  # this rank's part (weights, checkpoints, pushes)
    ddp: DistributedDataParallel  # the model in megatron's DDP wrapper (training)
    data: PromptData
    sampler: PromptSampler | MixedPromptSampler
    tracker: PassRateTracker | None  # No-Positive-Resampling (algorithm.npr_threshold)
    rewards: RewardPool
    checkpoints: CheckpointManager
    metrics: MetricsLogger | NullMetrics  # NullMetrics off the main rank
    clock: ComputeClock
    encode: Callable[[int], list[int]]  # prompt id -> prompt token ids (cached)
    claim: Claim | None  # the main rank's hold on the run directory (its lock)
    exporter: HFExporter | None  # background HF exports (main rank, export_hf_every)


class NullMetrics:
    """The metrics sink of trainer ranks other than the main one (which writes the files)."""

    path = None

    def log(self, record) -> None:
        pass

    def position(self) -> int:
        return 0

    def truncate(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def prepare_hf_dir(config: RunConfig, run_dir: Path) -> Path:
    """The HF directory the run starts from (weights + tokenizer), for vLLM and conversion.

    ``model.hf_path`` is used as is. A preset gets a deterministic random initialisation
    (seed ``config.seed``) in ``RUN_DIR/hf_init``, with the character tokenizer when the
    data is the synthetic task.
    """
    if config.model.hf_path:
        return Path(config.model.hf_path)
    from megatron_rl.data.tokenizer import build_char_tokenizer
    from megatron_rl.models.presets import make_hf_model, preset_hf_config

    out = run_dir / "hf_init"
    if (out / "config.json").is_file():
        return out
    tok_dir = run_dir / "tokenizer"
    tokenizer = build_char_tokenizer(tok_dir)
    hf_config = preset_hf_config(
        config.model.preset,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if len(tokenizer) > hf_config.vocab_size:
        raise ValueError(
            f"model.preset {config.model.preset!r}: vocab_size {hf_config.vocab_size} is smaller "
            f"than the tokenizer's {len(tokenizer)}"
        )
    tmp = run_dir / "hf_init.tmp"
    make_hf_model(hf_config, str(tmp), seed=config.seed, tokenizer_dir=str(tok_dir))
    tmp.rename(out)
    return out


def build_tracker(config: RunConfig, run_dir: Path):
    """The W&B tracker of the main rank (``logging.wandb``), else None."""
    from megatron_rl.config.loader import to_dict
    from megatron_rl.trainer.tracking import WandbTracker

    wandb_cfg = config.logging.wandb
    if not wandb_cfg.enabled:
        return None
    return WandbTracker(wandb_cfg, run_dir, to_dict(config), config.name)


def prompt_encoder(
    data: PromptData, tokenizer: PreTrainedTokenizerBase, tools: dict
) -> Callable[[int], list[int]]:
    """The run's ``encode``: a prompt id of ``data`` (``PromptData``) -> the prompt's token ids
    (``data.encode_prompt`` with the chat template's ``tools`` arguments: one BOS, the
    template's own), cached. Every prompt the run sends or scores (training, validation,
    probes, the preflight's engine checks) goes through it."""
    from megatron_rl.data import encode_prompt

    cache: dict[int, list[int]] = {}

    def encode(prompt_id: int) -> list[int]:
        if prompt_id not in cache:
            prompt = data.get(prompt_id)
            config_of = data.config_of(prompt_id)
            cache[prompt_id] = encode_prompt(prompt.problem, config_of, tokenizer, tools)[1]
        return cache[prompt_id]

    return encode


def build_run(
    config: RunConfig, run_dir: Path, restart: bool = False, allow_changes: bool = False
) -> Run:
    """Model (HF weights loaded), optimizer, data, sampler, rewards, metrics, checkpoints.

    The main rank first claims ``run_dir`` (lock, history, config changes: see
    :mod:`megatron_rl.trainer.rundir`; ``restart`` / ``allow_changes`` are the CLI's
    ``--restart`` / ``--allow-changes``); ``config.yaml`` is written once all is built."""
    from megatron_rl.algorithms import PassRateTracker
    from megatron_rl.config.checks import prompt_token_limit
    from megatron_rl.conversion.hf import load_hf_weights
    from megatron_rl.data import build_sampler, load_prompt_data
    from megatron_rl.models.hf_config import load_tokenizer
    from megatron_rl.models.provider import DTYPES, build_model
    from megatron_rl.platform import get_platform, init_distributed
    from megatron_rl.rewards import RewardPool
    from megatron_rl.trainer.compute import ComputeClock, run_devices
    from megatron_rl.trainer.metrics import MetricsLogger
    from megatron_rl.trainer.optim import wrap_model
    from megatron_rl.trainer.state import CheckpointManager

    # Every rank refuses a production preset without weights before any work: refused on rank
    # 0 alone (in prepare_hf_dir), the others would wait on the barrier below until timeout.
    check_start_weights(config)
    init_distributed(config.parallel, seed=config.seed)
    import torch.distributed as dist

    from megatron_rl.platform import collectives
    from megatron_rl.trainer.rundir import (
        AlreadyFinished,
        RunDirError,
        claim_run_dir,
        save_config,
    )
    from megatron_rl.trainer.tracking import TrackingError, check_login

    claim, refused = None, None
    if dist.get_rank() == 0:
        try:
            check_login(config.logging.wandb)  # W&B online: logged in and the server answers
            claim = claim_run_dir(config, run_dir, restart, allow_changes)
        except (RunDirError, TrackingError, AlreadyFinished) as err:
            refused = err
    refused = collectives.broadcast_object(refused)
    if refused is not None:  # on every rank: the others would wait for rank 0 otherwise
        raise refused
    # The directory is ours (--restart moved the old logs aside): the output into RUN_DIR/logs/.
    console.attach(run_dir)
    if dist.get_rank() == 0:  # one rank writes the initial HF directory, the others wait
        prepare_hf_dir(config, run_dir)
    collectives.barrier()
    hf_dir = prepare_hf_dir(config, run_dir)  # now only finds it
    tokenizer = load_tokenizer(hf_dir)
    # the model as the HF directory holds it (a preset's random init: RUN_DIR/hf_init)
    model_cfg = dataclasses.replace(config.model, hf_path=str(hf_dir))
    model = build_model(model_cfg, config.parallel)
    load_hf_weights(model, hf_dir, DTYPES[model_cfg.dtype])
    if config.algorithm.routing_replay:
        from megatron_rl.trainer import routing_replay

        routing_replay.enable(model)
    ddp = wrap_model(model, config.optimizer.distributed, config.optimizer.overlap_grad_reduce)

    tools = template_kwargs(config, tokenizer)
    data = load_prompt_data(
        config.data, tokenizer, max_tokens=prompt_token_limit(config), template_kwargs=tools
    )
    if any(source.domain == "code" for source in data.sources):
        from megatron_rl.rewards.isolation import box_for

        box_for(config.reward)  # no code sandbox: fail now, not at the first code batch
    encode = prompt_encoder(data, tokenizer, tools)

    algo = config.algorithm
    tracker = None
    if algo.npr_threshold is not None:
        tracker = PassRateTracker(algo.npr_threshold, history=algo.npr_history)
    sampler = build_sampler(data, config.data, tracker)
    # GPU-hours: trainer devices plus generator devices; on a CPU run the CPU time of the
    # run's work processes (trainer.compute: wall time on a shared CPU counts the load).
    # Engines of other tasks (``placement: remote``, a Slurm CPU job) cannot be read from
    # here: such a run keeps wall time x processes.
    rollout = config.rollout
    if get_platform().is_gpu or rollout.placement == "remote":
        gpu = get_platform().is_gpu
        clock = ComputeClock(
            run_devices(dist.get_world_size(), rollout.engines, rollout.tensor_parallel, gpu)
        )
    else:
        clock = _cpu_clock(dist)
    run = Run(
        config=config,
        run_dir=run_dir,
        hf_dir=hf_dir,
        tokenizer=tokenizer,
        model=model,
        ddp=ddp,
        data=data,
        sampler=sampler,
        tracker=tracker,
        rewards=RewardPool(config.reward),
        checkpoints=CheckpointManager(
            run_dir,
            config.checkpoint.keep_last,
            hf_source_dir=hf_dir,
            async_save=config.checkpoint.async_save,
            config_text=claim.config_text if claim is not None else None,
        ),
        metrics=(
            MetricsLogger(
                run_dir,
                tensorboard=config.logging.tensorboard,
                tracker=build_tracker(config, run_dir),
            )
            if dist.get_rank() == 0
            else NullMetrics()
        ),
        clock=clock,
        encode=encode,
        claim=claim,
        exporter=(
            HFExporter(run_dir, config.checkpoint.export_hf_every, config.checkpoint.keep_last)
            if dist.get_rank() == 0 and config.checkpoint.export_hf_every
            else None
        ),
    )
    if claim is not None:
        save_config(claim, run_dir)
    return run


def template_kwargs(config, tokenizer) -> dict:
    """What the chat template is given besides the turns: with multi-turn episodes
    (``rollout.max_turns`` > 1), the environment's tool offered the model family's way
    (``environments.registry.template_kwargs``); else nothing."""
    if not config.rollout.episodes:
        return {}
    from megatron_rl.environments.registry import template_kwargs as environment_kwargs

    return environment_kwargs(config.rollout.environment, tokenizer)


def _cpu_clock(dist: Any) -> ComputeClock:
    """A CPU run's clock: the CPU time of every trainer rank's process tree. Every rank calls
    this (a collective): the ranks on this host are counted from their pids; those on other
    hosts, which cannot be read from here, as this host's share (devices = hosts)."""
    import socket

    from megatron_rl.platform import collectives
    from megatron_rl.trainer.compute import ComputeClock, WorkCPUClock

    here = (socket.gethostname(), os.getpid())
    ranks: list[Any] = collectives.all_gather_object(here)
    hosts = {host for host, _ in ranks}
    others = [pid for host, pid in ranks if host == here[0] and pid != here[1]]
    return ComputeClock(len(hosts), clock=WorkCPUClock(others=others))
