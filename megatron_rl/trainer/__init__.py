"""The RL training loop: batches, policy update, checkpoints, metrics."""
