#!/usr/bin/env python
"""Generated tokens/s end to end: megatron_rl against TRL's GRPOTrainer on the same CPU setup.

The setup of issue 13's comparison: a random ~75M Llama (hidden 768, 12 layers, 12 query /
4 KV heads of 64, MLP 2048) with the project's character tokenizer, the synthetic arithmetic
prompts of ``recipes/tiny_cpu.yaml``, 8 prompts x 8 samples x at most 64 new tokens a step,
fp32, the zero-variance filter off; no warm start, validation or checkpoints.

- megatron_rl: ``megatron-rl train`` with the recipe's defaults otherwise (PipelineRL-8, an
  in-process vLLM engine, megatron-core update) but for ``TUNED`` (vLLM compiled, 1k-token
  micro-batches); interruptions off, so that both sides generate up to 64 tokens. Tokens:
  the trained samples' response tokens; time: the loop's ``step_seconds`` (generation wait +
  update + push).
- TRL: ``GRPOTrainer`` (transformers ``generate``, its defaults: beta 0, one iteration per
  generation), the same prompts and the same math verifier (``RewardPool``). Tokens:
  ``completions/mean_length`` x 64 per step; time: wall time of each step (it generates,
  scores and updates).

Both skip the first ``--skip`` steps (start-up, first compilation). Needs TRL, which only
this benchmark uses: ``.venv/bin/pip install -e '.[bench]'``, or, leaving the project's
environment as it is, a venv of its own that adds it (``python3.11 -m venv trlenv``; a
``.pth`` file in its site-packages with ``import site;
site.addsitedir('<repo>/.venv/lib/python3.11/site-packages')``; ``trlenv/bin/pip install
--no-deps trl==1.16.0 accelerate``; run this with ``trlenv/bin/python``). On a shared machine
the numbers mean little: run it on a quiet one. Runs on the project's 2-core machine (with
``TUNED``), one each: megatron_rl 127.8 vs TRL 76.5 generated tokens/s = 1.67x (before
continuous generation); 232.7 vs 136.4 = 1.71x (with it, and elastic engines); 208.7 vs 137.8 =
1.51x after issue 29's restructuring and the device-side push (ours alone, same hour: 208 at
the restructuring's start, 223 and 211 after it, 185-209 with the push's prefetch thread).
An A/B of that thread (session 14, alternating runs of the same commit): with it 184.9 and
205.7, without it 183.4 and 198.0 tokens/s: no effect; one commit spreads by about 10%.

    .venv/bin/python tools/bench_vs_trl.py [--steps 8] [--skip 2] [--only ours|trl]
        [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from train_run import ROOT, step_records, train

RECIPE = ROOT / "recipes" / "tiny_cpu.yaml"
PROMPTS, SAMPLES, MAX_TOKENS = 8, 8, 64
MODEL = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 2048,
}
OVERRIDES = [
    "warm_start.steps=0",
    "validation.enabled=false",
    "checkpoint.every_steps=0",
    "checkpoint.save_at_end=false",
    "forecast.enabled=false",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
    f"batch.prompts_per_step={PROMPTS}",
    f"batch.samples_per_prompt={SAMPLES}",
    f"rollout.max_tokens={MAX_TOKENS}",
    f"rollout.max_model_len={16 + MAX_TOKENS + 16}",
    "rollout.interruption.enabled=false",
    "algorithm.zero_variance_filter=false",
]
# megatron_rl's settings for this model (a user's tuning, not the setup): vLLM's compiled CPU
# path (torch.compile with inductor, traced once; the recipe's default is eager, for a fast
# start of the tiny model) and ~1k-token micro-batches (length-sorted: little padding, and
# activations that stay in cache). Measured on the quiet 2-core machine, steps 3-8: 22.9 s a
# step with neither, 19.8 s with both; the samples were the same token for token.
TUNED = ["rollout.enforce_eager=false", "batch.micro_batch_tokens=1024"]


def make_model(out_dir: Path) -> Path:
    """The random 75M Llama with the character tokenizer (seed 0)."""
    from megatron_rl.data.tokenizer import build_char_tokenizer
    from megatron_rl.models.presets import make_hf_model, preset_hf_config

    tokenizer = build_char_tokenizer(out_dir / "tokenizer")
    config = preset_hf_config("tiny-llama", vocab_size=len(tokenizer), **MODEL)
    make_hf_model(config, str(out_dir / "model"), seed=0, tokenizer_dir=str(out_dir / "tokenizer"))
    return out_dir / "model"


def ours(
    hf_dir: Path, steps: int, skip: int, run_dir: Path, extra: Sequence[str] = ()
) -> tuple[float, float]:
    """(tokens, seconds) of megatron_rl's steps after ``skip``; ``extra``: more overrides."""
    overrides = [
        *OVERRIDES,
        *TUNED,
        f"model.hf_path={hf_dir}",
        f"training.max_steps={steps}",
        *extra,
    ]
    records = step_records(train(RECIPE, overrides, run_dir), skip)
    tokens = sum(r["gen_tokens_per_s"] * r["step_seconds"] for r in records)
    return tokens, sum(r["step_seconds"] for r in records)


