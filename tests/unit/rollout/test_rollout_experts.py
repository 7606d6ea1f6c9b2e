"""Expert-parallel engines: each engine rank's experts (vLLM's placement) and its part of a
push, loaded through vLLM's real MoE weight loaders (no engine: vLLM's ``RoutedExperts``
layers built as vLLM builds them for an EP rank, and Llama-4's own expert loading code)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.rollout.weights.buckets import HostSender
from megatron_rl.rollout.weights.experts import (
    ExpertPlacement,
    held_experts,
    own_part,
    rank_bucket,
    split_bucket,
)

HIDDEN, FFN = 64, 64  # vLLM's CPU MoE kernel wants multiples of its GEMM tiles
PACKS = (
    "model.layers.1.feed_forward.experts.gate_up_proj",
    "model.layers.1.feed_forward.experts.down_proj",
)


def _bucket(experts: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """A Llama-4 MoE layer as the weight stream names it (HF packs of all experts)."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.layers.1.self_attn.o_proj.weight", torch.randn(HIDDEN, HIDDEN, generator=g)),
        ("model.layers.1.feed_forward.router.weight", torch.randn(experts, HIDDEN, generator=g)),
        (
            "model.layers.1.feed_forward.shared_expert.down_proj.weight",
            torch.randn(HIDDEN, FFN, generator=g),
        ),
        (PACKS[0], torch.randn(experts, HIDDEN, 2 * FFN, generator=g)),
        (PACKS[1], torch.randn(experts, FFN, HIDDEN, generator=g)),
    ]


@pytest.mark.parametrize(
    "experts,ep,expected",
    [
        (16, 2, [range(0, 8), range(8, 16)]),
        (16, 4, [range(0, 4), range(4, 8), range(8, 12), range(12, 16)]),
        (8, 4, [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]),
        # 6 over 4: the first `remainder` ranks get one more (vLLM's linear rule)
        (6, 4, [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]),
    ],
)
def test_placement_is_vllms_linear_expert_map(experts, ep, expected):
    placement = ExpertPlacement.from_vllm(experts, ep)
    assert placement.ranks == tuple(tuple(r) for r in expected)
    assert [placement.owner(e) for e in expected[-1]] == [ep - 1] * len(expected[-1])


@pytest.mark.parametrize("experts,ep", [(8, 2), (8, 4), (16, 2), (16, 4)])
def test_each_rank_receives_exactly_its_experts_bytes(experts, ep):
    bucket = _bucket(experts)
    dense = {n: t for n, t in bucket if n not in PACKS}
    placement = ExpertPlacement.from_vllm(experts, ep)
    per_expert = 3 * HIDDEN * FFN * 4  # gate, up, down in fp32
    seen: list[int] = []
    for rank, part in enumerate(split_bucket(bucket, placement)):
        names = [n for n, _ in part]
        assert all(n in names for n in dense)  # every dense tensor, to every rank
        held = sorted(
            {int(n.split(".experts.")[1].split(".")[0]) for n in names if ".experts." in n}
        )
        assert held == sorted(placement.ranks[rank])
        seen += held
        expert_bytes = sum(t.numel() * t.element_size() for n, t in part if n not in dense)
        assert expert_bytes == len(held) * per_expert
    assert sorted(seen) == list(range(experts))  # each expert to exactly one rank


def test_per_expert_names_go_to_the_owning_rank_only():
    """Qwen3-MoE streams one tensor per expert: routed, never unpacked."""
    placement = ExpertPlacement.from_vllm(4, 2)
    w = torch.zeros(2, 2)
    bucket = [(f"model.layers.0.mlp.experts.{e}.down_proj.weight", w) for e in range(4)]
    bucket += [("model.layers.0.mlp.shared_expert.down_proj.weight", w)]
    names = sorted(n for n, _ in rank_bucket(bucket, placement, 1))
    assert names == [
        "model.layers.0.mlp.experts.2.down_proj.weight",
        "model.layers.0.mlp.experts.3.down_proj.weight",
        "model.layers.0.mlp.shared_expert.down_proj.weight",
    ]


