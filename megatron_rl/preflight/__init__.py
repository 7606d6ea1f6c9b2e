"""`megatron-rl preflight`: the allocation checks itself before a long run.

The production code paths (``trainer.setup.build_run``, ``trainer.loop.start_generators``,
``trainer.handoff.push_weights``, the post-push probe, ``policy_update``, ``CheckpointManager``) run once at
reduced length on the real layout; each named check (``registry.CHECKS``) reports what it
measured against its limit, in a table and in ``RUN_DIR/preflight.json``.
"""
