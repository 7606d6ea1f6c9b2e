"""Llama-4 chunked local attention: the old masked SDPA path vs block-diagonal causal SDPA.

Runs attention forward + backward (GQA, sbhd layout as megatron passes it) both ways and prints
peak memory and time for each:

- ``masked``: the reference (megatron_rl before the fix, kept here only): one SDPA call over
  the whole sequence with a boolean ``[s, s]`` chunk-causal mask. Flash attention rejects the
  mask and memory-efficient attention rejects GQA, so on GPU SDPA falls to its math kernel,
  which keeps O(s^2) fp32 scores for backward.
- ``block``: ``SDPACoreAttention`` as shipped: the chunks as a batch of causal sequences
  (``is_causal=True``), O(s x chunk).

Peak memory
- ``--device cpu`` (default): SDPA is forced to its math kernel (``--sdpa math``, what a GPU
  falls to; the CPU's default fused kernel hides the problem), and the peak is the high-water
  mark of the bytes of all live tensor storages created during forward + backward (inputs
  excluded), tracked op by op with a ``TorchDispatchMode`` (every aten op's outputs are
  counted until their storage is freed, including tensors autograd keeps for backward).
- ``--device cuda``: ``torch.cuda.max_memory_allocated`` above what was allocated before;
  SDPA chooses its kernel (``--sdpa default``) and the kernel it chose is reported.

Usage:
    python tools/bench_chunked_attention.py                      # CPU, 8 chunks of 256 tokens
    python tools/bench_chunked_attention.py --device cuda --scout  # 10q/2kv heads, d 128,
                                                                   # 8k and 16k tokens, chunk 8192
    [--tokens 2048 4096] [--chunk 256] [--q-heads 4] [--kv-heads 2] [--head-dim 64]
    [--batch 1] [--dtype float32|bfloat16] [--sdpa math|default] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

SCOUT = {"q_heads": 10, "kv_heads": 2, "head_dim": 128, "tokens": [8192, 16384], "chunk": 8192}
FUSED_SDPA_OPS = ("flash_attention", "efficient_attention", "cudnn_attention")


class PeakTensorBytes(TorchDispatchMode):
    """High-water mark of the bytes of live tensor storages created inside the mode.

    Every aten op's output storage is counted once (views share it) until it is freed; ops run
    by autograd's backward pass are seen too. Also records the fused SDPA kernels called.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.sdpa_ops: set[str] = set()
        self._sizes: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        fused = any(k in name for k in FUSED_SDPA_OPS) and "backward" not in name
        if "scaled_dot_product" in name and fused:
            self.sdpa_ops.add(name)
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key not in self._sizes:
                    self._sizes[key] = storage.nbytes()
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key)
        return out


def masked_chunked_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk: int
) -> torch.Tensor:
    """The reference: ``[s, b, h, d]`` q, ``[s, b, g, d]`` k/v -> ``[s, b, h*d]`` through one
    SDPA call with a boolean chunk-causal ``[s, s]`` mask (megatron_rl's code before the fix)."""
    s, b, heads, hn = query.shape
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    q_pos = torch.arange(s, device=query.device)[:, None]
    k_pos = torch.arange(s, device=query.device)[None, :]
    mask = (k_pos <= q_pos) & (q_pos // chunk == k_pos // chunk)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(hn), enable_gqa=k.shape[1] != heads
    )
    return out.permute(2, 0, 1, 3).reshape(s, b, heads * hn)


