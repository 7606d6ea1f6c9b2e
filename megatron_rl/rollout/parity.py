"""``megatron-rl check-parity HF_DIR``: do vLLM's sampled-token log-probs match Megatron's?

Builds the Megatron model from HF_DIR (TP / EP ranks spawned here when asked), perturbs its
weights with a fixed seed, samples with a vLLM engine started from HF_DIR (the unperturbed
weights: "before"), pushes the perturbed weights, samples again ("after"), and compares the
generator's log-probs of the sampled tokens with Megatron's (FP32 head). Before the push the
two must differ (otherwise the check could not fail); after it they must agree.

Also reports the push's bytes and seconds next to a plain ``copy_`` of the same bytes.
Exit code 1 when the "after" max |delta| exceeds ``--threshold``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParityOptions:
    hf_dir: str
    tensor: int = 1
    expert: int = 1
    seed: int = 1234
    noise: float = 0.5  # perturbation, relative to each tensor's std
    prompts: int = 8
    samples: int = 2
    prompt_tokens: int = 8
    max_tokens: int = 40
    bucket_mb: float | None = None  # None: rollout.weight_bucket_mb's default (the platform's)
    placement: str | None = None  # default: in_process with one rank, else subprocess
    transport: str = "host"  # rollout.weight_transport; nccl: the engine gets GPU `world`
    dtype: str = "float32"  # of both sides; the LM head runs in FP32 on both


@dataclass(frozen=True)
class ParityResult:
    mean_abs_delta: float
    max_abs_delta: float
    tokens: int
    before_mean_abs_delta: float
    before_max_abs_delta: float
    bytes_pushed: int
    push_seconds: float
    load_seconds: float
    copy_seconds: float
    tensor: int
    expert: int
    placement: str
    dtype: str = "float32"

    @property
    def push_to_copy_ratio(self) -> float:
        return self.push_seconds / max(self.copy_seconds, 1e-12)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", help="Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--tp", type=int, default=1, help="Megatron tensor parallel size")
    parser.add_argument("--ep", type=int, default=1, help="Megatron expert parallel size")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--threshold", type=float, default=1e-3, help="max |delta| allowed")
    parser.add_argument("--seed", type=int, default=1234, help="perturbation / prompt seed")
    parser.add_argument("--noise", type=float, default=0.5, help="relative perturbation")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=2, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="weight bucket size (MiB); default: rollout.weight_bucket_mb's (1024 GPU, 256 CPU)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="model dtype of trainer and engine (the LM head runs in FP32 on both)",
    )
    parser.add_argument(
        "--transport",
        choices=("host", "nccl"),
        default="host",
        help="weight transport (nccl: GPU; the engine runs on the GPU after the trainer's)",
    )


def run(args: argparse.Namespace) -> int:
    problem = _launch_problem(args)
    if problem:
        print(f"megatron-rl check-parity: error: {problem}", file=sys.stderr)
        return 2
    options = ParityOptions(
        hf_dir=args.hf_dir,
        tensor=args.tp,
        expert=args.ep,
        seed=args.seed,
        noise=args.noise,
        prompts=args.prompts,
        samples=args.samples,
        max_tokens=args.max_tokens,
        bucket_mb=args.bucket_mb,
        transport=args.transport,
        dtype=args.dtype,
    )
    # With --json, stdout carries the JSON alone: everything else written to file descriptor 1
    # meanwhile (vLLM's loggers, C++ warnings, by this process or the ranks it spawns) goes
    # to stderr.
    with _stdout_to_stderr() if args.json else contextlib.nullcontext():
        result = check_parity(options)
    passed = result.max_abs_delta <= args.threshold
    if args.json:
        print(
            json.dumps(
                {
                    **asdict(result),
                    "push_to_copy_ratio": result.push_to_copy_ratio,
                    "threshold": args.threshold,
                    "passed": passed,
                },
                indent=2,
            )
        )
    else:
        print(_report(result, args.threshold, passed))
    return 0 if passed else 1


@contextlib.contextmanager
def _stdout_to_stderr():
    """Point file descriptor 1 at stderr for the block (child processes inherit it)."""
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _report(r: ParityResult, threshold: float, passed: bool) -> str:
    mb = r.bytes_pushed / 2**20
    return "\n".join(
        [
            f"check-parity  tp={r.tensor} ep={r.expert} dtype={r.dtype} engine={r.placement}",
            f"  after push : mean |dlogp| {r.mean_abs_delta:.3e}  max {r.max_abs_delta:.3e}"
            f"  over {r.tokens} tokens",
            f"  before push: mean |dlogp| {r.before_mean_abs_delta:.3e}"
            f"  max {r.before_max_abs_delta:.3e}  (must differ: the check can fail)",
            f"  pushed {mb:.1f} MiB in {r.push_seconds:.3f} s ({mb / 1024 / r.push_seconds:.2f} GiB/s;"
            f" engine paused {r.load_seconds:.3f} s)",
            f"  plain copy of the same bytes: {r.copy_seconds:.4f} s"
            f"  -> push / copy = {r.push_to_copy_ratio:.1f}x",
            f"  {'PASS' if passed else 'FAIL'} (threshold {threshold:g})",
        ]
    )


def _launch_problem(args: argparse.Namespace) -> str | None:
    """Why the check cannot run as asked, in the options' terms (not a recipe key the user
    never set: ``--transport nccl`` on a CPU machine named ``rollout.gpu_ids``)."""
    if args.tp < 1 or args.ep < 1:
        return f"--tp and --ep must be >= 1, got {args.tp}, {args.ep}"
    if args.transport != "nccl":
        return None
    from megatron_rl.platform import local_device_count

    world = math.lcm(args.tp, args.ep)
    devices = local_device_count()
    if devices is not None and devices > world:
        return None
    return (
        f"--transport nccl pushes the weights GPU to GPU: it needs {world + 1} GPUs on this "
        f"node ({world} trainer rank(s) for --tp {args.tp} --ep {args.ep}, and the engine's), "
        f"and this machine has {devices or 'no'} GPU(s); check the host path with "
        "--transport host"
    )


def check_parity(options: ParityOptions) -> ParityResult:
    """Run the check (spawning ``lcm(tp, ep)`` ranks when more than one is needed)."""
    from megatron_rl.conversion.hf import check_hf_dir

    check_hf_dir(options.hf_dir)
    from megatron_rl.platform import run_local_ranks

    world = math.lcm(options.tensor, options.expert)
    return run_local_ranks(parity_rank, world, world, options)[0]


def parity_rank(world: int, options: ParityOptions) -> ParityResult | None:
    """One of the ``world`` trainer ranks of the check; rank 0 owns the engine and returns
    the result."""
    rank = int(os.environ.get("RANK", "0"))  # known before the process group exists
    from megatron_rl.platform import ParallelConfig, init_distributed
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.pool import GeneratorPool
    from megatron_rl.rollout.weights.push import push_megatron_weights

    nccl = options.transport == "nccl"
    placement = options.placement or ("in_process" if world == 1 and not nccl else "subprocess")
    config = RolloutConfig(
        weight_transport=options.transport,
        gpu_ids=[world] if nccl else None,  # the trainer ranks hold GPUs 0 .. world - 1
        placement=placement,
        samples_per_prompt=options.samples,
        max_tokens=options.max_tokens,
        dtype=options.dtype,
        max_num_seqs=16,
        seed=options.seed,
    )
    pool = None
    if rank == 0 and placement == "subprocess":  # the engine starts while we build the model
        pool = GeneratorPool(options.hf_dir, config, wait=False)
    parallel = ParallelConfig(tensor=options.tensor, expert=options.expert)
    init_distributed(parallel, seed=options.seed)
    model = megatron_from_hf(options.hf_dir, parallel, options.dtype)
    perturb_(model, options.seed, options.noise)
    if rank == 0 and pool is None:
        pool = GeneratorPool(options.hf_dir, config)
    prompts = _prompts(options, model.architecture.vocab_size)
    before = _compare(model, pool, prompts)
    bucket_bytes = None if options.bucket_mb is None else int(options.bucket_mb * 2**20)
    stats = push_megatron_weights(pool, model, bucket_bytes=bucket_bytes)
    after = _compare(model, pool, prompts)
    if pool is None:
        return None
    pool.close()
    return ParityResult(
        mean_abs_delta=after[0],
        max_abs_delta=after[1],
        tokens=after[2],
        before_mean_abs_delta=before[0],
        before_max_abs_delta=before[1],
        bytes_pushed=stats.bytes,
        push_seconds=stats.seconds,
        load_seconds=stats.load_seconds,
        copy_seconds=copy_seconds(stats.bytes),
        tensor=options.tensor,
        expert=options.expert,
        placement=placement,
        dtype=options.dtype,
    )


def megatron_from_hf(hf_dir: str, parallel=None, dtype: str = "float32"):
    """This rank's Megatron model in ``dtype`` (FP32 head) with the HF weights, in eval mode."""
    from megatron_rl.conversion.hf import load_hf_weights
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import DTYPES, build_model
    from megatron_rl.platform import ParallelConfig

    parallel = parallel or ParallelConfig()
    model = build_model(ModelConfig(hf_path=hf_dir, dtype=dtype, fp32_head=True), parallel)
    load_hf_weights(model, hf_dir, DTYPES[dtype])
    return model.eval()


