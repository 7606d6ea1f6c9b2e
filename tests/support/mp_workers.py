"""Functions run in spawned gloo ranks by the tests (importable by child processes)."""

from __future__ import annotations

import torch


def logits_worker(
    hf_dir: str, tensor: int, expert: int, tokens: torch.Tensor, out_path: str
) -> None:
    """Build the model with the given TP/EP, load HF weights, save full-vocab fp32 logits."""
    import torch.distributed as dist

    from megatron_rl.conversion.hf import load_hf_weights
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.logprobs import forward_logits, gather_vocab
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig, destroy_distributed, init_distributed

    parallel = ParallelConfig(tensor=tensor, expert=expert)
    init_distributed(parallel)
    model = build_model(ModelConfig(hf_path=hf_dir, dtype="float32"), parallel)
    load_hf_weights(model, hf_dir, torch.float32)
    model.eval()
    with torch.no_grad():
        logits = gather_vocab(forward_logits(model, tokens))
    if dist.get_rank() == 0:
        torch.save(logits, out_path)
    destroy_distributed()


def dp_update_worker(
    samples, out_path: str, world: int, overlap: bool = False, pack: bool = False
) -> None:
    """Build the tiny model (seeded), one SGD policy update over ``samples``; save the params.
    With ``world`` 2 the ranks form a DP=2 group and split the batch by groups; ``overlap``:
    gradients reduced bucket by bucket during the backward (megatron's overlap_grad_reduce);
    ``pack``: packed micro-batches of a 14-token budget (4 and 5 of them on the two ranks) (batch.pack), else 3 sequences each."""
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_rl.algorithms.config import AlgorithmConfig
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.trainer.optim import wrap_model
    from megatron_rl.trainer.step import policy_update

    init_distributed(ParallelConfig(), seed=5)
    model = build_model(ModelConfig(preset="tiny-llama", dtype="float32"), ParallelConfig())
    ddp = wrap_model(model, overlap_grad_reduce=overlap)
    cfg = OptimizerConfig(
        optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0
    )
    opt = get_megatron_optimizer(cfg, [ddp], use_gloo_process_groups=False)
    if pack:
        result = policy_update(
            ddp, opt, samples, AlgorithmConfig(), micro_batch_tokens=14, pack=True
        )
    else:
        result = policy_update(ddp, opt, samples, AlgorithmConfig(), 3)
    if dist.get_rank() == 0:
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out_path)
        with open(out_path + ".imbalance", "w") as f:
            f.write(repr(result.dp_token_imbalance))
    destroy_distributed()


def layout_update_worker(
    preset: str, layout: dict, samples, out_path: str, replay: bool = False, pack: bool = False
) -> None:
    """One SGD (lr 1) policy update of ``preset`` (seeded) in a parallel ``layout``; rank 0
    saves the full HF-named weights after it, and the step's statistics. ``replay``: the
    routers replay the samples' ``routed_experts`` (algorithm.routing_replay); ``pack``:
    packed micro-batches (batch.pack)."""
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_rl.algorithms.config import AlgorithmConfig
    from megatron_rl.conversion.hf import load_hf_weights
    from megatron_rl.conversion.weight_stream import iter_hf_weights
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.trainer.optim import wrap_model
    from megatron_rl.trainer.step import policy_update

    parallel = ParallelConfig(**layout)
    init_distributed(parallel, seed=5)
    hf_dir = out_path + ".hf"
    model = build_model(ModelConfig(hf_path=hf_dir, dtype="float32"), parallel)
    load_hf_weights(model, hf_dir, torch.float32)
    replayed = []  # routers that ran with the samples' routing (rank 0)
    if replay:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        from megatron_rl.trainer import routing_replay

        routing_replay.enable(model)
        for layer, router in routing_replay.routers(model):
            router.register_forward_hook(
                lambda m, a, o, layer=layer: (
                    replayed.append(layer)
                    if m.router_replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD
                    else None
                )
            )
    ddp = wrap_model(model)
    cfg = OptimizerConfig(
        optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0
    )
    opt = get_megatron_optimizer(cfg, [ddp], use_gloo_process_groups=False)
    result = policy_update(ddp, opt, samples, AlgorithmConfig(), 2, pack=pack)
    full = {name: t.clone() for bucket in iter_hf_weights(model) for name, t in bucket}
    if dist.get_rank() == 0:
        torch.save({"weights": full, "result": result, "replayed": replayed}, out_path)
    destroy_distributed()


