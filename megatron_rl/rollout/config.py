"""Recipe-facing configuration of the generator pool (imports no torch).

Defaults follow ScaleRL (docs/paper.md): 16 samples per prompt at temperature 1, FP32 LM head,
forced interruptions at a thinking budget drawn from [10240, 12288] tokens with a 2048-token
answer budget (off by default here: the tiny CPU recipes switch it on with small budgets).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config.errors import ConfigError
from megatron_rl.environments.config import EnvironmentConfig
from megatron_rl.rollout.quantization import QUANTIZATIONS, VLLM_QUANTIZATION

# rollout.weight_bucket_mb when unset. GPU: 1 GiB (vLLM's own packed-broadcast default; a
# Scout push is ~850 header / broadcast rounds at 256 MiB, ~210 at 1 GiB). CPU: 256 MiB: a
# ~500 MB fp32 push into one engine took the same time within the 2-core test machine's
# noise at 64, 256 and 1024 MiB (tools/bench_weight_push.py --bucket-mb; vLLM's reload is
# >90% of it), and the stream holds two buckets of gathered tensors at TP / EP > 1.
BUCKET_MB_GPU = 1024
BUCKET_MB_CPU = 256

DEFAULT_INTERRUPTION_TEXT = (
    "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"
)
PLACEMENTS: tuple[str, ...] = ("in_process", "subprocess", "remote")
LOGPROBS_MODES: tuple[str, ...] = ("processed_logprobs", "raw_logprobs")
KV_ON_PUSH: tuple[str, ...] = ("keep", "recompute")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
WEIGHT_TRANSPORTS: tuple[str, ...] = ("auto", "host", "nccl", "nccl_m2n")


@dataclass
class InterruptionConfig:
    """ScaleRL's forced length interruption.

    Attributes:
        enabled: cut samples that reach their thinking budget without closing their thinking.
        thinking_budget: ``[lo, hi]``: each sample's budget is drawn uniformly from these
            integers (inclusive) with a RNG seeded by ``seed``.
        answer_budget: tokens generated after the appended text.
        text: appended at the cut point; its tokens carry no loss (mask False).
        think_close: the marker whose presence means the thinking was closed.
        seed: seed of the budget RNG.
    """

    enabled: bool = False
    thinking_budget: tuple[int, int] = (10240, 12288)
    answer_budget: int = 2048
    text: str = DEFAULT_INTERRUPTION_TEXT
    think_close: str = "</think>"
    seed: int = 0

    def validate(self) -> None:
        lo, hi = self.thinking_budget
        if lo < 1 or hi < lo:
            raise ConfigError("thinking_budget", f"must be 1 <= lo <= hi, got [{lo}, {hi}]")
        if self.answer_budget < 1:
            raise ConfigError("answer_budget", f"must be >= 1, got {self.answer_budget}")
        if not self.text:
            raise ConfigError("text", "must not be empty")
        if not self.think_close:
            raise ConfigError("think_close", "must not be empty")


@dataclass
class RolloutConfig:
    """The vLLM generator pool and the weight push into it.

    Attributes:
        engines: number of vLLM engines (N >= 1); prompts are spread over them.
        placement: "in_process" (engines stepped by threads of the trainer's process, taking
            turns: vLLM's state is process-wide; the trainer's torch.distributed world must
            have one rank, and dense and MoE engines cannot mix), "subprocess" (one
            process per engine; on GPU each engine owns ``tensor_parallel`` GPUs) or "remote"
            (engines are tasks of their own, e.g. on other nodes of a Slurm job, that connect
            to the pool: ``megatron_rl.rollout.pool.remote``).
        temperature / top_p: sampling settings.
        samples_per_prompt: n samples drawn for every prompt.
        max_tokens: response length cap (with interruptions: for samples that close their
            thinking; an interrupted sample ends at budget + len(text) + answer_budget).
        fp32_head: compute the generator's LM head in FP32 (vLLM ``head_dtype``).
        dtype: the engines' weight dtype ("auto": the HF config's).
        quantization: FP8 rollouts: null (the default: the engines run ``dtype``), "fp8"
            (vLLM ``fp8_per_tensor``: linear layers' weights in FP8 e4m3 with one float32
            scale per layer, activations quantized per token on the fly) or "fp8_block" (vLLM
            ``fp8_per_block``: a scale per 128 x 128 weight block, activations per 1 x 128
            group; the DeepSeek-style recipe). Embeddings, LM head (``fp32_head`` unchanged),
            norms and routers keep ``dtype``. Every push sends the trainer's weights
            unquantized and each engine quantizes them on load with vLLM's own quantizer
            (why: ``megatron_rl.rollout.quantization``). Needs GPUs with FP8 (compute
            capability >= 8.9: H100, H200, B200, GB200; checked against ``cluster.gpu`` at
            load and on the machine by the preflight), an engine dtype of bfloat16 or float16
            (vLLM's FP8 methods take no float32 model) and a weight transport other than
            ``nccl_m2n``. The trainer-vs-engine log-prob gap is then checked against
            ``training.max_logprob_gap_fp8``. Pair it with ``algorithm.mismatch`` (the
            peers' importance-sampling correction of the larger mismatch).
        logprobs_mode: the generator log-probs returned per token: "processed_logprobs" (of
            the distribution actually sampled from: after temperature / top-p) or
            "raw_logprobs" (of the model's plain softmax).
        kv_on_push: what happens to requests in flight during a weight push: "keep" (their
            KV cache, computed by the old weights, is kept: PipelineRL) or "recompute" (their
            KV cache is recomputed by the new weights before they continue).
        stop_token_ids: tokens that end a sample; None = the model's EOS token(s).
        interruption: forced length interruption.
        max_turns: model turns per episode. 1 (the default): single-turn samples. Above 1:
            episodes in ``environment``, where each turn but the last may end in a tool call
            whose output is appended (``megatron_rl.environments``).
        environment: the multi-turn environment and its tool's limits (needs
            ``max_turns`` > 1).
        weight_bucket_mb: size of the buckets in which weights are streamed (MiB); null (the
            default): 1024 on a GPU machine, 256 on a CPU one (the platform layer decides:
            ``weight_bucket_bytes``). Bigger buckets mean fewer header / load rounds per push;
            the sender holds two buckets at a time (one sent, the next built) and each
            engine's receive buffers hold about two.
        weight_transport: how buckets reach the engines: "host" (through host memory: the
            trainer's tensors in process, shared memory to engine processes, TCP to remote
            engines; each bucket packed once and sent to all engines at the same time; vLLM
            backend ``megatron_rl_cpu``), "nccl" (GPU: one NCCL broadcast from the trainer's
            sender to every engine worker, vLLM's ``nccl`` backend; needs ``placement``
            subprocess or remote, see ``megatron_rl.rollout.weights.nccl``) or "auto" (the default:
            "nccl" on a GPU machine when the engines have GPUs of their own, ``placement``
            subprocess or remote without ``colocate``; else "host": see :meth:`resolved`).
            "nccl_m2n" (GPU, needs the ``nccl.m2n`` runtime; never chosen by "auto"): every
            trainer rank sends its own shards, vLLM's ``nccl_m2n`` backend; see
            ``megatron_rl.rollout.weights.m2n`` for what is verified and wired.
        nccl_address: the sender's address for the NCCL rendezvous (None: this host's name).
        kv_cache_gb: KV cache per engine (CPU: ``VLLM_CPU_KVCACHE_SPACE``, rounded up to whole
            GiB; GPU: bytes reserved).
        max_num_seqs: concurrent sequences per engine.
        max_model_len: prompt + response limit per sequence; None = the model's maximum.
        tensor_parallel: GPUs per engine (on CPU: worker processes, a CPU core each).
        expert_parallel: MoE engines place whole routed experts on their GPUs instead of
            splitting every expert's width over them (vLLM ``enable_expert_parallel``; the EP
            size is ``tensor_parallel``, attention stays tensor-parallel). Which experts a GPU
            holds is vLLM's own placement (``determine_expert_map``, linear), and a weight push
            hands each GPU only those experts (``megatron_rl.rollout.weights.experts``). Needs
            ``tensor_parallel`` >= 2 and a model with routed experts.
        gpu_ids: GPUs of the engine processes: engine i gets ``gpu_ids[i * tp : (i + 1) * tp]``
            (``CUDA_VISIBLE_DEVICES``); None: with ``placement: subprocess`` the GPUs after
            the trainer's on the node (``cluster.trainer_gpus`` ... , see
            ``RunConfig.validate``).
        colocate: allow engine GPUs that are also trainer GPUs (vLLM's start-up memory check
            then needs ``gpu_memory`` left by the trainer); off: overlap is an error.
        startup_timeout_minutes: how long the other trainer ranks wait (on a gloo barrier)
            for the main rank to start the engines (Scout loads for many minutes).
        batch_timeout_minutes: how long the other trainer ranks wait for the main rank's
            next batch or probe (generation, an engine restart with its load, rewards); more
            than ``startup_timeout_minutes``. Longer fails the run naming this key.
        push_timeout_seconds: a weight push (or the forming of its transport's group) that
            makes no progress in this time raises an error naming what it waited for: the
            time starts again at each bucket, each engine that joins, each engine's ack (a
            whole push of a large model, or ``nccl_m2n``'s one communicator per engine formed
            one after another, takes longer).
        engine_max_restarts: ``placement: subprocess`` or ``remote`` (weight transport
            host): an engine process that dies (killed, crashed without a Python error) is
            restarted on its devices (a remote engine by its generator task, which then
            reconnects), gets the current weights and its requests in flight again; at most
            this many times per engine within ``engine_restart_window_minutes``. One more death fails the run with the
            engine's last log lines. 0: the first death fails the run. An engine that
            reports an error (a Python exception) always fails the run: such failures repeat.
        engine_restart_window_minutes: the window of ``engine_max_restarts``.
        engine_stall_timeout: seconds. ``placement: subprocess``: an engine process that is
            alive but stalled (stopped by SIGSTOP, or frozen: no beat from it for this long;
            or one engine step, e.g. a decode step, running this long) is killed and counts
            as dead (restarted, its requests resubmitted). The beat comes from a thread of the
            engine process every few seconds whatever its loop does, so a long start-up,
            weight load or idle wait never counts; only a step does, and one decode step
            takes well under a second on any GPU. 0: off. (``remote`` engines: the
            connection's own heartbeat timeout.)
        prefix_caching: share prompt KV blocks between samples (keyed by policy version).
            Off in engines that return routed experts (a cached prefix is not recomputed,
            so its routing would be missing).
        return_routed_experts: every sample carries the experts each of its positions was
            routed to (``Sample.routed_experts``, MoE models; see
            ``megatron_rl.rollout.engine.routing``). Set by ``algorithm.routing_replay``.
        enforce_eager: no CUDA graphs / torch.compile (fast start; the CPU default).
        seed: engine sampling seed (engine i uses seed + i).
    """

    engines: int = 1
    placement: Literal["in_process", "subprocess", "remote"] = "in_process"
    temperature: float = 1.0
    top_p: float = 1.0
    samples_per_prompt: int = 16
    max_tokens: int = 512
    fp32_head: bool = True
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["fp8", "fp8_block"] | None = None
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    kv_on_push: Literal["keep", "recompute"] = "keep"
    stop_token_ids: list[int] | None = None
    interruption: InterruptionConfig = field(default_factory=InterruptionConfig)
    max_turns: int = 1
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    weight_bucket_mb: int | None = None
    weight_transport: Literal["auto", "host", "nccl", "nccl_m2n"] = "auto"
    nccl_address: str | None = None
    kv_cache_gb: float = 1.0
    max_num_seqs: int = 64
    max_model_len: int | None = None
    tensor_parallel: int = 1
    expert_parallel: bool = False
    gpu_ids: list[int] | None = None
    colocate: bool = False
    startup_timeout_minutes: float = 120.0
    batch_timeout_minutes: float = 180.0
    push_timeout_seconds: float = 300.0
    engine_max_restarts: int = 3
    engine_restart_window_minutes: float = 30.0
    engine_stall_timeout: float = 120.0
    prefix_caching: bool = True
    return_routed_experts: bool = False
    enforce_eager: bool = True
    seed: int = 0

    def validate(self) -> None:
        if self.weight_bucket_mb is not None and (
            isinstance(self.weight_bucket_mb, bool)
            or not isinstance(self.weight_bucket_mb, int)
            or self.weight_bucket_mb < 1
        ):
            raise ConfigError(
                "weight_bucket_mb",
                f"must be a whole number of MiB >= 1 (or null: {BUCKET_MB_GPU} on GPU, "
                f"{BUCKET_MB_CPU} on CPU), got {self.weight_bucket_mb!r}",
            )
        positive = ("engines", "samples_per_prompt", "max_tokens")
        for name in (*positive, "max_num_seqs", "tensor_parallel"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        _check_choice("placement", self.placement, PLACEMENTS)
        _check_choice("logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        _check_choice("kv_on_push", self.kv_on_push, KV_ON_PUSH)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("weight_transport", self.weight_transport, WEIGHT_TRANSPORTS)
        self._validate_quantization()
        nccl = self.weight_transport in ("nccl", "nccl_m2n")
        if nccl and self.placement == "in_process":
            raise ConfigError(
                "weight_transport",
                f"{self.weight_transport!r} needs engines on GPUs of their own: placement "
                "'subprocess' or 'remote', not 'in_process'",
            )
        if nccl and self.colocate:
            raise ConfigError(
                "weight_transport",
                f"{self.weight_transport!r} needs engine GPUs apart from the trainer's (NCCL has "
                "one rank per GPU): colocate must be false",
            )
        if self.expert_parallel and self.tensor_parallel < 2:
            raise ConfigError(
                "expert_parallel",
                "needs rollout.tensor_parallel >= 2: vLLM splits the experts over an engine's "
                f"GPUs, and tensor_parallel is {self.tensor_parallel}",
            )
        if self.return_routed_experts and not self.enforce_eager:
            raise ConfigError(
                "return_routed_experts",
                "(algorithm.routing_replay) needs enforce_eager: the routing capture runs in "
                "the forward, which CUDA graphs replay without it",
            )
        if self.temperature <= 0:
            raise ConfigError("temperature", f"must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.engine_max_restarts < 0:
            raise ConfigError(
                "engine_max_restarts", f"must be >= 0, got {self.engine_max_restarts}"
            )
        if not self.engine_stall_timeout >= 0:
            raise ConfigError(
                "engine_stall_timeout", f"must be >= 0 (0: off), got {self.engine_stall_timeout}"
            )
        timeouts = ("startup_timeout_minutes", "batch_timeout_minutes", "push_timeout_seconds")
        for name in (*timeouts, "engine_restart_window_minutes"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        if self.batch_timeout_minutes <= self.startup_timeout_minutes:
            raise ConfigError(
                "batch_timeout_minutes",
                f"{self.batch_timeout_minutes:g} must exceed rollout.startup_timeout_minutes "
                f"({self.startup_timeout_minutes:g}): a batch can wait for a restarted engine "
                "to load",
            )
        if self.kv_cache_gb <= 0:
            raise ConfigError("kv_cache_gb", f"must be > 0, got {self.kv_cache_gb}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len", f"must be >= 2, got {self.max_model_len}")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise ConfigError(
                "stop_token_ids", f"must be token ids >= 0, got {self.stop_token_ids}"
            )
        if self.gpu_ids is not None and len(self.gpu_ids) != self.engines * self.tensor_parallel:
            raise ConfigError(
                "gpu_ids",
                f"lists {len(self.gpu_ids)} GPUs; engines x tensor_parallel = "
                f"{self.engines} x {self.tensor_parallel} are needed",
            )
        try:
            self.interruption.validate()
        except ConfigError as err:
            raise err.within("interruption") from None
        self._validate_turns()
        if self.interruption.enabled and self.interruption.thinking_budget[1] > self.max_tokens:
            raise ConfigError(
                "interruption.thinking_budget",
                f"upper end {self.interruption.thinking_budget[1]} exceeds rollout.max_tokens "
                f"{self.max_tokens}",
            )

    def _validate_quantization(self) -> None:
        if self.quantization is None:
            return
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(
                "quantization",
                f"must be null or one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}",
            )
        if self.dtype == "float32":
            raise ConfigError(
                "quantization",
                f"{self.quantization!r} needs an engine dtype of bfloat16 or float16 (vLLM "
                f"{VLLM_QUANTIZATION[self.quantization]} takes no float32 model), and "
                "rollout.dtype is float32",
            )
        if self.weight_transport == "nccl_m2n":
            # vLLM 0.32's m2n engine reshards directly into a worker's parameters only for an
            # unquantized model (m2n_engine.py:249-256, allow_direct): with quantization every
            # parameter is a fallback, received whole by every worker and loaded through
            # load_weights, so nccl_m2n keeps none of its per-shard transfer, and that path
            # (with the quantizer's TP all-reduce of per-tensor scales) is not verified.
            raise ConfigError(
                "quantization",
                f"{self.quantization!r} is not verified with weight_transport nccl_m2n (with a "
                "quantized engine vLLM's m2n engine sends every worker whole tensors for "
                "load_weights instead of its shards): use weight_transport nccl or host",
            )

    def _validate_turns(self) -> None:
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int):
            raise ConfigError("max_turns", f"must be an int >= 1, got {self.max_turns!r}")
        if self.max_turns < 1:
            raise ConfigError("max_turns", f"must be >= 1, got {self.max_turns}")
        try:
            self.environment.validate()
        except ConfigError as err:
            raise err.within("environment") from None
        if self.max_turns > 1 and not self.environment.name:
            raise ConfigError(
                "environment.name",
                f"rollout.max_turns is {self.max_turns}: name the environment whose tool the "
                "turns call (e.g. python_tool, code_feedback)",
            )
        if self.environment.name and self.max_turns < 2:
            raise ConfigError(
                "max_turns",
                f"environment {self.environment.name!r} needs rollout.max_turns >= 2 (one "
                "turn is a single-turn sample: no tool call)",
            )

    @property
    def episodes(self) -> bool:
        """Whether samples are multi-turn episodes of ``environment``: ``max_turns`` > 1
        (``validate`` requires an environment exactly then). The one test of it, for the
        engines, the pool, the trainer and the planner."""
        return self.max_turns > 1 and bool(self.environment.name)

    @property
    def weight_bucket_bytes(self) -> int:
        """``weight_bucket_mb`` in bytes; unset: this machine's default (the platform layer
        says whether it has GPUs)."""
        if self.weight_bucket_mb is not None:
            return self.weight_bucket_mb * 2**20
        from megatron_rl.platform import get_platform

        return self.weight_bucket_bytes_on(get_platform().is_gpu)

    def weight_bucket_bytes_on(self, gpu: bool) -> int:
        """``weight_bucket_mb`` in bytes, unset resolved for a GPU (``gpu``) or CPU machine
        (memory plans are made for the GPU cluster, on any machine)."""
        if self.weight_bucket_mb is not None:
            return self.weight_bucket_mb * 2**20
        return (BUCKET_MB_GPU if gpu else BUCKET_MB_CPU) * 2**20

    def resolved(self) -> RolloutConfig:
        """This config with ``weight_transport: auto`` decided for this machine (the platform
        layer says whether it has GPUs): "nccl" when it has and the engines own GPUs apart
        from the trainer's (``placement`` subprocess or remote, ``colocate`` off), else
        "host". The pool resolves its config once, before its engines start."""
        if self.weight_transport != "auto":
            return self
        from megatron_rl.platform import get_platform

        own_gpus = self.placement != "in_process" and not self.colocate
        nccl = get_platform().is_gpu and own_gpus
        return dataclasses.replace(self, weight_transport="nccl" if nccl else "host")


def engine_gpus(config: RolloutConfig, trainer_gpus: int, gpus_per_node: int) -> list[int]:
    """The GPUs of this node's engine processes (``placement: subprocess``): ``gpu_ids`` when
    given, else the GPUs after the ``trainer_gpus`` that the trainer ranks of this node hold
    (``LOCAL_RANK`` 0 .. n-1 use GPUs 0 .. n-1). Without ``colocate`` an engine GPU that is
    also a trainer GPU is an error: vLLM's start-up memory check fails beside a trainer.
    Raises ``ValueError`` naming the recipe key."""
    need = config.engines * config.tensor_parallel
    trainer = set(range(trainer_gpus))
    if config.gpu_ids is not None:
        shared = sorted(trainer & set(config.gpu_ids))
        if shared and not config.colocate:
            raise ValueError(
                f"rollout.gpu_ids {config.gpu_ids} include GPU(s) {shared} of the trainer "
                f"ranks on this node (0..{trainer_gpus - 1}); pick other GPUs or set "
                "rollout.colocate: true"
            )
        return list(config.gpu_ids)
    first = 0 if config.colocate else trainer_gpus
    if first + need > gpus_per_node:
        raise ValueError(
            f"rollout.engines x rollout.tensor_parallel = {config.engines} x "
            f"{config.tensor_parallel} engine GPUs do not fit beside the {trainer_gpus} trainer "
            f"GPU(s) on this node of cluster.gpus_per_node {gpus_per_node} GPUs; use "
            "placement: remote (engines on nodes of their own), fewer engines, or set "
            "rollout.gpu_ids / rollout.colocate"
        )
    return list(range(first, first + need))


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(name, f"must be one of {', '.join(choices)}; got {value!r}")
