"""``rollout.weight_transport: nccl_m2n`` driven across the trainer's ranks, up to the NCCL
calls: four gloo ranks (TP 2 x DP 2: source ranks 0 and 1, replicas 2 and 3) with real
Megatron shards; rank 0 holds the real ``GeneratorPool`` over fake engines that serve the
pool's side of a group transport. vLLM's own trainer engine runs on every source rank; its
rendezvous, the destination-plan broadcast, the raw communicator and ``nccl.m2n`` are
stand-ins that record, per rank, what they were handed."""

from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from support.fake_engines import FakeHandle, FakeM2NLayouts

from megatron_rl.platform import run_local_ranks
from megatron_rl.rollout.messages import JoinTransport, Push, Pushed, Ready, TransportJoined
from megatron_rl.rollout.wire import EventChannels, EventWriter

HF = SimpleNamespace(vocab_size=128, eos_token_id=2)


class _Engines:
    """A restartable launcher of fake engines: each answers ``JoinTransport`` (recording
    its payload) and takes a push's update infos (recording the names announced)."""

    restartable = True

    def __init__(self) -> None:
        self.events = EventChannels()
        self.writers: dict[int, EventWriter] = {}
        self.spawned: list[int] = []
        self.joins: list[tuple[int, int, dict]] = []  # (engine, incarnation, payload)
        self.announced: list[tuple[int, int, int, list[str]]] = []  # (engine, inc, version, names)

    def start(self, count):
        return [self.restart(i) for i in range(count)]

    def restart(self, index):
        self.spawned.append(index)
        incarnation = self.spawned.count(index)
        reader, conn = multiprocessing.Pipe(duplex=False)
        self.events.add(index, reader)
        writer = self.writers[index] = EventWriter(conn)
        handle = FakeHandle(index, self.events)
        writer.put(Ready(index, 64))
        threading.Thread(
            target=self._serve, args=(handle, writer, incarnation), daemon=True
        ).start()
        return handle

    def _serve(self, handle, writer, incarnation):
        while handle.alive:
            try:
                command = handle.commands.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(command, JoinTransport):
                self.joins.append((handle.index, incarnation, command.init_info))
                writer.put(TransportJoined(handle.index))
            elif isinstance(command, Push):
                count = 0
                while (update := handle.weights.get(timeout=60)) is not None:
                    names = update["names"]
                    self.announced.append((handle.index, incarnation, command.version, names))
                    count += len(names)
                writer.put(Pushed(handle.index, command.version, 0.0, count, 0, None))

    def close(self):
        self.events.close()

    def kill(self, pool, index):
        writer = self.writers.pop(index)
        writer.flush()
        writer._conn.close()
        pool.engine_handles()[index].alive = False


def _install_stand_ins(events: list) -> None:
    """The NCCL / nccl.m2n calls of vLLM's trainer engine and of ours, recording into
    ``events`` (and two CUDA-only calls as no-ops)."""
    from vllm.distributed.weight_transfer import m2n_trainer
    from vllm.distributed.weight_transfer.m2n_common import REPLICATED

    from megatron_rl.rollout.weights import m2n

    class Runtime(FakeM2NLayouts):  # nccl.m2n
        Config = staticmethod(lambda max_cta=None: ("config", max_cta))

        class Handle:
            @staticmethod
            def create(config):
                return Runtime.Handle()

            def destroy(self):
                pass

        @staticmethod
        def reshard(src, dst, comm, stream, **layout):
            assert dst is None  # the trainer only sends
            events.append(("reshard", comm, src.detach().clone()))

    class Comm:
        def __init__(self, port):
            self.port = port

        def destroy(self):
            events.append(("leave", self.port))

    def join(info, rank):
        events.append(("join", info["master_port"], info["world_size"], rank))
        return Comm(info["master_port"])

    def plan(comm, first_worker_rank, placements, count):
        assert placements is None  # a trainer rank receives the workers' plan
        return [REPLICATED] * count  # what every worker plans on CPU (the fallback)

    m2n_trainer.import_m2n = m2n.import_m2n = lambda: Runtime
    m2n_trainer.trainer_init = join
    m2n_trainer.publish_destination_placements = plan
    m2n.comm_ptr = lambda comm: comm.port
    torch.Tensor.record_stream = lambda self, stream: None  # CUDA-only
    torch.accelerator.synchronize = lambda *a: None  # CUDA-only


