"""``rollout.weight_transport: nccl_m2n`` on CPU, up to the NCCL calls: the placements and
local blocks our Megatron shards publish (real TP=2 / EP=2 shards on two gloo ranks) against
the transformers model's own tensors, and vLLM's own layout checks, wire types, worker-side
planning and trainer engine on them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file
from support.fake_engines import FakeM2NLayouts
from vllm.distributed.weight_transfer.m2n_common import (
    REPLICATE,
    M2NMesh,
    M2NParamMeta,
    resolve_layout,
    validate_layout,
)
from vllm.distributed.weight_transfer.m2n_source import M2NWeightSource

from megatron_rl.platform import run_local_ranks
from megatron_rl.rollout.weights import m2n

LAYOUTS = {  # (model, tensor, expert): two ranks each
    "dense-tp2": ("tiny-llama", 2, 1),
    "dense-dp2": ("tiny-llama", 1, 1),
    "tied-tp2": ("tiny-llama-tied", 2, 1),
    "llama4-tp2": ("tiny-llama4", 2, 1),
    "llama4-ep2": ("tiny-llama4", 1, 2),
}


def _meta_tuple(meta: M2NParamMeta) -> tuple:
    return (meta.name, str(meta.dtype), tuple(meta.shape), meta.placements)


def m2n_layouts_rank(hf_dirs: dict) -> dict:
    """On each rank, for each layout: its source layout, the metadata it publishes and its
    local blocks (as iterated), plus a block read again after a parameter changed."""
    import transformers

    from megatron_rl.conversion.hf import load_hf_weights
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig, init_distributed

    results = {}
    for key, (name, tensor, expert) in LAYOUTS.items():
        parallel = ParallelConfig(tensor=tensor, expert=expert)
        init_distributed(parallel)
        model = build_model(ModelConfig(hf_path=hf_dirs[name], dtype="float32"), parallel)
        load_hf_weights(model, hf_dirs[name], torch.float32)
        layout = m2n.megatron_source_layout()
        if layout is None:
            results[key] = None
            continue
        arch = transformers.AutoConfig.from_pretrained(hf_dirs[name]).architectures[0]
        source = m2n.MegatronM2NSource(model, layout, arch)
        blocks = {n: t.detach().clone() for n, t in source}
        with torch.no_grad():
            model.embedding.word_embeddings.weight.add_(1.0)
        again = dict(source)["model.embed_tokens.weight"].detach().clone()
        results[key] = {
            "layout": dataclasses.asdict(layout),
            "mesh": source.mesh().dims,
            "metas": [_meta_tuple(m) for m in source.metadata()],
            "order": [n for n, _ in source],
            "blocks": blocks,
            "embed_after_update": again,
        }
    return results


@pytest.fixture(scope="module")
def published(tiny_hf_dirs):
    return run_local_ranks(m2n_layouts_rank, 2, dict(tiny_hf_dirs))


def _expected_block(full: torch.Tensor, placements, size: int, rank: int) -> torch.Tensor:
    """The block of ``full`` a rank holds under ``placements`` over an ``(size, 1)`` mesh
    (m2n / DTensor semantics: Shard(d) on axis 0 = ``size`` equal pieces of dim d in rank
    order; axis 1 has one rank)."""
    if placements is None:
        return full
    dim, other = placements
    assert other == REPLICATE
    return full.chunk(size, dim)[rank]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("key", list(LAYOUTS))
def test_published_blocks_reassemble_the_hf_tensors(published, tiny_hf_dirs, key):
    """Every source rank's block of every HF tensor is exactly the slice its placement names
    of the transformers model's tensor (float64), names and shapes as in the HF file, the
    same metadata on every source rank, iteration in metadata order, blocks read live.
    (dense-dp2: one source rank holding two query groups, which its q/k/v split must keep
    apart; the TP=2 layouts hold one group per rank.)"""
    name, tensor, expert = LAYOUTS[key]
    ref = {n: t.double() for n, t in load_file(f"{tiny_hf_dirs[name]}/model.safetensors").items()}
    ranks = [published[r][key] for r in range(2) if published[r][key] is not None]
    size = len(ranks)
    assert all(r["metas"] == ranks[0]["metas"] for r in ranks)
    assert [r["layout"]["rank"] for r in ranks] == list(range(size))
    assert ranks[0]["mesh"] == (size, 1)
    metas = ranks[0]["metas"]
    assert sorted(m[0] for m in metas) == sorted(ref)  # every HF tensor, once
    assert ranks[0]["order"] == [m[0] for m in metas]
    sharded = 0
    for meta_name, dtype, shape, placements in metas:
        assert shape == tuple(ref[meta_name].shape), meta_name
        assert dtype == "torch.float32"
        for rank in range(size):
            block = ranks[rank]["blocks"][meta_name].double()
            expected = _expected_block(ref[meta_name], placements, size, rank)
            assert torch.equal(block, expected), (meta_name, rank, placements)
        sharded += placements is not None
    by_name = {m[0]: m[3] for m in metas}
    if tensor == 2:  # TP: column-parallel rows, row-parallel columns, vocab rows
        for proj, dim in (("q_proj", 0), ("k_proj", 0), ("v_proj", 0), ("o_proj", 1)):
            assert by_name[f"model.layers.0.self_attn.{proj}.weight"] == (dim, REPLICATE)
        assert by_name["model.embed_tokens.weight"] == (0, REPLICATE)
    if expert == 2:  # EP: whole experts; the dense tensors are replicated
        assert by_name["model.layers.1.feed_forward.experts.gate_up_proj"] == (0, REPLICATE)
        assert by_name["model.layers.1.self_attn.q_proj.weight"] is None
    elif name == "tiny-llama4":  # TP only: the experts are replicated (expert TP is 1)
        assert by_name["model.layers.1.feed_forward.experts.down_proj"] is None
    assert sharded > 0 or size == 1
    embed = by_name["model.embed_tokens.weight"]
    updated = (ref["model.embed_tokens.weight"].float() + 1.0).double()  # the fp32 add
    for rank in range(size):  # read at iteration time, not captured at construction
        expected = _expected_block(updated, embed, size, rank)
        assert torch.equal(ranks[rank]["embed_after_update"].double(), expected)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_data_parallel_replicas_are_not_source_ranks(published):
    """TP=EP=1 on two ranks: the first is the whole source mesh (everything replicated), the
    replica takes no part."""
    first, replica = published[0]["dense-dp2"], published[1]["dense-dp2"]
    assert replica is None
    assert first["mesh"] == (1, 1) and all(m[3] is None for m in first["metas"])


class _Source(M2NWeightSource):
    """Published metadata, as a source for vLLM's trainer-side code."""

    def __init__(self, dims: tuple[int, int], metas: list[tuple]) -> None:
        self._mesh = M2NMesh(dims, 0)
        self._metas = [
            M2NParamMeta(n, getattr(torch, d.removeprefix("torch.")), s, p) for n, d, s, p in metas
        ]

    def mesh(self) -> M2NMesh:
        return self._mesh

    def metadata(self) -> list[M2NParamMeta]:
        return list(self._metas)

    def __iter__(self):
        raise AssertionError("nothing is sent in these tests")


