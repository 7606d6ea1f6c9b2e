"""One vLLM engine, stepped by its owner (``LLMEngine`` with the engine core in-process).

The owner (an :class:`~megatron_rl.rollout.engine.runner.EngineRunner`) calls :meth:`step` in a
loop and loads weights between two steps: requests in flight stay in vLLM's scheduler
across a load, which is what makes weight pushes in-flight (PipelineRL).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import random
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.weights.experts import routed_expert_count
from megatron_rl.rollout.weights.senders import transport_for

logger = logging.getLogger(__name__)

# vLLM keeps process-wide state (forward context, CPU kernel scratch buffers, config
# context): two engines of one process stepping at once corrupt memory. Every call into an
# engine holds this lock, so in-process engines take turns (engine processes each own one).
_ENGINE_LOCK = threading.RLock()
_live_engines = 0  # engines of this process (vLLM's parallel state is process-wide)


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request after a step: ``token_ids [k]``, ``logprobs [k]``; when it
    finished in an engine that returns routed experts, ``routed_experts [positions, layers,
    topk]`` of its whole sequence (see ``megatron_rl.rollout.engine.routing``)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finished: bool
    finish_reason: str | None
    routed_experts: np.ndarray | None = None
    stop_reason: int | str | None = None  # the stop id or stop string that ended it


@contextlib.contextmanager
def _preserve_process_state():
    """Undo vLLM's process-wide side effects of building an in-process CPU engine: it seeds
    every global RNG, sets torch to one thread and replaces ``torch.set_num_threads``."""
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    states = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])


THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_worker_binding(tensor_parallel: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a CPU engine of ``tensor_parallel`` workers: the CPUs
    this process may use, split into that many contiguous groups (``"0|1"``). vLLM's default
    ("auto") binds each worker to a NUMA node of its own and refuses more workers than nodes
    ("Not enough allowed NUMA nodes", ``vllm/utils/ompmultiprocessing.py``), which a one-node
    machine never has. Raises ``ValueError`` when there are fewer CPUs than workers."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tensor_parallel:
        raise ValueError(
            f"rollout.tensor_parallel {tensor_parallel}: a CPU engine needs a CPU core per "
            f"worker; this process may use {len(cpus)}"
        )
    size, extra = divmod(len(cpus), tensor_parallel)
    groups, start = [], 0
    for rank in range(tensor_parallel):
        end = start + size + (rank < extra)
        groups.append(",".join(map(str, cpus[start:end])))
        start = end
    return "|".join(groups)


@contextlib.contextmanager
def _cpu_workers_bound(config: RolloutConfig):
    """Set :func:`cpu_worker_binding` while vLLM spawns a CPU engine's workers (they read it
    at start-up), unless the user set it; restored after, for the next engine of another
    size."""
    from megatron_rl.platform import get_platform

    if get_platform().is_gpu or config.tensor_parallel == 1 or THREADS_BIND in os.environ:
        yield
        return
    os.environ[THREADS_BIND] = cpu_worker_binding(config.tensor_parallel)
    try:
        yield
    finally:
        del os.environ[THREADS_BIND]


# vLLM's executors name the FileStore of their one-process world by this function (imported
# into each executor module): a file ``vllm_dist_<uuid>`` in the temporary directory, removed
# when the world closes, never when the engine process is SIGKILLed.
_FILE_STORE_USERS = ("vllm.v1.executor.uniproc_executor", "vllm.v1.executor.multiproc_executor")
FILE_STORE_PREFIX = "vllm_dist_"


def file_store_prefix(pid: int) -> str:
    """The name prefix of the FileStore files of engine process ``pid`` (:func:`_file_store_in`)."""
    return f"{FILE_STORE_PREFIX}pid{pid}_"


@contextlib.contextmanager
def _file_store_in(directory: str | None):
    """While vLLM builds this engine: its FileStore file in ``directory`` (an engine process's
    own: the launcher's, which removes the files of a dead engine and the directory at its
    close), named after this process (:func:`file_store_prefix`). Only vLLM's rendezvous
    moves: the temporary directory stays (the sandbox of the episodes' tools uses it).
    ``directory`` None: vLLM's own (the engines on threads of the trainer's process)."""
    if directory is None:
        yield
        return
    import importlib
    import uuid

    def init_method() -> str:
        return f"file://{directory}/{file_store_prefix(os.getpid())}{uuid.uuid4().hex}"

    modules = [importlib.import_module(name) for name in _FILE_STORE_USERS]
    before = [module.get_file_store_init_method for module in modules]
    for module in modules:
        module.get_file_store_init_method = init_method
    try:
        yield
    finally:
        for module, original in zip(modules, before):
            module.get_file_store_init_method = original


def _fix_cuda_stream_stand_ins() -> None:
    """Importing vLLM's CPU worker (``vllm/v1/worker/cpu/shm.py``) replaces ``torch.cuda.Stream``,
    ``current_stream`` and ``stream`` process-wide by placeholders whose ``record_event()``
    returns None; Megatron's alltoall MoE dispatcher, in the same process, then calls
    ``.synchronize()`` on it. Keep vLLM's placeholders, with ``record_event`` returning one."""
    from vllm.v1.worker.cpu import shm

    if getattr(torch.cuda.Stream, "_records_events", False):
        return

    class Stream(shm._StreamPlaceholder):
        _records_events = True

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.record_event = lambda *a, **k: shm._EventPlaceholder()

    torch.cuda.Stream = Stream
    torch.cuda.current_stream = lambda *args, **kwargs: Stream()
    torch.cuda.stream = lambda *args, **kwargs: Stream()