def m2n_ranks_rank(hf_dir: str) -> dict:
    """Start the pool (rank 0) inside ``serving``, push, kill engine 1 and push (re-formed),
    kill engine 0 and reweigh it, push again: every rank runs the same steps, as the
    trainer's ranks do. Returns what each rank's stand-ins saw, phase by phase."""
    import torch.distributed as dist

    from megatron_rl.conversion.hf import load_hf_weights
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig, Platform, device, init_distributed
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.pool import GeneratorPool
    from megatron_rl.rollout.weights import m2n_ranks, push
    from megatron_rl.rollout.weights.push import push_megatron_weights

    init_distributed(ParallelConfig(tensor=2))
    model = build_model(ModelConfig(hf_path=hf_dir, dtype="float32"), ParallelConfig(tensor=2))
    load_hf_weights(model, hf_dir, torch.float32)
    rank = dist.get_rank()
    events: list = []
    _install_stand_ins(events)
    streamed = []
    push.iter_hf_weights = lambda *a, **k: streamed.append(rank) or iter(())
    config = RolloutConfig(
        engines=2,
        placement="subprocess",
        weight_transport="nccl_m2n",
        weight_bucket_mb=1,
        push_timeout_seconds=60,
        startup_timeout_minutes=2,
    )
    main = rank == 0
    if main:  # the transport's GPU check (nothing else on this path asks for a GPU)
        gpu = Platform("cuda", "nccl", False)
        device.get_platform = lambda: gpu
    engines = _Engines()
    phases, results = {}, {}

    def phase(name):
        phases[name] = len(events)

    with torch.no_grad(), m2n_ranks.serving(model, config):
        pool = GeneratorPool("unused", config, launcher=engines, text_config=HF) if main else None
    phase("start")
    try:
        results["push1"] = push_megatron_weights(pool, model)
        phase("push1")
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)
        if main:
            engines.kill(pool, 1)
            _wait(pool.needs_weights, pool)
        results["push2"] = push_megatron_weights(pool, model)
        phase("push2")
        if main:
            engines.kill(pool, 0)
            _wait(pool.needs_weights, pool)
        results["reweigh"] = push_megatron_weights(pool, model, reweigh=True)
        phase("reweigh")
        results["push3"] = push_megatron_weights(pool, model)
        phase("push3")
    finally:
        if pool is not None:
            pool.close()
    bounds = [0, *phases.values()]
    by_phase = {n: events[a:b] for n, a, b in zip(phases, bounds, bounds[1:])}
    return {
        "rank": rank,
        "events": by_phase,
        "streamed": streamed,
        "results": {k: None if v is None else (v.version, v.tensors) for k, v in results.items()},
        "joins": engines.joins,
        "announced": engines.announced,
        "metas": [
            (m.name, None if m.placements is None else tuple(m.placements))
            for m in m2n_ranks.current().source.metadata()
        ]
        if m2n_ranks.current().source is not None
        else None,
    }