def _vllm_moe_layer(experts: int, ep: int, rank: int) -> torch.nn.Module:
    """vLLM's RoutedExperts for EP rank ``rank`` of ``ep``, inside a module tree shaped like
    vLLM's Llama4Model (``layers.1.feed_forward.experts``), with the parallel config that
    ``FusedMoEParallelConfig.make`` gives a TP x EP engine (tp 1 for the experts)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    parallel = FusedMoEParallelConfig(
        tp_size=1,
        pcp_size=1,
        dp_size=1,
        ep_size=ep,
        tp_rank=0,
        pcp_rank=0,
        dp_rank=0,
        ep_rank=rank,
        sp_size=1,
        use_ep=ep > 1,
        all2all_backend="allgather_reducescatter",
        enable_eplb=False,
    )
    manager = ExpertMapManager(
        max_num_batched_tokens=16,
        top_k=1,
        global_num_experts=experts,
        num_redundant_experts=0,
        num_expert_group=None,
        moe_parallel_config=parallel,
        placement_strategy="linear",
        enable_eplb=False,
    )
    config = FusedMoEConfig(
        num_experts=experts,
        experts_per_token=1,
        hidden_dim=HIDDEN,
        intermediate_size=FFN,
        num_local_experts=manager.local_num_experts,
        num_logical_experts=experts,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=RoutingMethodType.Llama4,
        moe_parallel_config=parallel,
        in_dtype=torch.float32,
    )
    with set_current_vllm_config(VllmConfig()):
        layer = RoutedExperts(
            "layers.1.feed_forward.experts.routed_experts", torch.float32, config, None, manager
        )
    for p in layer.parameters():
        p.data.fill_(float("nan"))  # whatever is not loaded shows
    root, block = torch.nn.Module(), torch.nn.Module()
    block.feed_forward = torch.nn.Module()
    block.feed_forward.experts = _FusedMoE(layer)
    root.layers = torch.nn.ModuleList([torch.nn.Module(), block])
    return root


class _FusedMoE(torch.nn.Module):
    """Where vLLM's Llama-4 keeps its RoutedExperts (``experts.routed_experts``)."""

    def __init__(self, routed_experts: torch.nn.Module) -> None:
        super().__init__()
        self.routed_experts = routed_experts

    @property
    def expert_map(self) -> torch.Tensor | None:
        return self.routed_experts.expert_map


def _load_llama4_experts(model: torch.nn.Module, bucket, experts: int) -> None:
    """Llama-4's own expert loading (``Llama4Model.load_moe_expert_weights``: packed or per
    expert, as its ``load_weights`` decides) on names as vLLM's model sees them."""
    from vllm.model_executor.layers.fused_moe.layer import fused_moe_make_expert_params_mapping
    from vllm.model_executor.models.llama4 import Llama4Model

    params, loaded = dict(model.named_parameters()), set()
    for name, tensor in bucket:
        name = name.removeprefix("model.")
        if ".experts." not in name:
            continue
        fused = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        mapping = fused_moe_make_expert_params_mapping(
            model,
            ckpt_gate_proj_name="gate_up_proj" if fused else "gate_proj",
            ckpt_down_proj_name="down_proj",
            ckpt_up_proj_name="gate_up_proj" if fused else "up_proj",
            num_experts=1 if fused else experts,
        )
        assert Llama4Model.load_moe_expert_weights(
            model, name, tensor, params, loaded, mapping, fused=fused
        )


@pytest.mark.parametrize("experts,ep", [(8, 2), (16, 4)])
def test_rank_parts_load_like_a_full_load_in_vllm(experts, ep):
    """Each rank loads only its part; its expert weights equal a full load's (one rank,
    vLLM's packed path, from the untouched packs) and equal the hand-unpacked HF packs."""
    bucket = _bucket(experts, seed=1)
    full = _vllm_moe_layer(experts, 1, 0)
    _load_llama4_experts(full, bucket, experts)
    w13 = full.layers[1].feed_forward.experts.routed_experts.w13_weight.data
    w2 = full.layers[1].feed_forward.experts.routed_experts.w2_weight.data
    gate_up, down = bucket[3][1], bucket[4][1]
    assert torch.equal(w13[3, :FFN], gate_up[3, :, :FFN].t())  # vLLM: [gate; up] per expert
    assert torch.equal(w2[3], down[3].t())
    placement = ExpertPlacement.from_vllm(experts, ep)
    for rank in range(ep):
        model = _vllm_moe_layer(experts, ep, rank)
        _load_llama4_experts(model, rank_bucket(bucket, placement, rank), experts)
        layer = model.layers[1].feed_forward.experts.routed_experts
        held = list(placement.ranks[rank])
        assert layer.w13_weight.shape[0] == len(held)
        assert torch.equal(layer.w13_weight.data, w13[held])
        assert torch.equal(layer.w2_weight.data, w2[held])