def startup_barrier_worker(sync_dir: str, world_timeout_s: float, late_s: float, wait_min: float):
    """The trainer's start-up wait (loop.train) on a world whose own timeout is short.

    First rank 0 is ``late_s`` late (loading engines), then it never comes. Returns
    ``[(outcome, seconds)]`` of the two barriers on this rank ("passed" or the error)."""
    import datetime
    import os
    import time
    from pathlib import Path

    import torch.distributed as dist

    from megatron_rl.platform import collectives

    rank = int(os.environ["RANK"])
    sync = Path(sync_dir)
    (sync / f"up{rank}").touch()  # both up before the world forms: its timeout is short
    while not all((sync / f"up{r}").exists() for r in (0, 1)):
        time.sleep(0.02)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=world_timeout_s))
    group = collectives.timed_group(wait_min)
    key = "rollout.startup_timeout_minutes"
    outcomes = []
    for late in (late_s, None):  # None: rank 0 never arrives
        start = time.monotonic()
        if rank == 0 and late is None:
            deadline = time.monotonic() + 120
            while not (sync / "rank1_done").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            outcomes.append(("absent", time.monotonic() - start))
            break
        if rank == 0:
            time.sleep(late)
        try:
            collectives.barrier(group, wait_min, timeout_key=key)
            outcomes.append(("passed", time.monotonic() - start))
        except TimeoutError as err:
            outcomes.append((str(err), time.monotonic() - start))
    if rank == 1:
        (sync / "rank1_done").touch()
    return outcomes


def validation_wait_worker(sync_dir: str, world_timeout_s: float, slow_s: float, wait_min: float):
    """The other ranks' wait for rank 0's validation pass (validation.validate) on a world whose
    own timeout is shorter than the pass: rank 0 generates for ``slow_s`` and scores for
    ``slow_s``; then it never comes. Returns ``[(outcome, seconds)]`` on this rank."""
    import datetime
    import os
    import time
    from pathlib import Path
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_rl.config.sections import ValidationConfig
    from megatron_rl.platform import collectives
    from megatron_rl.rewards.config import RewardConfig
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.trainer import handoff, validation
    from megatron_rl.trainer.compute import ComputeClock

    rank = int(os.environ["RANK"])
    sync = Path(sync_dir)
    (sync / f"up{rank}").touch()  # both up before the world forms: its timeout is short
    while not all((sync / f"up{r}").exists() for r in (0, 1)):
        time.sleep(0.02)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=world_timeout_s))

    class Sample(list):
        prompt_index = 0
        response_ids = [1, 2]
        versions = [0, 0]

    class Pool:
        def generate(self, prompts, seeds, samples_per_prompt, temperature):
            time.sleep(slow_s)
            return [Sample([1, 2]) for _ in range(len(prompts) * samples_per_prompt)]

        def generated_tokens(self) -> int:
            return 0

    def score_batch(texts, refs, kinds):
        time.sleep(slow_s)
        return [1.0] * len(texts)

    config = SimpleNamespace(
        seed=0,
        validation=ValidationConfig(samples_per_prompt=2, timeout_minutes=wait_min),
        rollout=RolloutConfig(startup_timeout_minutes=wait_min / 2, batch_timeout_minutes=wait_min),
        reward=RewardConfig(),
    )
    run = SimpleNamespace(
        config=config,
        data=SimpleNamespace(
            val_by_domain=lambda: {"math": [0]},
            get=lambda i: SimpleNamespace(kind="math", reference="1"),
            sources=["math"],
        ),
        tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: "1"),
        rewards=SimpleNamespace(score_batch=score_batch, last_statuses=[], last_crashes=[]),
        clock=ComputeClock(1),
        metrics=SimpleNamespace(log=lambda record: None),
        exporter=None,
        forecast=None,
        encode=lambda i: [i],
    )
    waits = handoff.rank_zero_waits(config)
    pool = Pool() if rank == 0 else None
    outcomes = []
    start = time.monotonic()
    try:
        rate = validation.validate(run, pool, step=0, main=rank == 0, waits=waits)
        collectives.any_rank(False)  # the loop's next world collective: all in step again
        outcomes.append(("passed", time.monotonic() - start, rate))
    except Exception as err:  # noqa: BLE001 - the outcome is the test's finding
        outcomes.append((f"{type(err).__name__}: {err}", time.monotonic() - start, None))
    if rank == 1 and outcomes[0][0] == "passed":
        start = time.monotonic()
        try:  # rank 0 never starts this pass
            validation.validate(run, None, step=1, main=False, waits=waits)
            outcomes.append(("passed", time.monotonic() - start, None))
        except Exception as err:  # noqa: BLE001
            outcomes.append((f"{type(err).__name__}: {err}", time.monotonic() - start, None))
    if rank == 1:
        (sync / "rank1_done").touch()
    else:
        deadline = time.monotonic() + 120
        while not (sync / "rank1_done").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return outcomes