def _source(published, key: str) -> _Source:
    return _Source(published[0][key]["mesh"], published[0][key]["metas"])


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("key", ["dense-tp2", "llama4-ep2"])
def test_vllm_checks_and_wire_types_accept_the_published_plan(published, key):
    """vLLM's own source checks and plan limits pass; our init infos are vLLM's dataclasses
    and the worker payload equals the one vLLM's trainer engine builds for the same source."""
    from vllm.distributed.weight_transfer.m2n_engine import M2NWeightTransferInitInfo
    from vllm.distributed.weight_transfer.m2n_trainer import M2NTrainerWeightTransferEngine

    source = _source(published, key)
    for meta in source.metadata():
        m2n.check_source_entry(source.mesh(), meta)
    layout = m2n.SourceLayout(**published[0][key]["layout"])
    info = m2n.trainer_init_info(layout, "127.0.0.1", 29555, engine_tensor_parallel=2)
    assert (info.world_size, info.num_trainer_ranks, info.destination_mesh_dims) == (4, 2, (1, 2))
    m2n.check_plan(source, M2NMesh(info.destination_mesh_dims, info.num_trainer_ranks))
    ours = m2n.worker_payload(m2n.worker_init_info(source, info))
    vllm_engine = M2NTrainerWeightTransferEngine(
        client=None, source=source, is_controller=True, num_trainer_ranks=2
    )
    vllm_engine._src_mesh, vllm_engine._metas = source.mesh(), source.metadata()
    theirs = vllm_engine._worker_init_info(info)  # what vLLM's own trainer sends the engines
    assert ours == theirs
    M2NWeightTransferInitInfo(**ours)  # the engines' parse
    names = [m.name for m in source.metadata()]
    assert m2n.update_payload(names) == {"names": names}