def trl(hf_dir: Path, steps: int, skip: int, out_dir: Path) -> tuple[float, float]:
    """(tokens, seconds) of TRL's steps after ``skip`` (run in a child process, with the
    thread settings TRL gets by default: not ``megatron-rl``'s OMP_WAIT_POLICY=PASSIVE, which
    would slow ``generate``'s small per-token ops; measured: 42.8 tokens/s with it)."""
    out = out_dir / "trl.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    cmd = [sys.executable, __file__, "--trl-worker", str(hf_dir), str(steps), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"TRL run failed:\n{proc.stderr[-3000:]}")
    per_step = json.loads(out.read_text())[skip:]
    return sum(s["tokens"] for s in per_step), sum(s["seconds"] for s in per_step)


def trl_worker(hf_dir: str, steps: int, out: str) -> None:
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from megatron_rl.config import load_run_config
    from megatron_rl.data import load_prompt_data, render_prompt
    from megatron_rl.rewards.pool import RewardPool

    config = load_run_config(RECIPE, [*OVERRIDES, f"model.hf_path={hf_dir}"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    data = load_prompt_data(config.data, tokenizer)
    rows = [
        {"prompt": render_prompt(p.problem, config.data, tokenizer), "answer": p.answer}
        for p in data.train()
    ]
    rewards = RewardPool(config.reward)

    def reward(completions: list[str], answer: list[str], **_) -> list[float]:
        return rewards.score_batch(completions, answer, ["math"] * len(completions))

    timings: list[dict[str, float]] = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            timings.append({"seconds": time.perf_counter() - self.t0})

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs and timings:
                timings[-1]["tokens"] = logs["completions/mean_length"] * PROMPTS * SAMPLES

    args = GRPOConfig(
        output_dir=str(Path(out).parent / "trl_out"),
        per_device_train_batch_size=PROMPTS * SAMPLES,
        num_generations=SAMPLES,
        max_completion_length=MAX_TOKENS,
        max_steps=steps,
        learning_rate=config.optimizer.lr,
        temperature=config.rollout.temperature,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=config.seed,
        disable_tqdm=True,
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype="float32")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Timer()],
    )
    trainer.train()
    rewards.close()
    Path(out).write_text(json.dumps(timings))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--only", choices=("ours", "trl"))
    parser.add_argument("--set", nargs="*", default=[], help="more overrides for megatron_rl")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = make_model(Path(tmp))
        runs = {"ours": ("megatron_rl", partial(ours, extra=args.set)), "trl": ("TRL", trl)}
        for key, (name, fn) in runs.items():
            if args.only not in (None, key):
                continue
            tokens, seconds = fn(hf_dir, args.steps, args.skip, Path(tmp) / name)
            results[name] = tokens / seconds
            print(
                f"{name:>12}: {results[name]:7.1f} generated tokens/s "
                f"({tokens:.0f} tokens in {seconds:.1f} s, {args.steps - args.skip} steps)",
                flush=True,
            )
    if len(results) == 2:
        print(f"megatron_rl / TRL: {results['megatron_rl'] / results['TRL']:.2f}x")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        trl_worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        sys.exit(main())