def engine_args(hf_dir: str, config: RolloutConfig, index: int) -> Any:
    """vLLM ``EngineArgs`` for engine ``index`` of the pool."""
    from vllm import EngineArgs

    from megatron_rl.models.hf_config import load_hf_config, vllm_config_dir
    from megatron_rl.platform import get_platform

    hf_config = load_hf_config(hf_dir)
    text = getattr(hf_config, "text_config", hf_config)  # the text model's (load_text_config)
    resolved = config.resolved()
    transport = transport_for(resolved)
    kwargs: dict[str, Any] = {}
    if get_platform().is_gpu:
        kwargs["kv_cache_memory_bytes"] = int(config.kv_cache_gb * 2**30)
    else:
        # A prompt split over two steps (chunked prefill) makes vLLM rewind the request's
        # seeded generator, which CPU generators cannot ("CPU Generator does not use
        # offset"): give every step room for all sequences at full length.
        longest = config.max_model_len or getattr(text, "max_position_embeddings", 4096)
        kwargs["max_num_batched_tokens"] = max(4096, config.max_num_seqs * longest)
    chunk = getattr(text, "attention_chunk_size", None)
    if chunk:
        # vLLM's chunked local attention needs the KV block size to divide the chunk (CPU
        # block sizes are multiples of 32).
        kwargs["block_size"] = next((b for b in (128, 64, 32, 16) if chunk % b == 0), None)
        if kwargs["block_size"] is None or (
            kwargs["block_size"] < 32 and not get_platform().is_gpu
        ):
            raise ValueError(f"attention_chunk_size {chunk} is not a multiple of a KV block size")
    if config.quantization is not None:
        kwargs["quantization"] = fp8_engine_quantization(config, get_platform().is_gpu)
    if config.expert_parallel and not routed_expert_count(text):
        raise ValueError(f"rollout.expert_parallel: {hf_dir} has no routed experts")
    if config.return_routed_experts:
        from megatron_rl.rollout.engine.routing import WORKER_EXTENSION

        kwargs["worker_extension_cls"] = WORKER_EXTENSION
    overrides = {}
    if hasattr(text, "attn_temperature_tuning"):
        # vLLM switches Llama-4 temperature tuning on only above 32k context; the trainer
        # (and transformers) follow the config: make vLLM follow it too.
        overrides["attn_temperature_tuning"] = bool(text.attn_temperature_tuning)
    # vLLM reads config.json with transformers itself, from the config's directory and again
    # from the tokenizer's: a coerced copy, with the tokenizer in it, where it needs one
    coerced = vllm_config_dir(hf_dir)
    return EngineArgs(
        model=hf_dir,
        hf_config_path=coerced,
        tokenizer=coerced,
        # the stop strings of a multi-turn episode's tool calls need vLLM's detokenizer
        skip_tokenizer_init=not config.episodes,
        # Text in, text out: no multimodal processor (vLLM builds Llama-4's at start from the
        # original directory, whose tokenizer transformers loads through the original
        # config.json: renderers/base.py:181-196, transformers_utils/processor.py:357-404)
        # and no vision tower (limits 0: config/multimodal.py:699, interfaces.py:339)
        language_model_only=True,
        dtype=config.dtype,
        seed=config.seed + index,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        enforce_eager=config.enforce_eager,
        enable_prefix_caching=config.prefix_caching and not config.return_routed_experts,
        tensor_parallel_size=config.tensor_parallel,
        enable_expert_parallel=config.expert_parallel,
        logprobs_mode=config.logprobs_mode,
        hf_overrides=fp32_head_overrides(hf_config) if config.fp32_head else None,
        override_generation_config=overrides,
        weight_transfer_config={"backend": transport.backend(resolved)},
        # One scheduled batch at a time: a weight load between two steps then separates the
        # tokens of the old weights from those of the new ones exactly.
        async_scheduling=False,
        # Its throughput lines every 10 s interleave with the trainer's progress bar; the
        # trainer logs the pool's load and tokens per step.
        disable_log_stats=True,
        **kwargs,
    )