def test_layouts_m2n_cannot_describe_are_refused_naming_the_parallel_key():
    with pytest.raises(ValueError, match="parallel.pipeline"):
        m2n.source_layout(0, tensor=2, expert=1, pipeline=2)
    with pytest.raises(ValueError, match="parallel.expert_tensor"):
        m2n.source_layout(0, tensor=1, expert=2, expert_tensor=2)
    with pytest.raises(ValueError, match="got parallel.tensor 2"):  # TP 2 over a mesh of EP 4
        m2n.source_layout(0, tensor=2, expert=4)
    assert m2n.source_layout(3, tensor=2, expert=2) is None  # a data-parallel replica
    assert m2n.source_layout(1, tensor=4, expert=4) == m2n.SourceLayout(1, 4, 4, 4)


def test_an_unmapped_megatron_parameter_is_refused_by_name(tiny_hf_dirs, megatron_single_rank):
    """A parameter the map does not know (here a bias on o_proj) must not be left out
    silently: the engines would keep stale weights."""
    from megatron_rl.conversion.hf import load_hf_weights
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig

    hf_dir = tiny_hf_dirs["tiny-llama"]
    model = build_model(ModelConfig(hf_path=hf_dir, dtype="float32"), ParallelConfig())
    load_hf_weights(model, hf_dir, torch.float32)
    layout = m2n.SourceLayout(0, 1, 1, 1)
    source = m2n.MegatronM2NSource(model, layout, "LlamaForCausalLM", dtype=torch.bfloat16)
    dtypes = {m.name: m.dtype for m in source.metadata()}
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == torch.bfloat16
    assert dtypes["lm_head.weight"] == torch.float32  # the head keeps its dtype
    assert dict(source)["model.norm.weight"].dtype == torch.bfloat16
    proj = model.decoder.layers[0].self_attention.linear_proj
    proj.bias = torch.nn.Parameter(torch.zeros(proj.weight.shape[0]))
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.self_attention\.linear_proj\.bias"):
        m2n.MegatronM2NSource(model, layout, "LlamaForCausalLM")


def test_transformer_engines_empty_bias_is_not_a_weight(tiny_hf_dirs, megatron_single_rank):
    """Transformer Engine's linears without a bias keep ``bias = torch.Tensor()`` (a plain
    attribute, zero elements), not None: that is no weight, and must not become zero-size
    ``q/k/v_proj.bias`` entries of the plan (vLLM's model has no such tensors, and a push
    naming them sends the engines into their layerwise reload every time)."""
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig

    hf_dir = tiny_hf_dirs["tiny-llama"]
    model = build_model(ModelConfig(hf_path=hf_dir, dtype="float32"), ParallelConfig())
    layout = m2n.SourceLayout(0, 1, 1, 1)
    before = [m.name for m in m2n.MegatronM2NSource(model, layout, "LlamaForCausalLM").metadata()]
    for layer in model.decoder.layers:
        qkv = layer.self_attention.linear_qkv
        qkv._parameters.pop("bias", None)  # the local spec registers bias=None
        qkv.bias = torch.Tensor()  # as TE's Linear / LayerNormLinear with bias=False
    source = m2n.MegatronM2NSource(model, layout, "LlamaForCausalLM")
    names = [m.name for m in source.metadata()]
    assert not [n for n in names if n.endswith(".bias")]
    assert names == before
    assert all(t.numel() > 0 for _, t in source)


class _Client:
    """A ``VLLMWeightSyncClient`` that records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.payloads: list[dict] = []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init_weight_transfer_engine")
        self.payloads.append(init_info)

    def start_weight_update(self):
        self.calls.append("start_weight_update")

    def update_weights(self, update_info):
        self.calls.append("update_weights")
        self.payloads.append(update_info)

    def finish_weight_update(self, weight_version=None):
        self.calls.append("finish_weight_update")


def _no_runtime() -> None:
    try:
        import nccl.m2n  # noqa: F401
    except ImportError:
        return
    pytest.skip("nccl.m2n is installed here")


def test_the_trainer_engine_refuses_without_nccl_m2n_before_calling_the_engines():
    """vLLM's trainer engine raises its ImportError before any rendezvous or engine call; our
    entry point says which recipe key asked for it."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    _no_runtime()
    layout = m2n.SourceLayout(0, 1, 1, 1)
    source = _Source((1, 1), [("model.norm.weight", "torch.float32", (8,), None)])
    info = m2n.trainer_init_info(layout, "127.0.0.1", 29555, engine_tensor_parallel=1)
    client = _Client()
    with pytest.raises(ImportError, match="nccl"):
        WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    with pytest.raises(ValueError, match="rollout.weight_transport 'nccl_m2n'.*nccl.m2n"):
        m2n.start_trainer_engine(source, info, client)
    assert client.calls == []