def test_engine_rank_takes_its_own_part_and_checks_the_placement():
    """The worker side (transport): its part of a split update, by its layers' EP rank."""
    placement = ExpertPlacement.from_vllm(8, 2)
    sender = HostSender("in_process", placement)
    update = sender.pack(_bucket(8))
    rank1 = _vllm_moe_layer(8, 2, 1)
    part = own_part(update, rank1)
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in part["names"] if "experts." in n}
    assert experts == {4, 5, 6, 7}
    plain = HostSender("in_process").pack(_bucket(8))
    assert own_part(plain, rank1) is plain  # an update that is not split: all of it
    other = ExpertPlacement(8, ((0, 2, 4, 6), (1, 3, 5, 7)))  # not what vLLM placed
    with pytest.raises(ValueError, match="split for experts per EP rank"):
        own_part(HostSender("in_process", other).pack(_bucket(8)), rank1)


def test_engine_args_ask_vllm_for_expert_parallelism(tiny_hf_dirs):
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.engine.vllm_engine import engine_args

    config = RolloutConfig(tensor_parallel=2, expert_parallel=True)
    args = engine_args(tiny_hf_dirs["tiny-llama4"], config, 0)
    assert args.enable_expert_parallel and args.tensor_parallel_size == 2
    assert not engine_args(tiny_hf_dirs["tiny-llama4"], RolloutConfig(), 0).enable_expert_parallel
    with pytest.raises(ValueError, match="no routed experts"):
        engine_args(tiny_hf_dirs["tiny-llama"], config, 0)
    # on the NCCL path the engines run our EP variant of vLLM's nccl backend, found by vLLM's
    # factory (registered by our vLLM plugin) in every worker
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from megatron_rl.rollout.weights.cpu_backend import register_backend
    from megatron_rl.rollout.weights.nccl import ExpertParallelNcclEngine

    nccl = dataclasses.replace(config, weight_transport="nccl", placement="subprocess")
    backend = engine_args(tiny_hf_dirs["tiny-llama4"], nccl, 0).weight_transfer_config.backend
    register_backend()
    assert WeightTransferEngineFactory._registry[backend]() is ExpertParallelNcclEngine
    plain = dataclasses.replace(nccl, expert_parallel=False)
    assert (
        engine_args(tiny_hf_dirs["tiny-llama4"], plain, 0).weight_transfer_config.backend == "nccl"
    )


@pytest.mark.timeout(900)
def test_two_worker_ep_engine_loads_only_its_experts_and_matches_megatron(
    tiny_hf_dirs, megatron_single_rank, monkeypatch
):
    """A real TP 2 + EP engine on CPU (vLLM's workers hold experts (0, 1) and (2, 3)) takes a
    push of perturbed Megatron weights through the host path and then samples with Megatron's
    log-probs. Each worker loads only its part (it checks its EP rank and experts against the
    split, ``own_part``); the push moves each dense tensor to both workers and each expert to
    one (bytes from the HF checkpoint on disk)."""
    from safetensors import safe_open

    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.engine.vllm_engine import VLLMEngine
    from megatron_rl.rollout.parity import logprob_deltas, megatron_from_hf, perturb_
    from megatron_rl.rollout.pool import GeneratorPool
    from megatron_rl.rollout.weights.push import push_megatron_weights

    hf_dir = tiny_hf_dirs["tiny-llama4"]
    dense = experts = 0
    with safe_open(f"{hf_dir}/model.safetensors", "pt") as f:
        for name in f.keys():
            nbytes = f.get_tensor(name).numel() * 4  # fp32 checkpoint
            if ".experts." in name:
                experts += nbytes
            else:
                dense += nbytes
    model = megatron_from_hf(hf_dir)
    perturb_(model, seed=4, noise=0.5)
    config = RolloutConfig(
        max_tokens=12, dtype="float32", max_num_seqs=8, tensor_parallel=2, expert_parallel=True
    )
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 128, (3, 8), generator=gen).tolist()
    loads = []  # (tensors, bytes) the engine loaded per push, all its workers together

    def recorded(self, updates, kv_on_push="keep"):
        loads.append(load_weights(self, updates, kv_on_push))
        return loads[-1]

    load_weights = VLLMEngine.load_weights
    monkeypatch.setattr(VLLMEngine, "load_weights", recorded)
    with GeneratorPool(hf_dir, config) as pool:
        assert logprob_deltas(model, pool.generate(prompts)).mean() > 0.05
        stats = push_megatron_weights(pool, model, bucket_bytes=256 * 1024)
        after = logprob_deltas(model, pool.generate(prompts))
    assert after.mean() < 1e-5 and after.max() < 1e-4, (after.mean(), after.max())
    assert stats.bytes == dense + experts  # what the trainer streamed
    assert loads[-1][1] == 2 * dense + experts, (loads, dense, experts)