def _wait(ready, pool, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        assert time.monotonic() < deadline, "the pool did not restart the engine"
        pool.poll()
        time.sleep(0.05)


@pytest.fixture(scope="module")
def ranks(tiny_hf_dirs):
    return run_local_ranks(m2n_ranks_rank, 4, tiny_hf_dirs["tiny-llama"])


def _joins(events) -> list[tuple]:
    return [e for e in events if e[0] == "join"]


def _reshards(events) -> dict[int, list[torch.Tensor]]:
    """The blocks each communicator (by port) got from this rank, in order."""
    sent: dict[int, list[torch.Tensor]] = {}
    for event in events:
        if event[0] == "reshard":
            sent.setdefault(event[1], []).append(event[2])
    return sent


def _expected(ref: dict, metas: list, rank: int, plus: float = 0.0) -> list[torch.Tensor]:
    """Source rank ``rank``'s block of every tensor, in metadata order (a placement's slice
    of the transformers tensor over the (2, 1) mesh; ``plus`` added in float32 as the ranks
    did)."""
    blocks = []
    for name, placements in metas:
        full = ref[name] + plus
        blocks.append(full if placements is None else full.chunk(2, placements[0])[rank])
    return blocks


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(
        g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want)
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_source_rank_joins_each_engine_when_the_pool_forms_its_transport(ranks):
    """At the pool's start both source ranks join one communicator per engine (the same
    rendezvous ports, in the same order, as their own rank; 2 trainer ranks + 1 engine
    worker), and each engine got the matching init payload from rank 0's pool."""
    first, second = ranks[0]["events"]["start"], ranks[1]["events"]["start"]
    ports = [j[1] for j in _joins(first)]
    assert len(set(ports)) == 2
    assert _joins(first) == [("join", p, 3, 0) for p in ports]
    assert _joins(second) == [("join", p, 3, 1) for p in ports]
    # the engines record their joins on threads of their own: matched by port, not order
    by_port = {p["master_port"]: (e, inc, p) for e, inc, p in ranks[0]["joins"]}
    for engine, port in enumerate(ports):
        assert by_port[port][:2] == (engine, 1)
        payload = by_port[port][2]
        assert (payload["master_port"], payload["rank_offset"], payload["world_size"]) == (
            port,
            2,
            3,
        )
        assert payload["src_mesh_dims"] == [2, 1] and payload["dst_mesh_dims"] == [1, 1]
        assert payload["names"] == [m[0] for m in ranks[0]["metas"]]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_push_sends_each_source_ranks_own_blocks_once_per_engine_in_order(ranks, tiny_hf_dirs):
    """A push: every source rank hands m2n its own block of every tensor exactly once per
    engine communicator, in metadata order (the same order on both ranks: a collective), read
    live (the second push carries the updated weights); rank 0 alone announces the buckets'
    names to the engines, every name once per engine and version; nothing is streamed as HF
    buckets."""
    ref = {n: t for n, t in load_file(f"{tiny_hf_dirs['tiny-llama']}/model.safetensors").items()}
    metas = ranks[0]["metas"]
    assert ranks[1]["metas"] == metas
    names = [m[0] for m in metas]
    ports = [j[1] for j in _joins(ranks[0]["events"]["start"])]
    for rank in (0, 1):
        sent = _reshards(ranks[rank]["events"]["push1"])
        assert sorted(sent) == sorted(ports)
        for port in ports:
            assert _same(sent[port], _expected(ref, metas, rank)), (rank, port)
    # the two ranks issue their reshards in the same sequence of (communicator, tensor)
    order = [
        [(e[1], tuple(e[2].shape)) for e in ranks[r]["events"]["push1"] if e[0] == "reshard"]
        for r in (0, 1)
    ]
    assert order[0] == order[1] and len(order[0]) == 2 * len(names)
    version = ranks[0]["results"]["push1"][0]
    for engine in (0, 1):
        announced = [a[3] for a in ranks[0]["announced"] if a[0] == engine and a[2] == version]
        assert len(announced) > 1  # several buckets (weight_bucket_mb 1)
        assert sum(announced, []) == names
    assert all(r["streamed"] == [] for r in ranks)
    assert ranks[0]["results"]["push1"][1] == len(names)  # rank 0's stats: its own blocks
    assert ranks[1]["results"]["push1"] is None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_death_makes_every_source_rank_leave_and_join_the_new_group(ranks, tiny_hf_dirs):
    """Engine 1 dies and restarts: the next push forms the group anew and both source ranks
    leave the two old communicators and join two new ones (fresh ports), then send the
    updated blocks there only; engine 0 dies: the reweigh forms a group of the restarted
    engine alone (both ranks join it, send once), and the next push all engines again."""
    ref = {n: t for n, t in load_file(f"{tiny_hf_dirs['tiny-llama']}/model.safetensors").items()}
    metas = ranks[0]["metas"]
    old = [j[1] for j in _joins(ranks[0]["events"]["start"])]
    expected_joins = {}
    for name, engines in (("push2", 2), ("reweigh", 1), ("push3", 2)):
        ports = [j[1] for j in _joins(ranks[0]["events"][name])]
        assert len(ports) == engines and not set(ports) & set(old), name
        for rank in (0, 1):
            events = ranks[rank]["events"][name]
            assert _joins(events) == [("join", p, 3, rank) for p in ports], (name, rank)
            left = [e[1] for e in events if e[0] == "leave"]
            assert left == old, (name, rank)  # every communicator joined before, once
            assert events.index(("leave", old[-1])) < events.index(_joins(events)[0])
            sent = _reshards(events)
            assert sorted(sent) == sorted(ports), (name, rank)
            for port in ports:
                assert _same(sent[port], _expected(ref, metas, rank, plus=1.0)), (name, port)
        expected_joins[name] = ports
        old = ports
    # the pool: engine 0's first incarnation and engine 1's second joined at push2, engine
    # 0's second alone at the reweigh, both current incarnations at push3 (each engine
    # records its join on a thread of its own: matched by port)
    joins = {p["master_port"]: (e, inc) for e, inc, p in ranks[0]["joins"]}
    assert len(ranks[0]["joins"]) == len(joins) == 7
    push2, reweigh, push3 = (expected_joins[n] for n in ("push2", "reweigh", "push3"))
    assert [joins[p] for p in push2 + reweigh + push3] == [(0, 1), (1, 2), (0, 2), (0, 2), (1, 2)]
    versions = {n: ranks[0]["results"][n][0] for n in ("push1", "push2", "reweigh", "push3")}
    assert versions == {"push1": 1, "push2": 2, "reweigh": 2, "push3": 3}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_data_parallel_replicas_take_no_part(ranks):
    """Ranks 2 and 3 (copies of ranks 0 and 1) join nothing, send nothing, stream nothing,
    and their pushes return at once with nothing."""
    for replica in ranks[2:]:
        assert replica["metas"] is None
        assert all(events == [] for events in replica["events"].values())
        assert replica["streamed"] == []
        assert set(replica["results"].values()) == {None}


def test_an_engine_loads_m2n_update_infos_that_carry_names_only():
    """vLLM's m2n update info is the names alone (shapes and dtypes came with the init
    payload): our engine wrapper loads it and counts its tensors and bytes from that payload
    (it read ``shapes`` from every update, a ``KeyError`` for this transport)."""
    from megatron_rl.rollout.engine.vllm_engine import VLLMEngine

    calls = []

    class Core:  # vLLM's engine: the RPCs the wrapper makes
        def collective_rpc(self, method, kwargs=None):
            calls.append((method, kwargs))

        def reset_prefix_cache(self, **kwargs):
            calls.append(("reset_prefix_cache", kwargs))

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.engine, engine._joined = Core(), False
    init = {
        "names": ["a", "b", "c"],
        "dtype_names": ["float32", "bfloat16", "float32"],
        "shapes": [[4, 2], [3], [5]],
        "rank_offset": 2,
    }
    engine.init_transport(init)
    updates = [{"names": ["a", "b"]}, {"names": ["c"]}]
    assert engine.load_weights(iter(updates)) == (3, 4 * 2 * 4 + 3 * 2 + 5 * 4)
    assert [c[0] for c in calls] == [
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "update_weights",
        "finish_weight_update",
    ]
    assert [c[1]["update_info"] for c in calls[2:4]] == updates  # as vLLM's update info