def test_the_transport_is_selectable_and_refuses_cleanly(monkeypatch):
    """``nccl_m2n`` is a recipe choice that ``auto`` never makes, with the NCCL transport's
    placement rules. The pool refuses it before it starts any engine: on CPU, then without the
    runtime, then outside a trainer that set up its source ranks; each error names the key.
    Its ``open`` too."""
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.platform import Platform, device
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.pool import GeneratorPool
    from megatron_rl.rollout.weights.senders import TRANSPORTS, transport_for

    config = RolloutConfig(placement="subprocess", weight_transport="nccl_m2n")
    config.validate()
    transport = transport_for(config.resolved())
    assert transport is TRANSPORTS["nccl_m2n"] and not transport.joins_at_build
    assert transport.backend(config) == "nccl_m2n"  # vLLM's registered engine
    for keys, key in (
        ({}, "placement"),
        ({"placement": "subprocess", "colocate": True}, "colocate"),
    ):
        with pytest.raises(ConfigError, match=key):
            RolloutConfig(weight_transport="nccl_m2n", **keys).validate()
    for platform in (Platform("cuda", "nccl", False), Platform("cpu", "gloo", False)):
        monkeypatch.setattr(device, "get_platform", lambda p=platform: p)
        assert RolloutConfig(placement="subprocess").resolved().weight_transport != "nccl_m2n"

    class NoLaunch:  # the pool must refuse before it starts (or even reads) anything
        def __getattr__(self, name):
            raise AssertionError(f"launcher.{name} used")

    def refused(match: str) -> None:
        with pytest.raises(ValueError, match=f"rollout.weight_transport 'nccl_m2n'{match}"):
            GeneratorPool("/nonexistent", config, launcher=NoLaunch())
        with pytest.raises(ValueError, match=f"rollout.weight_transport 'nccl_m2n'{match}"):
            transport.open(config, None, [], None)

    monkeypatch.setattr(device, "get_platform", lambda: Platform("cpu", "gloo", False))
    refused(" needs GPUs")
    monkeypatch.setattr(device, "get_platform", lambda: Platform("cuda", "nccl", False))
    try:
        import nccl.m2n  # noqa: F401
    except ImportError:
        refused(" needs the nccl.m2n runtime")
        monkeypatch.setattr(m2n, "import_m2n", lambda: object())  # as if installed
    refused(": this pool has no trainer source ranks")  # the trainer's m2n_ranks.serving


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllms_worker_plans_the_published_tp2_source_on_its_model_up_to_nccl(
    published, tiny_hf_dirs, monkeypatch
):
    """A vLLM CPU engine built with the transport's backend (vLLM's own ``nccl_m2n`` engine)
    takes our TP=2 plan through our ``init_transport``: it parses the payload, re-checks every
    source layout, resolves a destination for every name against its live model
    (``resolve_parameter_destinations``), validates them and the plan limits, and gets as far
    as joining the communicator (stood in: that and the runtime import are the NCCL part)."""
    from vllm.distributed.weight_transfer import m2n_engine

    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.engine.vllm_engine import VLLMEngine

    source = _source(published, "dense-tp2")
    layout = m2n.SourceLayout(**published[0]["dense-tp2"]["layout"])
    info = m2n.trainer_init_info(layout, "127.0.0.1", 29555, engine_tensor_parallel=1)
    payload = m2n.worker_payload(m2n.worker_init_info(source, info))

    class ReachedNccl(Exception):
        pass

    joined = []

    def join(init_info, parallel_config):
        joined.append((init_info.rank_offset, init_info.world_size))
        raise ReachedNccl

    monkeypatch.setattr(m2n_engine, "import_m2n", lambda: object())
    monkeypatch.setattr(m2n_engine, "worker_init_process_group", join)
    # weight_transport is all the engine reads; validate() would refuse in_process for it
    config = RolloutConfig(weight_transport="nccl_m2n", dtype="float32", max_num_seqs=4)
    engine = VLLMEngine(tiny_hf_dirs["tiny-llama"], config)
    try:
        with pytest.raises(Exception) as raised:
            engine.init_transport(payload)
        assert any(isinstance(e, ReachedNccl) for e in _chain(raised.value)), raised.value
        assert joined == [(2, 3)]

        def plan(worker):
            wte = worker.weight_transfer_engine
            params = dict(wte.model.named_parameters())
            return (
                type(wte).__name__,
                [(d.name, d.placements, d.direct) for d in wte._parameter_destinations],
                {n: tuple(p.shape) for n, p in params.items()},
            )

        [(engine_type, destinations, vllm_params)] = engine.engine.collective_rpc(plan)
    finally:
        engine.close()
    assert engine_type == "M2NWeightTransferEngine"
    names = [m.name for m in source.metadata()]
    assert [d[0] for d in destinations] == names  # one destination per name, in order
    shapes = {m.name: m.shape for m in source.metadata()}
    for name, placements, direct in destinations:
        validate_layout(*resolve_layout(M2NMesh((1, 1), 2), placements), shapes[name], "dest")
        if direct:  # straight into a live parameter: the same name and whole shape (TP 1)
            assert vllm_params[name] == shapes[name]
    # vLLM fuses q/k/v and gate/up: those names go through its load_weights (full tensors)
    fused = [n for n in names if n.split(".")[-2] in ("q_proj", "k_proj", "gate_proj")]
    assert fused and all(not d[2] for d in destinations if d[0] in fused)


