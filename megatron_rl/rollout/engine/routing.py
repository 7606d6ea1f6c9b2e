"""The experts each token was routed to while an engine generated it (routing replay, R3).

vLLM 0.32 returns routed experts (``enable_return_routed_experts``,
``CompletionOutput.routed_experts [seq_len, layers, topk]``) only with its model runner V2,
which needs Triton (on CPU: triton-cpu, absent from the vLLM CPU build), and with prefix
caching; its rows also come back only for requests that finish, not for those we abort at an
interruption. So the engine records them itself, with vLLM's own capture hooks: the routers'
``capture_fn`` (``bind_routed_experts_capturer``, the same ids vLLM's R3 path records: logical
expert ids, before any EPLB remapping) and the model runner's batch layout of each step.

Rows are per *position* of a request's sequence (prompt and response): row ``p`` holds, for
every decoder layer, the top-k experts of the token at position ``p`` (dense layers: zeros),
as computed the first time the engine processed that position. That is the routing the token
at ``p + 1`` was sampled with (its KV entry stays in the cache). A request recomputed after a
preemption or a weight push with ``kv_on_push: recompute`` keeps its first rows. The last
sampled token is never processed by the engine, so a finished request has one row fewer than
it has tokens.

The rows travel with the sample (``Sample.routed_experts``: numpy, pickled by the engine
processes' queues and the bridge to remote engines). Checkpoints hold none: the prompts in
flight at a checkpoint are generated again on resume, with their routing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

WORKER_EXTENSION = "megatron_rl.rollout.engine.routing.RoutingWorkerExtension"


class RoutingRecorder:
    """Target of vLLM's router capture hooks: one step's ``[tokens, layers, topk]`` rows,
    then sorted into per-request rows by position."""

    def __init__(self, num_layers: int, topk: int, num_experts: int) -> None:
        self.shape = (num_layers, topk)
        self.dtype = np.uint8 if num_experts <= 256 else np.uint16
        self.step_rows: torch.Tensor | None = None  # [max tokens of a step, layers, topk]
        self.requests: dict[str, list[np.ndarray]] = {}  # request id -> chunks of rows

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """vLLM's ``capture_fn`` (bound per layer): this step's top-k ids ``[tokens, topk]``."""
        n = topk_ids.shape[0]
        if self.step_rows is None or self.step_rows.shape[0] < n:
            self.step_rows = torch.zeros(
                (n, *self.shape), dtype=torch.int32, device=topk_ids.device
            )
        self.step_rows[:n, layer_id] = topk_ids

    def begin_step(self) -> None:
        if self.step_rows is not None:
            self.step_rows.zero_()  # dense layers stay zero

    def end_step(
        self, request_ids: Sequence[str], query_start: np.ndarray, positions: torch.Tensor
    ) -> None:
        """File the step's rows: request ``i`` owns tokens ``query_start[i]:query_start[i+1]``
        of the batch, at the consecutive positions starting at ``positions[query_start[i]]``."""
        total = int(query_start[len(request_ids)])
        if self.step_rows is None or total == 0:
            return
        rows = self.step_rows[:total].cpu().numpy().astype(self.dtype)
        starts = positions[:total].cpu().numpy()
        for i, request_id in enumerate(request_ids):
            lo, hi = int(query_start[i]), int(query_start[i + 1])
            if hi > lo:
                self._file(_external_id(request_id), int(starts[lo]), rows[lo:hi])

    def _file(self, request_id: str, start: int, rows: np.ndarray) -> None:
        chunks = self.requests.setdefault(request_id, [])
        have = sum(len(c) for c in chunks)
        if start > have:
            raise RuntimeError(
                f"routing capture of request {request_id} skipped positions {have}..{start - 1} "
                "(a cached prefix? prefix caching must be off with routed experts)"
            )
        if start + len(rows) > have:  # positions seen before keep their first routing
            chunks.append(rows[have - start :])

    def take(self, request_id: str) -> np.ndarray:
        """The request's rows ``[positions, layers, topk]``, forgotten here."""
        chunks = self.requests.pop(request_id, [])
        if not chunks:
            return np.zeros((0, *self.shape), dtype=self.dtype)
        return np.concatenate(chunks)


def _external_id(request_id: str) -> str:
    """vLLM's internal request id is ``f"{external}-{8 random chars}"``."""
    return request_id.rsplit("-", 1)[0]


class RoutingWorkerExtension:
    """Methods vLLM adds to its worker (engine arg ``worker_extension_cls``), called through
    ``collective_rpc``: every worker captures; the first TP rank's rows are the ones used."""

    def start_routing_capture(self) -> None:
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            bind_routed_experts_capturer,
        )

        runner = self.model_runner
        config = self.vllm_config.model_config
        recorder = RoutingRecorder(
            config.get_total_num_hidden_layers(),
            config.get_num_experts_per_tok(),
            config.get_num_experts(),
        )
        bind_routed_experts_capturer(runner.get_model(), recorder)
        forward = runner._model_forward

        def recording_forward(*args: Any, **kwargs: Any) -> Any:
            recorder.begin_step()
            output = forward(*args, **kwargs)
            n = runner.input_batch.num_reqs
            recorder.end_step(
                runner.input_batch.req_ids[:n], runner.query_start_loc.np, kwargs["positions"]
            )
            return output

        runner._model_forward = recording_forward
        self.routing_recorder = recorder

    def take_routed_experts(self, request_ids: list[str]) -> dict[str, np.ndarray]:
        return {r: self.routing_recorder.take(r) for r in request_ids}


def merge_rows(first: np.ndarray | None, later: np.ndarray | None) -> np.ndarray | None:
    """Rows of one sequence from two requests (an interrupted sample's two segments): the
    positions ``first`` has keep its rows, ``later`` adds those beyond."""
    if later is None or (first is not None and len(later) <= len(first)):
        return first
    if first is None or len(first) == 0:
        return later
    return np.concatenate([first, later[len(first) :]])