def test_nccl_init_infos_and_headers_of_ep_engines_are_accepted_by_vllm():
    """What the pool sends expert-parallel engines on the NCCL path: each worker's init info
    and each bucket's header parse with vLLM's dataclasses (ours extend them); the group of
    all workers is vLLM's layout, each EP rank's group has one worker per engine."""
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLWeightTransferEngine,
        NCCLWeightTransferUpdateInfo,
    )

    from megatron_rl.rollout.weights.nccl import (
        ExpertParallelNcclEngine,
        NcclSender,
        worker_payloads,
    )

    vllm_engine = NCCLWeightTransferEngine.__new__(NCCLWeightTransferEngine)
    ours = ExpertParallelNcclEngine.__new__(ExpertParallelNcclEngine)
    payloads = worker_payloads("10.0.0.1", 29500, [29501, 29502], 3, 2, 2**20)
    for engine, payload in enumerate(payloads):
        plain = {k: v for k, v in payload.items() if k != "ep_groups"}
        info = vllm_engine.parse_init_info(plain)
        assert (info.rank_offset, info.world_size, info.master_port) == (1 + 2 * engine, 7, 29500)
        assert ours.parse_init_info(payload).ep_groups == payload["ep_groups"]
        for rank, group in enumerate(payload["ep_groups"]):
            group = vllm_engine.parse_init_info(group)
            assert (group.rank_offset, group.world_size) == (1 + engine, 4)
            assert group.master_port == 29501 + rank and group.packed
    placement = ExpertPlacement.from_vllm(8, 2)
    sender = NcclSender("10.0.0.1", 29500, 5, 2**20, torch.device("cpu"), placement, [1, 2])
    header = sender.pack(_bucket(8))
    parsed = ours.parse_update_info(header)
    assert parsed.names == [n for n, _ in _bucket(8) if n not in PACKS]
    for part in header["ep_ranks"]:
        assert isinstance(vllm_engine.parse_update_info(part), NCCLWeightTransferUpdateInfo)
    with pytest.raises(ValueError, match="Invalid update_info"):  # vLLM's own check
        ours.parse_update_info({**header, "ep_ranks": [{"names": ["x"]}, {"names": []}]})
    with pytest.raises(ValueError, match="expert ports"):
        NcclSender("10.0.0.1", 29500, 5, 2**20, torch.device("cpu"), placement, [1])


