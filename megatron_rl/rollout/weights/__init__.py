"""The trainer's side of a weight push: HF-named buckets to the engines, one transport each.

- :mod:`.senders`: the transports (``rollout.weight_transport``) and their registry;
- :mod:`.buckets`: host buckets (the ``host`` transport's sender end);
- :mod:`.cpu_backend`: the ``megatron_rl_cpu`` backend of vLLM's weight-transfer registry
  (the engines' end of the host transport);
- :mod:`.nccl`: the ``nccl`` transport's sender end (one broadcast to every engine);
- :mod:`.m2n`: the ``nccl_m2n`` transport: our shards as vLLM's m2n source;
- :mod:`.m2n_ranks`: ``nccl_m2n`` on every trainer source rank (following rank 0's pool);
- :mod:`.experts`: which routed experts each expert-parallel engine rank gets;
- :mod:`.push`: a Megatron model's weights streamed into a pool.
"""