def block_diagonal_core(chunk: int, q_heads: int, kv_heads: int, head_dim: int):
    """megatron_rl's ``SDPACoreAttention`` with ``chunk_size=chunk``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl.models.attention import SDPACoreAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=q_heads * head_dim,
        num_attention_heads=q_heads,
        num_query_groups=kv_heads,
        kv_channels=head_dim,
        attention_dropout=0.0,
    )
    return SDPACoreAttention(config, layer_number=1, chunk_size=chunk)


@dataclass
class Result:
    method: str
    tokens: int
    chunk: int
    peak_mib: float
    seconds: float
    sdpa_kernel: str


def _inputs(tokens, batch, q_heads, kv_heads, head_dim, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = [(tokens, batch, q_heads, head_dim)] + [(tokens, batch, kv_heads, head_dim)] * 2
    return [
        torch.randn(shape, generator=gen, dtype=dtype, device=device).requires_grad_()
        for shape in shapes
    ]


def _step(fn: Callable, inputs: list[torch.Tensor]) -> None:
    out = fn(*inputs)
    out.backward(torch.ones_like(out))
    for t in inputs:
        t.grad = None


def _sdpa_context(sdpa: str):
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH) if sdpa == "math" else nullcontext()


def measure(
    method: str,
    *,
    tokens: int,
    chunk: int,
    q_heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    sdpa: str = "math",
    repeats: int = 3,
) -> Result:
    """Peak memory (MiB above the inputs) and median time of forward + backward."""
    if method == "masked":
        fn = lambda q, k, v: masked_chunked_attention(q, k, v, chunk)  # noqa: E731
    else:
        core = block_diagonal_core(chunk, q_heads, kv_heads, head_dim)
        fn = lambda q, k, v: core(q, k, v, None)  # noqa: E731
    inputs = _inputs(tokens, batch, q_heads, kv_heads, head_dim, dtype, device)
    with _sdpa_context(sdpa):
        tracker = PeakTensorBytes()
        with tracker:  # also tells which fused kernel SDPA picked
            _step(fn, inputs)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            _step(fn, inputs)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            peak = tracker.peak
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            _step(fn, inputs)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    kernel = ",".join(sorted(op.split(".")[0].removeprefix("aten::") for op in tracker.sdpa_ops))
    return Result(method, tokens, chunk, peak / 2**20, statistics.median(times), kernel or "math")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--scout", action="store_true", help="Scout per-rank shapes")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048])
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--q-heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--sdpa", choices=["math", "default"], default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.scout:
        args.q_heads, args.kv_heads, args.head_dim = (
            SCOUT["q_heads"],
            SCOUT["kv_heads"],
            SCOUT["head_dim"],
        )
        args.tokens, args.chunk = SCOUT["tokens"], SCOUT["chunk"]
    gpu = args.device == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    sdpa = args.sdpa or ("default" if gpu else "math")
    if not gpu:
        from megatron_rl.platform import get_platform

        get_platform()  # megatron's CPU stand-ins
    results = []
    for tokens in args.tokens:
        for method in ("masked", "block"):
            try:
                results.append(
                    measure(
                        method,
                        tokens=tokens,
                        chunk=args.chunk,
                        q_heads=args.q_heads,
                        kv_heads=args.kv_heads,
                        head_dim=args.head_dim,
                        batch=args.batch,
                        dtype=dtype,
                        device=args.device,
                        sdpa=sdpa,
                        repeats=args.repeats,
                    )
                )
            except torch.OutOfMemoryError as err:
                results.append(
                    Result(method, tokens, args.chunk, math.inf, math.inf, str(err)[:60])
                )
            if gpu:
                torch.cuda.empty_cache()
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
        return
    print(
        f"attention fwd+bwd on {args.device}, {dtype}, SDPA {sdpa}: b={args.batch} "
        f"q_heads={args.q_heads} kv_heads={args.kv_heads} head_dim={args.head_dim} "
        f"chunk={args.chunk}"
    )
    print(f"{'tokens':>7} {'method':>7} {'peak MiB':>10} {'ms':>9}  sdpa kernel")
    for r in results:
        print(
            f"{r.tokens:>7} {r.method:>7} {r.peak_mib:>10.1f} {r.seconds * 1e3:>9.1f}  {r.sdpa_kernel}"
        )
    for tokens in args.tokens:
        masked, block = (r for r in results if r.tokens == tokens)
        print(f"{tokens:>7} block/masked peak: {block.peak_mib / masked.peak_mib:.3f}")


if __name__ == "__main__":
    main()