def test_the_nccl_transport_opens_an_ep_group_per_rank_up_to_the_rendezvous(
    tiny_hf_dirs, monkeypatch
):
    """The pool's NCCL opening for expert-parallel engines (``senders.TRANSPORTS``), run on
    CPU as on a GPU machine up to the NCCL rendezvous: every engine gets one JoinTransport
    whose init infos vLLM's engines parse, with a group per EP rank on a port of its own; the
    sender splits by vLLM's placement over those ports, and the pool waits for every join."""
    import transformers
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    import megatron_rl.platform.device as device
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.messages import JoinTransport
    from megatron_rl.rollout.weights.nccl import ExpertParallelNcclEngine, NcclSender
    from megatron_rl.rollout.weights.senders import transport_for

    monkeypatch.setattr(device, "get_platform", lambda: device.Platform("cuda", "nccl", False))
    monkeypatch.setattr(device.Platform, "torch_device", lambda self: torch.device("cpu"))
    monkeypatch.setattr(NcclSender, "connect", lambda self: None)  # the NCCL rendezvous
    hf = transformers.AutoConfig.from_pretrained(tiny_hf_dirs["tiny-llama4"])
    hf = getattr(hf, "text_config", hf)
    config = RolloutConfig(
        engines=3,
        tensor_parallel=2,
        expert_parallel=True,
        placement="subprocess",
        weight_transport="nccl",
        nccl_address="10.0.0.1",
    )

    class Engine:
        def __init__(self) -> None:
            self.sent = []

        def send(self, command) -> None:
            self.sent.append(command)

    engines, joined = [Engine() for _ in range(3)], []
    transport = transport_for(config)
    assert transport.backend(config) == "megatron_rl_nccl_ep" and not transport.joins_at_build
    sender = transport.open(config, hf, engines, joined.append)
    assert joined == [sender.connect]  # the rendezvous, run by the pool under watch
    ours = ExpertParallelNcclEngine.__new__(ExpertParallelNcclEngine)
    vllm_engine = NCCLWeightTransferEngine.__new__(NCCLWeightTransferEngine)
    ports = set()
    for i, engine in enumerate(engines):
        (command,) = engine.sent
        assert isinstance(command, JoinTransport)
        info = ours.parse_init_info(command.init_info)
        assert (info.master_address, info.rank_offset, info.world_size) == (
            "10.0.0.1",
            1 + 2 * i,
            7,
        )
        groups = [vllm_engine.parse_init_info(g) for g in info.ep_groups]
        assert [(g.rank_offset, g.world_size) for g in groups] == [(1 + i, 4)] * 2
        ports |= {info.master_port, *(g.master_port for g in groups)}
    assert len(ports) == 3  # the group of all workers and one per EP rank, ports apart
    assert sender.experts == ExpertPlacement.from_vllm(hf.num_local_experts, 2)


@pytest.mark.parametrize("experts,ep", [(8, 2), (6, 4)])
def test_nccl_ep_push_sends_each_expert_only_to_its_ranks_group(monkeypatch, experts, ep):
    """Two EP engines on the NCCL path, on CPU up to the NCCL calls: the sender broadcasts
    the dense tensors in the group of all workers and each rank's experts in that rank's
    group (vLLM's packed producer); every worker (our vLLM ``nccl`` engine, with vLLM's
    ``RoutedExperts`` of its EP rank as the model) receives with vLLM's packed consumer and
    loads the dense tensors and exactly the experts ``determine_expert_map`` gives its rank,
    equal to the hand-unpacked HF packs. Stand-ins: the communicators (a broadcast hands each
    member of the group a copy) and the CUDA device index."""
    import queue

    from vllm.distributed.weight_transfer.packed_tensor import (
        DEFAULT_PACKED_NUM_BUFFERS as BUFFERS,
    )
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    from megatron_rl.platform import get_platform
    from megatron_rl.rollout.weights.nccl import ExpertParallelNcclEngine, NcclSender

    get_platform()  # on CPU: the torch.cuda stream stand-ins every run has
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    engines, chunk = 2, 4096  # several packed broadcasts per group
    inbox = {}  # (group, engine, rank) -> queue; group -1: all workers
    wire_bytes = {}

    class Wire:
        def __init__(self, group):
            self.group = group

        def broadcast(self, tensor, src):
            wire_bytes[self.group] = wire_bytes.get(self.group, 0) + tensor.numel()
            for (group, _, _), box in inbox.items():
                if group == self.group:
                    box.put(tensor.clone())

    class Receiver:
        def __init__(self, box):
            self.box = box

        def broadcast(self, tensor, src):
            tensor.copy_(self.box.get(timeout=30))

    placement = ExpertPlacement.from_vllm(experts, ep)
    workers = {}
    for engine in range(engines):
        for rank in range(ep):
            worker = ExpertParallelNcclEngine.__new__(ExpertParallelNcclEngine)
            worker.device, worker.packed = torch.device("cpu"), True
            worker.packed_buffer_size_bytes, worker.packed_num_buffers = chunk, BUFFERS
            worker.model = _vllm_moe_layer(experts, ep, rank)
            loaded = []
            worker.model.load_weights = loaded.extend
            for group in (-1, rank):
                inbox[group, engine, rank] = queue.Queue()
            worker.model_update_group = Receiver(inbox[-1, engine, rank])
            worker.expert_group = Receiver(inbox[rank, engine, rank])
            workers[engine, rank] = worker, loaded
    world = 1 + engines * ep
    sender = NcclSender("127.0.0.1", 1, world, chunk, torch.device("cpu"), placement, range(ep))
    sender.group, sender.expert_groups = Wire(-1), [Wire(r) for r in range(ep)]
    bucket = _bucket(experts, seed=2)
    header = sender.pack(bucket)
    sender.send(bucket)
    dense = [(n, t) for n, t in bucket if n not in PACKS]
    gate_up, down = bucket[3][1], bucket[4][1]
    per_expert = 3 * HIDDEN * FFN * 4
    assert wire_bytes[-1] == sum(t.numel() * 4 for _, t in dense)
    for (_, rank), (worker, loaded) in workers.items():
        worker.receive_weights(worker.parse_update_info(header))
        _, expert_map, _ = determine_expert_map(ep, rank, experts, "linear")
        held = sorted(e for e in range(experts) if expert_map[e] >= 0)
        assert wire_bytes[rank] == len(held) * per_expert
        got = dict(loaded)
        assert [n for n, _ in loaded[: len(dense)]] == [n for n, _ in dense]
        assert all(torch.equal(got[n], t) for n, t in dense)
        prefix = "model.layers.1.feed_forward.experts"
        names = {n for n in got if n.startswith(prefix + ".")}
        assert names == {
            f"{prefix}.{e}.{k}_proj.weight" for e in held for k in ("gate", "up", "down")
        }
        for e in held:
            assert torch.equal(got[f"{prefix}.{e}.gate_proj.weight"], gate_up[e, :, :FFN].t())
            assert torch.equal(got[f"{prefix}.{e}.up_proj.weight"], gate_up[e, :, FFN:].t())
            assert torch.equal(got[f"{prefix}.{e}.down_proj.weight"], down[e].t())
    assert all(box.empty() for box in inbox.values())  # nothing sent that no one took