def fp32_head_overrides(hf_config: Any) -> dict[str, Any]:
    """vLLM's ``hf_overrides`` for an FP32 LM head (``rollout.fp32_head``) on the model of
    ``hf_config`` (its transformers config).

    vLLM applies a flat override to the top-level config only (``config.update``,
    ``transformers_utils/config.py:926-928``), and each ``LogitsProcessor`` reads
    ``head_dtype`` from the config current where it is built (``logits_processor.py:95-96``,
    ``config/model.py:2102``, ``_get_head_dtype``). A multimodal model builds its language
    model, LM head included, with a deep copy of its ``text_config`` as that config
    (Llama-4 Scout's ``Llama4ForConditionalGeneration``: ``mllama4.py:779-786``,
    ``VllmConfig.with_hf_config``), so the flat override never reached it and the head ran
    in the model's dtype. A nested override (``ModelConfig._apply_dict_overrides``) sets it
    on the text config too; a text-only config gets none (vLLM would set a dict named
    ``text_config`` on it)."""
    from transformers import PretrainedConfig

    overrides: dict[str, Any] = {"head_dtype": "float32"}
    if isinstance(getattr(hf_config, "text_config", None), PretrainedConfig):
        overrides["text_config"] = {"head_dtype": "float32"}
    return overrides


def fp8_engine_quantization(config: RolloutConfig, gpu: bool) -> str:
    """vLLM's ``quantization`` for ``rollout.quantization`` (its online FP8 method: the engine
    quantizes the trainer's unquantized weights at load and at every push,
    ``megatron_rl.rollout.quantization``). On a machine without GPUs: ConfigError naming the
    key (vLLM's CPU build has no static FP8 quantizer). Which GPU the engines run on is checked
    before they start (``cluster.gpu`` at load, the preflight on the machine): asking CUDA
    here would initialise it in the process that then starts vLLM's workers."""
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.rollout.quantization import VLLM_QUANTIZATION, quantization_problem

    if not gpu:
        why = quantization_problem(config.quantization, "this machine (CPU only)", None)
        raise ConfigError("rollout.quantization", why)
    return VLLM_QUANTIZATION[config.quantization]


def _check_process_layout(hf_dir: str) -> None:
    """vLLM's parallel groups are process-wide and made for the first engine's model: one
    without experts gets no expert-parallel group, and an MoE engine built next would fail."""
    from vllm.distributed import parallel_state

    from megatron_rl.models.hf_config import load_text_config

    if _live_engines == 0 or not parallel_state.model_parallel_is_initialized():
        return
    text = load_text_config(hf_dir)
    moe = routed_expert_count(text) > 0
    try:
        parallel_state.get_ep_group()
    except AssertionError:
        if moe:
            raise ValueError(
                "an MoE model cannot get an in-process vLLM engine while a dense model's engine "
                "lives in this process (vLLM's parallel groups are process-wide); close that pool "
                "first or use rollout.placement: subprocess"
            ) from None


