"""Core attention on torch SDPA, with the Llama-4 pieces megatron-core 0.16.1 lacks.

Used in the local (CPU) layer spec, and on GPU for layers that need chunked local attention or
attention temperature tuning (Transformer Engine has neither). Same interface as megatron's
``DotProductAttention``: query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` -> ``[sq, b, np*hn]``.

Positions are the token indices 0..s-1 of the (unpacked, right-padded) training sequence.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule


class SDPACoreAttention(MegatronModule):
    """Causal softmax attention via ``torch.nn.functional.scaled_dot_product_attention``.

    ``chunk_size``: Llama-4 chunked local attention (a query sees only keys of its own chunk).
    ``temperature``: ``(floor_scale, attn_scale)`` for Llama-4 attention temperature tuning on
    NoPE layers: queries are scaled by ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1``.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type=None,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        chunk_size: int | None = None,
        temperature: tuple[float, float] | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.chunk_size = chunk_size
        self.temperature = temperature

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("packed sequences / attention bias are not supported")
        sq, b, heads, hn = query.shape
        sk = key.shape[0]
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            pos = torch.arange(sq, device=query.device, dtype=torch.float32)
            scale = torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0
            query = (query * scale.view(sq, 1, 1, 1)).to(query.dtype)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask = self._mask(sq, sk, attention_mask, query.device)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=mask is None,
            scale=self.softmax_scale,
            enable_gqa=k.shape[1] != heads,
        )
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)

    def _mask(self, sq: int, sk: int, attention_mask, device) -> torch.Tensor | None:
        """Boolean "may attend" mask ``[sq, sk]`` (or ``[b, 1, sq, sk]``); None = plain causal."""
        if self.chunk_size is None and attention_mask is None:
            return None
        q_pos = torch.arange(sk - sq, sk, device=device)[:, None]
        k_pos = torch.arange(sk, device=device)[None, :]
        allowed = k_pos <= q_pos
        if self.chunk_size is not None:
            allowed = allowed & (q_pos // self.chunk_size == k_pos // self.chunk_size)
        if attention_mask is not None:  # megatron convention: True = masked out
            allowed = allowed & ~attention_mask.bool()
        return allowed
