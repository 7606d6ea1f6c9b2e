"""`megatron-rl convert hf-to-mcore HF_DIR OUT_DIR [--tp N] [--ep N] [--pp N]` and
`megatron-rl convert mcore-to-hf CKPT_DIR OUT_DIR`.

Training does not need hf-to-mcore: the trainer reads ``model.hf_path`` itself (each rank
loads its shard). hf-to-mcore writes a megatron dist checkpoint for tools outside the run, or
to check that a layout fits a model before a job; mcore-to-hf turns a run's checkpoint (a run
directory, one of its steps, or the step's ``model`` directory) into an HF directory."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF directory -> megatron dist checkpoint")
    a.add_argument("hf_dir")
    a.add_argument("out_dir")
    a.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    a.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    a.add_argument("--ep", type=int, default=1, help="expert parallel size")
    a.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="default: the source's (bfloat16 if every weight is stored in BF16, else float32)",
    )
    b = sub.add_parser("mcore-to-hf", help="megatron dist checkpoint -> HF directory")
    b.add_argument(
        "ckpt_dir",
        help="a run directory (its newest intact checkpoint), a step directory "
        "(RUN_DIR/checkpoints/step_N) or its model/ directory",
    )
    b.add_argument("out_dir")
    b.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default=None, help="default: the checkpoint's"
    )


def run(args: argparse.Namespace) -> int:
    from megatron_rl.conversion import hf
    from megatron_rl.platform import ParallelConfig

    try:
        if args.direction == "hf-to-mcore":
            parallel = ParallelConfig(tensor=args.tp, pipeline=args.pp, expert=args.ep)
            parallel.validate()
            from megatron_rl.models.arch import architecture_from_hf, check_divisibility
            from megatron_rl.models.hf_config import load_hf_config

            hf.check_hf_dir(args.hf_dir)
            arch = architecture_from_hf(load_hf_config(args.hf_dir))
            check_divisibility(arch, parallel)
            if arch.tie_embeddings and parallel.pipeline > 1:
                # megatron-core copies the embedding to the last stage's tied head when it
                # builds the model (an all-reduce of device tensors), which a model on the meta
                # device (the streamed conversion's) cannot do. The layout is no loss: the
                # checkpoint reshards on load into any pipeline layout.
                raise ValueError(
                    f"--pp {parallel.pipeline}: {args.hf_dir} ties its word embeddings "
                    "(tie_word_embeddings), which hf-to-mcore converts with --pp 1 only; the "
                    "checkpoint then loads into any pipeline layout"
                )
            hf.hf_to_mcore(args.hf_dir, args.out_dir, parallel, args.dtype)
            print(
                f"wrote a megatron dist checkpoint (TP {args.tp}, PP {args.pp}, EP {args.ep}; "
                f"it reshards on load) to {args.out_dir}",
                flush=True,
            )
        else:
            ckpt = model_checkpoint_dir(args.ckpt_dir)
            hf.mcore_to_hf(str(ckpt), args.out_dir, args.dtype)
            print(f"wrote an HF model directory from {ckpt} to {args.out_dir}", flush=True)
    except ValueError as err:
        print(f"megatron-rl convert: error: {err}", file=sys.stderr)
        return 2
    return 0


def model_checkpoint_dir(path: str | Path) -> Path:
    """The model checkpoint that ``path`` names: itself (it holds ``hf_config/config.json``),
    a step directory's ``model/``, or a run directory's newest intact step's ``model/``."""
    from megatron_rl.conversion.checkpoint import HF_CONFIG_SUBDIR

    path = Path(path)
    if (path / HF_CONFIG_SUBDIR / "config.json").is_file():
        return path
    if (path / "model" / HF_CONFIG_SUBDIR / "config.json").is_file():
        return path / "model"
    if (path / "checkpoints").is_dir():
        from megatron_rl.trainer.state import CheckpointManager

        latest = CheckpointManager(path).latest()
        if latest is None:
            raise ValueError(f"{path}: a run directory without an intact checkpoint")
        logger.info("mcore-to-hf: %s: its newest intact checkpoint is %s", path, latest.name)
        return latest / "model"
    raise ValueError(
        f"{path}: not a megatron_rl model checkpoint: expected a run directory, a step directory "
        f"(RUN_DIR/checkpoints/step_N) or its model/ directory (with {HF_CONFIG_SUBDIR}/config.json)"
    )
