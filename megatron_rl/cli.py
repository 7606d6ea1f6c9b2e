"""`megatron-rl` command line: one sub-command per module, imported only when used.

Each command module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Importing
lazily keeps light commands (``fit``) free of torch / megatron imports.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from megatron_rl.platform.threads import set_omp_defaults

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("megatron_rl.trainer.cli", "train a policy with an RL recipe"),
    "fit": ("megatron_rl.scaling.cli", "fit / extrapolate / compare compute curves"),
    "convert": ("megatron_rl.conversion.cli", "convert checkpoints HF <-> Megatron"),
    "check-parity": ("megatron_rl.rollout.parity", "Megatron vs vLLM log-prob parity"),
    "launch": ("megatron_rl.launch.cli", "render and submit a Slurm job for a recipe"),
    "tournament": (
        "megatron_rl.scaling.tournament.cli",
        "compare recipe variants at small compute, stop losers early, predict the winner",
    ),
    "plan": ("megatron_rl.planning.cli", "per-GPU memory plan of a recipe: will it fit"),
    "preflight": ("megatron_rl.preflight.cli", "check the allocation before a long run"),
    "reward-audit": (
        "megatron_rl.rewards.audit_cli",
        "score your own evaluation outputs with the reward and read the disagreements",
    ),
}


def commands_help() -> str:
    """The commands and what each does, one a line (``megatron-rl --help``)."""
    width = max(len(name) for name in COMMANDS) + 2
    lines = [f"  {name:<{width}}{text}" for name, (_, text) in COMMANDS.items()]
    return "commands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    set_omp_defaults()  # before any command imports torch
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="megatron-rl",
        description="Megatron-Core RL trainer (ScaleRL recipe, vLLM rollouts, PipelineRL).",
        epilog=commands_help() + "\n\n`megatron-rl COMMAND --help`: the command's arguments.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "command", metavar="COMMAND", choices=sorted(COMMANDS), help="one of the commands below"
    )
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.print_help() if not argv or argv[0] in ("-h", "--help") else parser.parse_args(
            argv[:1]
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    name = argv[0]
    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(module_name)
    sub = argparse.ArgumentParser(prog=f"megatron-rl {name}", description=help_text)
    module.add_arguments(sub)
    try:  # positionals (dotted overrides) may follow options: `train R --run-dir X a.b=1`
        args = sub.parse_intermixed_args(argv[1:])
    except TypeError:  # argparse cannot intermix a parser with sub-commands (convert)
        args = sub.parse_args(argv[1:])
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