def _release_vllm_groups() -> None:
    """Destroy vLLM's process-wide groups, its world group included, but not the default
    process group, which in-process is the trainer's.

    vLLM 0.32's ``destroy_model_parallel`` keeps its world group (``_WORLD``), made over the
    default process group of its day. Once that group is torn down and made anew (a training
    run or an in-process conversion ends with ``destroy_distributed``), the next engine of
    the process reused the stale world group and failed at start-up: "Process group ... is not
    initialized in the world group map"."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    world = parallel_state._WORLD
    if world is not None:
        with contextlib.suppress(ValueError):  # its groups went with an old default group
            if dist.is_initialized():
                world.destroy()
        parallel_state._WORLD = None
        parallel_state._NODE_COUNT = None


class _ExpectedReloadWarnings(logging.Filter):
    """vLLM 0.32's layerwise reload warns "<layer>: Failed to load weights" for every layer
    that has loadable tensors but got none in the update. Rotary embeddings hold only their
    cos/sin cache, computed from the config and never in a checkpoint or weight stream, so
    every push printed it (it restores the cache, correctly). Other layers still warn."""

    QUIET = frozenset({"RotaryEmbedding"})

    def filter(self, record: logging.LogRecord) -> bool:
        expected = record.msg == "%s: Failed to load weights" and record.args
        return not (expected and record.args[0] in self.QUIET)


def _quiet_expected_reload_warnings() -> None:
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _ExpectedReloadWarnings) for f in log.filters):
        log.addFilter(_ExpectedReloadWarnings())


class VLLMEngine:
    """A vLLM ``LLMEngine`` driven step by step, with weight loading between steps."""

    def __init__(
        self, hf_dir: str, config: RolloutConfig, index: int = 0, store_dir: str | None = None
    ) -> None:
        """``store_dir``: where vLLM's rendezvous file goes (an engine process's launcher
        directory, :func:`_file_store_in`); None: vLLM's temporary directory."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core lives here
        # whole GiB on CPU
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(config.kv_cache_gb)))
        if config.return_routed_experts:
            # The routing capture reads the V1 model runner's batch layout (the CPU build
            # always runs V1; on GPU vLLM 0.32 would pick its V2 runner).
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        from vllm import envs
        from vllm.v1.engine.llm_engine import LLMEngine

        from megatron_rl.platform import get_platform
        from megatron_rl.rollout.weights.cpu_backend import register_backend

        register_backend()
        _quiet_expected_reload_warnings()
        config = config.resolved()  # a pool's config is already: this engine's platform else
        self.config = config
        self.index = index
        self._joined = False  # init_transport ran
        self._planned: dict[str, int] = {}  # tensor bytes announced at init (nccl_m2n)
        global _live_engines
        with _ENGINE_LOCK, _preserve_process_state():
            if _live_engines == 0:  # what an engine left unclosed, e.g. after a failed start
                _release_vllm_groups()
            _check_process_layout(hf_dir)
            # vLLM caches its environment variables once an engine has started
            # (``enable_envs_cache``): a later engine of this process would read the first
            # one's (KV cache size, CPU worker binding). It caches them again after start-up.
            envs.disable_envs_cache()
            with _cpu_workers_bound(config), _file_store_in(store_dir):
                self.engine = LLMEngine.from_engine_args(engine_args(hf_dir, config, index))
            _live_engines += 1
            if transport_for(config).joins_at_build:  # else JoinTransport: init_transport
                self.init_transport({})
            if config.return_routed_experts:
                self.engine.collective_rpc("start_routing_capture")
            if not get_platform().is_gpu:
                _fix_cuda_stream_stand_ins()
        self.max_model_len = self.engine.model_config.max_model_len

    def init_transport(self, init_info: dict[str, Any]) -> None:
        """vLLM's ``init_weight_transfer_engine`` on every worker (nccl: joins the group).
        Joined before (the pool forms its group anew after a death), every worker first
        leaves that group: vLLM's ``shutdown_weight_transfer_engine`` (nccl: aborts the
        communicator, which does not wait for a dead peer)."""
        rpc = self.engine.collective_rpc
        if self._joined:
            rpc("shutdown_weight_transfer_engine")
        rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})
        self._joined = True
        # nccl_m2n announces a tensor's shape and dtype here, its updates name it only
        self._planned = _nbytes_by_name(init_info)

    def close(self) -> None:
        """Shut the engine down, leaving the process's torch.distributed world alone.

        vLLM's in-process engine core tears down *all* distributed state on shutdown,
        including the default process group, which in-process is the trainer's. We keep it
        and destroy only vLLM's own groups (:func:`_release_vllm_groups`), once the process's
        last engine is gone: they are process-wide and fixed by the first engine's model (a
        dense model's layout has no expert-parallel group, so a later MoE engine would fail).
        """
        global _live_engines
        import vllm.v1.engine.core as engine_core

        with _ENGINE_LOCK:
            if getattr(self, "engine", None) is None:
                return
            _live_engines -= 1
            last = _live_engines == 0

            def cleanup(*args, **kwargs) -> None:
                gc.unfreeze()
                if last:
                    _release_vllm_groups()

            original = engine_core.cleanup_dist_env_and_memory
            engine_core.cleanup_dist_env_and_memory = cleanup
            try:
                self.engine.engine_core.shutdown()
            finally:
                engine_core.cleanup_dist_env_and_memory = original
                self.engine = None

    def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_token_ids: list[int],
        cache_salt: str | None = None,
        seed: int | None = None,
        stop_strings: Sequence[str] = (),
    ) -> None:
        """Queue a request; its tokens come back from :meth:`step` as deltas. With ``seed``
        the request samples from its own generator (reproducible whatever else runs).
        ``stop_strings`` (a tool-call format's, multi-turn episodes): kept in the output;
        vLLM detokenizes such a request to find them and drops the ids after the token that
        completes one."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=1,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            logprobs=0,
            stop_token_ids=stop_token_ids,
            # the pool decides what stops a sample (default: the model's EOS ids, passed in
            # stop_token_ids); vLLM would otherwise add generation_config.json's EOS
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
            detokenize=bool(stop_strings),
            stop=list(stop_strings) or None,
            include_stop_str_in_output=True,
            seed=seed,
        )
        prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_ids)}
        if cache_salt is not None and self.config.prefix_caching:
            prompt["cache_salt"] = cache_salt
        with _ENGINE_LOCK:
            self.engine.add_request(request_id, prompt, params)

    def abort(self, request_ids: list[str]) -> dict[str, np.ndarray]:
        """Abort requests; returns their routed experts so far (when the engine returns them)."""
        with _ENGINE_LOCK:
            self.engine.abort_request(request_ids)
            return self._take_routed_experts(request_ids)

    def _take_routed_experts(self, request_ids: list[str]) -> dict[str, np.ndarray]:
        if not self.config.return_routed_experts or not request_ids:
            return {}
        # every worker records; the first (TP rank 0) answers first
        return self.engine.collective_rpc("take_routed_experts", args=(request_ids,))[0]

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[TokenDelta]:
        """Run one engine step; the new tokens of every request that produced some."""
        deltas = []
        with _ENGINE_LOCK:
            outputs = self.engine.step()
            routed = self._take_routed_experts([o.request_id for o in outputs if o.finished])
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            logprobs = [entry[t].logprob for entry, t in zip(completion.logprobs or [], ids)]
            assert len(logprobs) == len(ids), "vLLM returned no log-prob for a sampled token"
            deltas.append(
                TokenDelta(
                    out.request_id,
                    ids,
                    logprobs,
                    out.finished,
                    completion.finish_reason,
                    routed.get(out.request_id),
                    completion.stop_reason,
                )
            )
        return deltas

    def load_weights(
        self, updates: Iterable[dict[str, Any]], kv_on_push: str = "keep"
    ) -> tuple[int, int]:
        """Load buckets (update infos of the ``megatron_rl_cpu`` transport, or the headers of
        NCCL broadcasts) through vLLM's weight-transfer API; returns (tensors, bytes) loaded.
        Requests in flight are kept; with ``kv_on_push="recompute"`` their KV cache is
        recomputed by the new weights (they are preempted and prefilled again), with "keep"
        it stays as it is."""
        tensors = nbytes = 0
        rpc = self.engine.collective_rpc
        with _ENGINE_LOCK:
            rpc("start_weight_update")
        try:
            for update in updates:  # the lock is not held while waiting for the next bucket
                with _ENGINE_LOCK:
                    rpc("update_weights", kwargs={"update_info": update})
                # expert parallel: a part per rank, and (NCCL) the dense tensors at the top
                parts = ([update] if "names" in update else []) + update.get("ep_ranks", [])
                for part in parts:
                    tensors += len(part["names"])
                    nbytes += _update_nbytes(part, self._planned)
        finally:
            with _ENGINE_LOCK:
                rpc("finish_weight_update")
                if kv_on_push == "recompute":
                    self.engine.reset_prefix_cache(reset_running_requests=True)
        return tensors, nbytes


def _nbytes_by_name(info: dict[str, Any]) -> dict[str, int]:
    """Bytes of each tensor an update info (or nccl_m2n's init info) describes."""
    return {
        name: torch.Size(shape).numel() * getattr(torch, dtype).itemsize
        for name, shape, dtype in zip(
            info.get("names", []), info.get("shapes", []), info.get("dtype_names", [])
        )
    }


def _update_nbytes(update: dict[str, Any], planned: dict[str, int]) -> int:
    if update.get("tensors") is not None:
        return sum(t.numel() * t.element_size() for t in update["tensors"])
    if "shapes" not in update:  # nccl_m2n: names only, sized by its init info (``planned``)
        return sum(planned[name] for name in update["names"])
    return sum(_nbytes_by_name(update).values())