def _chain(err: BaseException):
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


def trainer_engine_rank(hf_dir: str) -> dict:
    """vLLM's own trainer engine (``start_trainer_engine``: the factory's ``trainer_init``,
    then ``send_weights``) on each TP=2 rank with our real source, up to the NCCL calls: the
    rendezvous, the destination-plan broadcast, the raw communicator and ``nccl.m2n`` itself
    are stand-ins that record what vLLM hands them (and two CUDA-only calls are no-ops)."""
    from vllm.distributed.weight_transfer import m2n_trainer
    from vllm.distributed.weight_transfer.m2n_common import REPLICATED

    from megatron_rl.conversion.hf import load_hf_weights
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig, init_distributed

    parallel = ParallelConfig(tensor=2)
    init_distributed(parallel)
    model = build_model(ModelConfig(hf_path=hf_dir, dtype="float32"), parallel)
    load_hf_weights(model, hf_dir, torch.float32)
    layout = m2n.megatron_source_layout()
    source = m2n.MegatronM2NSource(model, layout, "LlamaForCausalLM")
    reshards, events = [], []

    class Runtime(FakeM2NLayouts):  # nccl.m2n
        Config = staticmethod(lambda max_cta=None: ("config", max_cta))

        class Handle:
            @staticmethod
            def create(config):
                events.append("handle")
                return Runtime.Handle()

            def destroy(self):
                events.append("handle destroyed")

        @staticmethod
        def reshard(src, dst, comm, stream, **layout):
            assert dst is None and comm == 1234  # the trainer only sends
            reshards.append((src.clone(), {k: v for k, v in layout.items() if k != "handle"}))

    class Comm:
        def destroy(self):
            events.append("group destroyed")

    def join(info, rank):
        events.append(("join", info["world_size"], rank))
        return Comm()

    def plan(comm, first_worker_rank, placements, count):
        events.append(("plan from", first_worker_rank))
        return [REPLICATED] * count  # what every worker plans on CPU (the fallback)

    m2n_trainer.import_m2n = m2n.import_m2n = lambda: Runtime
    m2n_trainer.trainer_init = join
    m2n_trainer.publish_destination_placements = plan
    m2n_trainer.comm_ptr = lambda comm: 1234
    torch.Tensor.record_stream = lambda self, stream: None  # CUDA-only
    torch.accelerator.synchronize = lambda *a: None  # CUDA-only
    client = _Client()
    info = m2n.trainer_init_info(layout, "127.0.0.1", 29555, engine_tensor_parallel=2)
    engine = m2n.start_trainer_engine(source, info, client)
    engine.send_weights()
    engine.shutdown()
    return {
        "calls": client.calls,
        "payloads": client.payloads,
        "expected_init": m2n.worker_payload(m2n.worker_init_info(source, info)),
        "metas": [_meta_tuple(m) for m in source.metadata()],
        "reshards": reshards,
        "events": events,
    }


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vllms_trainer_engine_sends_each_ranks_own_blocks(tiny_hf_dirs):
    """Through vLLM's trainer engine, each TP rank joins as its own rank, only rank 0 calls
    the engines (init, start, one update naming every tensor in order, finish), and every
    rank hands ``nccl.m2n`` one reshard per tensor, in metadata order, with its own block
    (the placement's slice of the transformers tensor) and vLLM's meshes for our plan."""
    hf_dir = tiny_hf_dirs["tiny-llama"]
    ref = {n: t.double() for n, t in load_file(f"{hf_dir}/model.safetensors").items()}
    ranks = run_local_ranks(trainer_engine_rank, 2, hf_dir)
    metas = ranks[0]["metas"]
    names = [m[0] for m in metas]
    assert ranks[0]["calls"] == [
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    ]
    assert ranks[0]["payloads"] == [ranks[0]["expected_init"], {"names": names}]
    assert ranks[1]["calls"] == []
    whole = {"src_mesh": ("mesh", (2, 1), 0), "src_placements": ["R", ("S", 0)]}
    dst = {"dst_mesh": ("mesh", (2, 1), 2), "dst_placements": ["R", ("S", 0)]}
    for rank, result in enumerate(ranks):
        assert result["events"][:2] == [("join", 4, rank), ("plan from", 2)]
        assert result["events"][-2:] == ["handle destroyed", "group destroyed"]
        assert len(result["reshards"]) == len(metas)
        for (name, _, _, placements), (block, layout) in zip(metas, result["reshards"]):
            expected = _expected_block(ref[name], placements, 2, rank)
            assert torch.equal(block.double(), expected), (name, rank)
            src = (
                whole
                if placements is None
                else {
                    "src_mesh": ("mesh", (2, 1), 0),
                    "src_placements": [("S", placements[0]), "R"],
                }
            )
            assert layout == {**src, **dst}, name