def perturb_(model, seed: int, noise: float) -> None:
    """Add seeded Gaussian noise (``noise`` x each tensor's std, at least 0.02) in place.

    Replicated parameters get the same noise on every rank; shards get rank-specific noise.
    """
    import torch
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    with torch.no_grad():
        for i, (name, param) in enumerate(model.named_parameters()):
            key = seed * 1_000_003 + i * 1009
            if ".experts.local_experts." in name:  # sharded by expert TP, spread by EP
                key += 17 * etp_rank + 31 * ep_rank + 1
            elif getattr(param, "tensor_model_parallel", False):
                key += 17 * tp_rank + 1
            gen = torch.Generator().manual_seed(key)
            scale = noise * max(param.float().std().item() if param.numel() > 1 else 0.0, 0.02)
            noise_t = torch.randn(param.shape, generator=gen)
            param.add_(scale * noise_t.to(param.device, param.dtype))


def _prompts(options: ParityOptions, vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(options.seed)
    ids = torch.randint(3, vocab, (options.prompts, options.prompt_tokens), generator=gen)
    return ids.tolist()


def _compare(model, pool, prompts: list[list[int]]) -> tuple[float, float, int]:
    """Sample on rank 0, score the samples with Megatron on every rank: (mean, max, tokens)."""

    from megatron_rl.platform import collectives

    samples = collectives.broadcast_object(pool.generate(prompts) if pool is not None else None)
    deltas = logprob_deltas(model, samples)
    return deltas.mean().item(), deltas.max().item(), deltas.numel()


def logprob_deltas(model, samples, temperature: float = 1.0) -> torch.Tensor:
    """|Megatron log-prob - generator log-prob| of every response token of ``samples``
    (concatenated ``[sum T]``), Megatron's at ``temperature`` (the generator's are those of
    the distribution it sampled from). Call on every TP rank with the same samples."""
    import torch

    from megatron_rl.models.logprobs import token_logprobs

    device = next(model.parameters()).device  # CUDA on GPU: inputs go where the model is
    out = []
    for sample in samples:
        tokens = torch.tensor([sample.prompt_ids + sample.response_ids], device=device)
        with torch.no_grad():
            ours = token_logprobs(model, tokens, temperature)[0, len(sample.prompt_ids) - 1 :]
        theirs = torch.tensor(sample.logprobs, dtype=torch.float32, device=device)
        out.append((ours - theirs).abs().cpu())
    return torch.cat(out)


def copy_seconds(nbytes: int, repeats: int = 3) -> float:
    """Best time of a plain CPU tensor ``copy_`` of ``nbytes`` (the same memory traffic)."""
    import torch

    src = torch.ones(max(nbytes, 1), dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return best
