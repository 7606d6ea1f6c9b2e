"""megatron_rl."""