@pytest.mark.parametrize("on_input", [True, False])
def test_cpu_moe_kernel_on_an_ep_rank_computes_only_its_experts(on_input):
    """The vLLM 0.32 CPU bug worked around in ``fix_cpu_moe_expert_map``: its fused-MoE
    kernel on an EP rank (2 of 4 experts) gets global expert ids. With the fix, the ranks'
    outputs sum to the float64 reference of every token through its expert (what vLLM's
    all-reduce then does)."""
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    from megatron_rl.rollout.weights.experts import fix_cpu_moe_expert_map

    experts, ep, tokens = 4, 2, 12
    g = torch.Generator().manual_seed(3)
    w13 = torch.randn(experts, 2 * FFN, HIDDEN, generator=g) / 8
    w2 = torch.randn(experts, HIDDEN, FFN, generator=g) / 8
    x = torch.randn(tokens, HIDDEN, generator=g)
    ids = torch.arange(tokens, dtype=torch.int32).remainder(experts)[:, None]
    weights = torch.rand(tokens, 1, generator=g) + 0.5
    # Llama-4 scales the input by the router weight, others the output
    inputs = x.double() * (weights.double() if on_input else 1)
    gate, up = (inputs[:, None] @ w13[ids[:, 0]].double().mT)[:, 0].chunk(2, -1)
    reference = ((torch.nn.functional.silu(gate) * up)[:, None] @ w2[ids[:, 0]].double().mT)[:, 0]
    reference = reference * (1 if on_input else weights.double())

    def ranks_sum() -> torch.Tensor:
        total = torch.zeros(tokens, HIDDEN, dtype=torch.float64)
        for rank in range(ep):
            layer = _vllm_moe_layer(experts, ep, rank).layers[1].feed_forward.experts
            held = list(held_experts(layer.expert_map, experts))
            kernel = CPUUnquantizedExperts(
                layer.routed_experts.moe_config, FUSED_MOE_UNQUANTIZED_CONFIG
            )
            out = torch.empty_like(x)
            kernel.apply(
                output=out,
                hidden_states=x * weights if on_input else x,
                w1=cpu_prepack_moe_weight(w13[held], "vec"),
                w2=cpu_prepack_moe_weight(w2[held], "vec"),
                topk_weights=weights,
                topk_ids=ids,
                activation=MoEActivation.SILU,
                global_num_experts=experts,
                expert_map=layer.expert_map,
                a1q_scale=None,
                a2_scale=None,
                workspace13=None,
                workspace2=None,
                expert_tokens_meta=None,
                apply_router_weight_on_input=on_input,
            )
            total += out.double()
        return total

    fix_cpu_moe_expert_map()  # (unfixed, this reads past each rank's weights: not run)
    assert torch.allclose(ranks_sum(), reference, atol=1e-4)