def rendezvous_worker(value: int) -> tuple[int, int]:
    """Join the env:// world run_local_ranks set up; return (rank, the all-reduced sum of
    ``value + rank``)."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    total = torch.tensor([value + dist.get_rank()])
    dist.all_reduce(total)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank, int(total)


def _preflight_first(ctx):
    """A check every rank passes (its status agreed by a collective)."""
    from megatron_rl.preflight.context import Outcome

    return Outcome(True, "ok")


def _preflight_boom(ctx):
    """Raise on the ranks named in ``$PREFLIGHT_FAILING`` (writing the time first); the
    others enter a collective over the data-parallel group, which waits for them."""
    import os
    import time
    from pathlib import Path

    import torch.distributed as dist

    from megatron_rl.platform import collectives
    from megatron_rl.preflight.context import Outcome

    rank = dist.get_rank()
    if str(rank) in os.environ["PREFLIGHT_FAILING"].split(","):
        (Path(ctx.run_dir) / f"raised{rank}").write_text(repr(time.time()))
        raise RuntimeError(f"CUDA out of memory on rank {rank} (injected)")
    from megatron.core import parallel_state

    # a data collective on a group of its own (as NCCL's are, apart from the gloo control
    # group the agreement runs on): the failing rank never joins it
    collectives.all_reduce(torch.ones(4), group=parallel_state.get_data_parallel_group())
    return Outcome(True, "ok")


def preflight_failure_worker(config, run_dir: str) -> dict:
    """A preflight of three checks ("first", "boom", "after") on every rank; returns what
    ``run_preflight`` returned (a rank that ends the preflight ends its process instead)."""
    import dataclasses

    from megatron_rl.preflight.context import Check
    from megatron_rl.preflight.runner import run_preflight

    checks = (
        Check("first", _preflight_first, "passes"),
        Check("boom", _preflight_boom, "raises on some ranks"),
        Check("after", _preflight_first, "passes"),
    )
    report = run_preflight(config, run_dir, checks=checks)
    return dataclasses.asdict(report)


def reward_failure_worker(sync_dir: str, world_timeout_s: float) -> list[str]:
    """Rank 0's reward fails (every response's scoring failed, over
    reward.max_error_fraction) in a validation pass, then in a training batch: every rank
    runs the loop's ``Trainer.validate`` of step 2 (its checkpoint due), whose save is a
    world collective here, then ``Trainer._fetch_batch``. Returns the events of this rank:
    ``saved`` and the errors it raised, in order."""
    import datetime
    import os
    import time
    from pathlib import Path
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_rl.config.sections import ValidationConfig
    from megatron_rl.platform import collectives
    from megatron_rl.rewards.config import RewardConfig
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.samples import Sample as RolloutSample
    from megatron_rl.trainer import handoff, loop
    from megatron_rl.trainer.compute import ComputeClock
    from megatron_rl.trainer.rollout_source import Group

    rank = int(os.environ["RANK"])
    sync = Path(sync_dir)
    (sync / f"up{rank}").touch()
    while not all((sync / f"up{r}").exists() for r in (0, 1)):
        time.sleep(0.02)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=world_timeout_s))

    class Sample(list):
        prompt_index = 0
        response_ids = [1, 2]
        versions = [0, 0]

    class Pool:
        version = 1

        def generate(self, prompts, seeds, samples_per_prompt, temperature, stop_when=None):
            return [Sample([1, 2]) for _ in range(len(prompts) * samples_per_prompt)]

        def generated_tokens(self) -> int:
            return 0

    class Source:
        def next_batch(self, version):
            samples = [RolloutSample(0, i, [1], [2], [-0.1], [1], [True]) for i in range(2)]
            return [Group(prompt_id=0, size=2, submitted_version=1, samples=samples)]

    class BrokenRewards:
        last_statuses: list[str] = []
        last_crashes: list[int] = []

        def score_batch(self, texts, refs, kinds):
            self.last_statuses, self.last_crashes = ["error"] * len(texts), [0] * len(texts)
            return [-1.0] * len(texts)

    config = SimpleNamespace(
        seed=0,
        validation=ValidationConfig(samples_per_prompt=2, timeout_minutes=2.0),
        rollout=RolloutConfig(startup_timeout_minutes=0.25, batch_timeout_minutes=0.5),
        reward=RewardConfig(),
        checkpoint=SimpleNamespace(every_steps=2, save_at_end=True),
        training=SimpleNamespace(max_gpu_hours=None),
    )
    run = SimpleNamespace(
        config=config,
        data=SimpleNamespace(
            val_by_domain=lambda: {"math": [0]},
            get=lambda i: SimpleNamespace(kind="math", reference="1"),
            sources=["math"],
        ),
        tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: "1"),
        rewards=BrokenRewards(),
        clock=ComputeClock(1),
        metrics=SimpleNamespace(log=lambda record: None),
        exporter=None,
        forecast=None,
        encode=lambda i: [i],
        tracker=None,
    )
    events: list[str] = []

    def save_checkpoint(wait: bool = False) -> None:
        collectives.any_rank(False)  # a collective, as the real save: every rank or none
        events.append("saved")

    trainer = SimpleNamespace(
        run=run,
        pool=Pool() if rank == 0 else None,
        step=2,
        main=rank == 0,
        waits=handoff.rank_zero_waits(config),
        forecast=None,
        config=config,
        save_checkpoint=save_checkpoint,
        finalize_checkpoint=lambda blocking=False: None,  # no save in flight
        owed=SimpleNamespace(step=None),  # no validation owed by a stop
        stop=SimpleNamespace(requested=None),  # no stop signal
        paid=None,
        source=Source() if rank == 0 else None,
    )
    trainer._on_every_rank = lambda make: loop.Trainer._on_every_rank(trainer, make)
    for phase in (loop.Trainer.validate, loop.Trainer._fetch_batch):
        try:
            phase(trainer)
            events.append("passed")
        except Exception as err:  # noqa: BLE001 - the outcome is the test's finding
            events.append(f"{type(err).__name__}: {err}")
    return events