@pytest.mark.parametrize("on_gpu", [False, True])
def test_send_blocks_hands_m2n_the_platforms_stream(monkeypatch, on_gpu):
    """``send_blocks`` reshards each block, in order, over the engine's communicator with the
    platform's current stream: on GPU the CUDA stream, which keeps every block alive
    (``record_stream``) and is synchronised before returning; on CPU none."""
    from vllm.distributed.weight_transfer.m2n_common import REPLICATED

    from megatron_rl.platform import device

    events = []

    class Stream:
        def synchronize(self):
            events.append("synchronize")

    stream = Stream()
    platform = device.Platform("cuda" if on_gpu else "cpu", "nccl" if on_gpu else "gloo", False)
    monkeypatch.setattr(device, "get_platform", lambda: platform)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(
        torch.Tensor, "record_stream", lambda self, s: events.append(("record", s is stream))
    )
    monkeypatch.setattr(m2n, "comm_ptr", lambda group: 77)

    class Runtime(FakeM2NLayouts):
        @staticmethod
        def reshard(src, dst, comm, given, **layout):
            assert dst is None and comm == 77 and layout["handle"] == "handle"
            events.append(("reshard", src.tolist(), given is stream if on_gpu else given))

    mesh = M2NMesh((1, 1), 0)
    engine = type("Engine", (), {})()
    engine._m2n, engine.group, engine._handle = Runtime, "group", "handle"
    engine._src_mesh = engine._dst_mesh = mesh
    engine._metas = [M2NParamMeta(n, torch.float32, (2,), None) for n in ("a", "b")]
    engine._dst_placements = [REPLICATED, REPLICATED]
    m2n.send_blocks(engine, [("b", torch.tensor([3.0, 4.0])), ("a", torch.tensor([1.0, 2.0]))])
    if on_gpu:
        assert events == [
            ("reshard", [3.0, 4.0], True),
            ("record", True),
            ("reshard", [1.0, 2.0], True),
            ("record", True),
            "synchronize",
        ]
    else:
        assert events == [("reshard", [3.0, 4.0], None), ("reshard", [1.0, 2.0], None)]


def test_the_recipe_check_and_the_weight_stream_agree_on_the_layouts_m2n_takes():
    """``config.checks.m2n_layout_problem`` refuses a recipe at load exactly where the
    weight stream's ``source_layout`` would refuse it after the model is built."""
    import itertools

    from megatron_rl.config.checks import m2n_layout_problem

    for tensor, expert, pipeline, expert_tensor in itertools.product(
        (1, 2, 4), (1, 2, 4, 8), (1, 2), (1, 2)
    ):
        try:
            m2n.source_layout(0, tensor, expert, pipeline, expert_tensor)
            late = True
        except ValueError:
            late = False
        early = m2n_layout_problem(tensor, expert, pipeline, expert_tensor) is None
        assert early == late, (tensor, expert, pipeline, expert_tensor)
