"""Memory of the GPUs a plan is checked against: one table, with sources (no torch import).

Capacities are what the driver reports as the GPU's memory (``nvidia-smi
--query-gpu=memory.total``, in MiB; ``torch.cuda.get_device_properties().total_memory`` is
the same number in bytes), counted in GiB (2**30 bytes) as torch and vLLM print memory. The
datasheets' "GB" are close to these in binary units (H200: "141 GB" is 140.4 GiB); read as
decimal gigabytes they understated every GPU by about 7%.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9
GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class GPU:
    """One accelerator model.

    Attributes:
        name: short name used on the command line.
        memory_bytes: memory per GPU as the driver reports it.
        source: where the number comes from.
        vllm_max_graph_size: vLLM's default largest CUDA-graph batch (vllm/config/vllm.py
            ``_set_cudagraph_sizes``: 1024 on data-centre Blackwell, 512 elsewhere).
        capability: CUDA compute capability (what decides its FP8 recipes:
            :func:`fp8_recipes`).
    """

    name: str
    memory_bytes: int
    source: str
    vllm_max_graph_size: int = 512
    capability: tuple[int, int] = (9, 0)

    @property
    def fp8_recipes(self) -> tuple[str, ...]:
        """The FP8 recipes (``model.fp8_recipe``) Transformer Engine runs on this GPU."""
        return fp8_recipes(self.capability)


GPUS: dict[str, GPU] = {
    # GB200 NVL72 datasheet: 13.4 TB HBM3e / 72 GPUs = 186 GB; nvidia-smi on a GB200 tray
    # reports 189471 MiB (185.0 GiB) per GPU.
    "gb200": GPU(
        "gb200",
        189471 * MiB,
        "nvidia-smi memory.total 189471 MiB (datasheet: 13.4 TB HBM3e / 72 GPUs)",
        vllm_max_graph_size=1024,
        capability=(10, 0),
    ),
    # H200 datasheet: 141 GB HBM3e; nvidia-smi reports 143771 MiB (140.4 GiB).
    "h200": GPU(
        "h200",
        143771 * MiB,
        "nvidia-smi memory.total 143771 MiB (datasheet: 141 GB)",
        capability=(9, 0),
    ),
    # H100 SXM5 datasheet: 80 GB HBM3; nvidia-smi reports 81559 MiB (79.6 GiB).
    "h100": GPU(
        "h100",
        81559 * MiB,
        "nvidia-smi memory.total 81559 MiB (datasheet: 80 GB)",
        capability=(9, 0),
    ),
    # A100 SXM4 80GB datasheet: 80 GB HBM2e; nvidia-smi reports 81920 MiB (80.0 GiB). Compute
    # capability 8.0: no FP8 (neither Transformer Engine's recipes nor FP8 rollouts).
    "a100": GPU(
        "a100",
        81920 * MiB,
        "nvidia-smi memory.total 81920 MiB (datasheet: 80 GB)",
        capability=(8, 0),
    ),
}

# Transformer Engine 2.9-2.11 (setup.py's pin), ``pytorch/quantization.py``
# ``check_recipe_support``, by compute capability: delayed and per-tensor current scaling
# (megatron's "delayed", "tensorwise") from 9.0 (and Ada 8.9 with CUDA >= 12.1); 1x128 /
# 128x128 block scaling ("blockwise", ``Float8BlockScaling``) from 9.0 with CUDA >= 12.9;
# MXFP8 ("mxfp8") on 10.x and 11.x, not 12.0+.
CUDA_FOR_BLOCKWISE = (12, 9)
CUDA_FOR_ADA_FP8 = (12, 1)


def _version(text: str | None) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in str(text).split(".")[:2])
    except ValueError:
        return None


def fp8_recipes(capability: tuple[int, int] | None, cuda: str | None = None) -> tuple[str, ...]:
    """The FP8 recipes Transformer Engine runs on a GPU of compute ``capability`` (None: no
    GPU) with CUDA ``cuda`` ("12.9"; None: not known, taken as recent enough), as TE's own
    checks decide (see above)."""
    if capability is None:
        return ()
    cc, version = tuple(capability), _version(cuda)
    recent = lambda minimum: version is None or version >= minimum  # noqa: E731
    recipes: list[str] = []
    if cc >= (9, 0) or (cc >= (8, 9) and recent(CUDA_FOR_ADA_FP8)):
        recipes += ["delayed", "tensorwise"]
    if cc >= (9, 0) and recent(CUDA_FOR_BLOCKWISE):
        recipes.append("blockwise")
    if (10, 0) <= cc < (12, 0):
        recipes.append("mxfp8")
    return tuple(recipes)


DEFAULT_GPU = "gb200"  # the production cluster of the recipes (GB200 NVL72, docs/cluster.md)

# What no formula here derives: the CUDA context and NCCL's ordinary communicator buffers.
# ASSUMPTION (not measured on a GB200): a CUDA context is ~0.5-1 GiB on Hopper and Blackwell;
# NCCL's channel buffers grow with the number of communicators and channels (NCCL issue 864:
# ~1.6 GB for one communicator after an all-reduce, ~6 GB with three or more).
# (The engines' reserve was 6 GB when it also stood for their CUDA graphs and NVLS buffers,
# counted apart now.)
TRAINER_RUNTIME_RESERVE = 4 * GiB
ENGINE_RUNTIME_RESERVE = 4 * GiB
# NVLink SHARP (NVLS) buffers, per communicator that uses NVLS. ASSUMPTION: 1 GiB, the order of
# magnitude behind NVIDIA's own advice to disable NVLS to save memory (NeMo-Framework-Launcher
# PR 127 "set NCCL_NVLS_ENABLE=0 for memory saving", JAX-Toolbox PR 383: communicator
# initialisation with NVLS "is memory intensive and can cause OOM"); NCCL documents no size.
NVLS_BYTES_PER_COMMUNICATOR = 1 * GiB
# NCCL's staging buffer of one connection: NCCL_BUFFSIZE, "the size of the buffer used by NCCL
# when communicating data between pairs of GPUs", default 4194304 (4 MiB) (NCCL user guide,
# "Environment Variables", NCCL_BUFFSIZE); NCCL keeps one per channel per peer connected.
# ASSUMPTION: 2 channels per peer for point-to-point traffic (NCCL_NCHANNELS_PER_NET_PEER's
# default; NVLink may use more) and the LL / LL128 protocol buffers within that estimate.
# Counted for the communicators a weight transport adds beyond the runtime reserve's few:
# ``nccl_m2n`` forms one per engine, and every trainer source rank joins each.
NCCL_BUFFSIZE = 4 * MiB
NCCL_CHANNELS_PER_PEER = 2
# vLLM CUDA graphs: the first capture's memory pool (the largest batch's forward, counted as
# the forward workspace at that batch) plus a per-capture cost for every further size and mode
# (vLLM measures both at start-up: gpu_model_runner.profile_cudagraph_memory, which floors the
# per-graph cost at 1 MiB). ASSUMPTION: 8 MiB per capture for a 48-layer model.
CUDA_GRAPH_BYTES_PER_CAPTURE = 8 * MiB
# Allocator fragmentation: blocks the caching allocator holds but cannot reuse, as a fraction of
# the memory that comes and goes (activations, forward workspace). ASSUMPTION: 10%, with
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the trainer's setting in the sbatch scripts;
# PyTorch's CUDA notes: expandable segments let the allocator grow one segment instead of
# fragmenting many).
FRAGMENTATION = 0.10


def get_gpu(name: str) -> GPU:
    """The GPU called ``name``; ValueError naming the known ones otherwise."""
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(sorted(GPUS))}")
    return GPUS[name]
