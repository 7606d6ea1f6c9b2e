"""HF <-> Megatron checkpoint conversion and model checkpoints."""
