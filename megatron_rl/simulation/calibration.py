"""Published RL runs the simulator is calibrated on, and the fit of its efficiency factors
(no torch import).

Each ``Case`` rebuilds a published run's setup (model shapes, GPUs per role, engines, batch,
lengths) from its source, simulates it on the real ``RolloutSource`` (``run.simulate``) and
compares one published number with the prediction. Roles:

- ``fit``: the case fits ``costs.CALIBRATED`` (the generation speed as a fraction of the
  roofline and the dense training MFU on two dense cases, then the MoE training MFU on one MoE
  case);
- ``check``: not fitted, must come out within ``TOLERANCE`` of the published number;
- ``reference``: a published number the model does not reproduce; the gap is printed with what
  would explain it, and never tuned away.

Colocated runs (every GPU generates, then every GPU trains: NeMo-RL on-policy, conventional RL)
are PPO-off-policy-1 rounds with the trainer on the engines' GPUs (counted once).

Lengths: the sources give mean lengths and caps, not distributions. Ours: responses
LogNormal(sigma ``SIGMA``), clipped at the cap, with the median solved so that the clipped
mean is the published one (``median_for_mean``); prompts LogNormal(sigma 0.3) around the
published (or derived) prompt length.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_rl.planning.gpus import ENGINE_RUNTIME_RESERVE, GPUS
from megatron_rl.planning.shapes import ModelShapes, shapes_from_fields
from megatron_rl.simulation.costs import CALIBRATED, CostModel, build_cost_model
from megatron_rl.simulation.run import SimResult, SimSettings, simulate
from megatron_rl.simulation.workload import LengthModel

TOLERANCE = 0.25  # issue 31: every calibration case within +-25%
# assumption: response lengths of an RL batch are lognormal with this sigma (a long tail that
# reaches the cap in batches of thousands, as the truncation rates RL papers report)
SIGMA = 0.7
NEMO_URL = "https://docs.nvidia.com/nemo/rl/0.6.0/about/performance-summary.html"
NEMO_V04 = (
    "NeMo-RL performance summary, v0.4 table (docs/about/performance-summary.md at r0.4.0; "
    "recipes examples/configs/recipes/llm/performance/grpo-llama3.1-8b-instruct-2n8g*.yaml)"
)
NEMO_V06 = f"{NEMO_URL}, GB200 BF16 table (recipe grpo-qwen3-30ba3b-4n4g.yaml at v0.6.0)"
PIPELINERL = (
    "Piche et al., PipelineRL: Faster On-policy RL for Long Sequence Generation, "
    "https://arxiv.org/abs/2509.19128 (abstract: 128 H100, ~2x faster learning than "
    "conventional RL; Figure 1a: conventional RL alternates all GPUs between generation and "
    "training); "
    "setup from github.com/ServiceNow/PipelineRL README and conf/base.yaml"
)
SCALERL = "Khatri et al., The Art of Scaling RL Compute for LLMs, arXiv 2510.13786 (docs/paper.md)"

# HF config fields of the calibration models (config.json of each checkpoint).
LLAMA31_8B = dict(  # meta-llama/Llama-3.1-8B-Instruct
    hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, vocab_size=128256, intermediate_size=14336, tie_word_embeddings=False,
)  # fmt: skip
QWEN3_32B = dict(  # Qwen/Qwen3-32B (dense)
    hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, intermediate_size=25600, tie_word_embeddings=False,
)  # fmt: skip
QWEN25_7B = dict(  # Qwen/Qwen2.5-7B
    hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    head_dim=128, vocab_size=152064, intermediate_size=18944, tie_word_embeddings=False,
)  # fmt: skip


def qwen3_30b_a3b() -> ModelShapes:
    """Qwen/Qwen3-30B-A3B (config.json): 48 MoE layers of 128 experts (768 wide), top-8, no
    shared expert, GQA 32/4 x 128, qk-norm, 151,936 vocab: 30.5B total, 3.3B active."""
    n = 48
    return ModelShapes(
        name="Qwen3-30B-A3B", hidden=2048, layers=n, heads=32, kv_heads=4, head_dim=128,
        vocab=151936, ffn=6144, experts=128, topk=8, expert_ffn=768, shared_ffn=0,
        moe=(True,) * n, rope=(True,) * n, qk_norm=(True,) * n, chunk=(None,) * n,
        temperature=(False,) * n, tied_embeddings=False,
    )  # fmt: skip


def _clipped_mean(median: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for X ~ LogNormal(ln median, sigma)."""
    mu = math.log(median)
    phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))  # noqa: E731
    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma**2 / 2) * phi(z - sigma) + cap * (1 - phi(z))


def median_for_mean(mean: float, sigma: float, cap: float) -> float:
    """The median of a lognormal (``sigma``) whose mean, clipped at ``cap``, is ``mean``."""
    if not 0 < mean < cap:
        raise ValueError(f"mean length {mean} must be in (0, cap {cap})")
    lo, hi = 1.0, cap * 100
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if _clipped_mean(mid, sigma, cap) < mean else (lo, mid)
    return math.sqrt(lo * hi)


def lengths(prompt: float, mean_response: float, max_len: int, max_new: int) -> LengthModel:
    """A length model with these means (see module docstring); no thinking budget."""
    cap = min(max_new, max_len - int(prompt))
    return LengthModel(
        max_prompt_tokens=max_len // 2,
        max_tokens=cap,
        thinking_budget=None,
        prompt_median=prompt,
        prompt_sigma=0.3,
        think_median=median_for_mean(mean_response, SIGMA, cap),
        think_sigma=SIGMA,
        answer_median=1.0,  # the whole response is drawn as "thinking"; the answer adds 1
        answer_sigma=0.01,
    )


@dataclass(frozen=True)
class Setup:
    """One simulated run of a case: its cost model (physical limit), lengths, settings, and
    the physical GPUs it uses (colocated runs count their GPUs once)."""

    costs: CostModel
    lengths: LengthModel
    settings: SimSettings
    gpus: int


def expected(costs: CostModel, factors: dict[str, float]) -> CostModel:
    """``costs`` with the expected model's factors (``costs.CALIBRATED``'s keys)."""
    return costs.with_(
        generation_efficiency=factors["generation_efficiency"],
        train_mfu=factors["train_mfu_moe" if costs.moe else "train_mfu_dense"],
    )


def run_setup(setup: Setup, factors: dict[str, float]) -> SimResult:
    return simulate(expected(setup.costs, factors), setup.lengths, setup.settings)


def tokens_per_gpu_second(result: SimResult, setup: Setup) -> float:
    """Prompt + response tokens trained per second per GPU (NeMo-RL's Tokens/sec/GPU)."""
    return result.tokens / result.seconds / setup.gpus


def _kv_bytes(hardware: str, memory_fraction: float, weight_bytes: int) -> int:
    """vLLM's KV cache: ``gpu_memory_utilization`` x memory, less weights and a runtime
    reserve (planning/gpus.py ENGINE_RUNTIME_RESERVE, an assumption)."""
    return int(
        memory_fraction * GPUS[hardware].memory_bytes - weight_bytes - ENGINE_RUNTIME_RESERVE
    )


def nemo_setup(
    shapes: ModelShapes,
    hardware: str,
    *,
    colocated: bool,
    gpus: int,
    generator_gpus: int,
    engine_tp: int,
    prompt: float,
    mean_response: float,
    recompute: bool,
    memory_fraction: float,
    steps: int = 3,
) -> Setup:
    """A NeMo-RL GRPO performance run: 64 prompts x 32 samples a step (G-GBS 2,048, T-GBS 512:
    four optimizer steps), 4,096 tokens at most, prompt and reference log-probs recomputed
    (``reference_policy_kl_penalty`` 0.01 in grpo_math_1B.yaml: two extra forwards), vLLM
    ``max_num_seqs`` 1024 (vLLM's default on >= 70 GB GPUs). On-policy runs are colocated;
    one-step off-policy runs (async GRPO, in-flight weight updates) split the GPUs."""
    trainer_gpus = gpus if colocated else gpus - generator_gpus
    engines = (gpus if colocated else generator_gpus) // engine_tp
    probe = build_cost_model(
        shapes, hardware, engine_tp=engine_tp, engines=engines, trainer_gpus=trainer_gpus,
        kv_cache_bytes=1, max_model_len=4096, recompute=recompute, all_gpus=gpus,
    )  # fmt: skip
    costs = build_cost_model(
        shapes, hardware, engine_tp=engine_tp, engines=engines, trainer_gpus=trainer_gpus,
        kv_cache_bytes=_kv_bytes(hardware, memory_fraction, probe.engine_weight_bytes),
        max_model_len=4096, recompute=recompute, all_gpus=gpus,
    ).with_(logprob_passes=2)  # fmt: skip
    if colocated:  # the refit stays on the GPU (CUDA IPC): no network in the way
        costs = costs.with_(push_link="nvlink")
    settings = SimSettings(
        mode="ppo" if colocated else "pipeline_rl",
        k=1,
        prompts_per_step=64,
        samples_per_prompt=32,
        engines=engines,
        max_num_seqs=1024,
        generator_gpus=gpus if colocated else generator_gpus,
        trainer_gpus=trainer_gpus,
        steps=steps,
        warmup=0 if colocated else 2,
    )
    return Setup(costs, lengths(prompt, mean_response, 4096, 4096), settings, gpus)


def pipelinerl_setup(mode: str, k: int) -> Setup:
    """The PipelineRL paper's setup as far as its public sources give it: Qwen2.5-7B on 128
    H100; PipelineRL on 64 generator + 64 trainer GPUs (conf/base.yaml world: actor_fraction 4,
    finetune_fraction 4), vLLM TP 1 with max-num-seqs 64 (actor.llm_max_rollouts) and
    gpu-memory-utilization 0.9; 1,024 samples an optimizer step (finetune
    gradient_accumulation_passes 1024) of 8 attempts a prompt; max tokens 8,192 (README).
    Conventional RL (the paper's Figure 1a) alternates every GPU between generating k
    optimizer steps' samples and training on them: colocated PPO-off-policy-k.
    Assumptions: mean response 2,000 tokens, prompt 150; DeepSpeed ZeRO-3 trains at the
    calibrated dense MFU, without recompute and extra forwards."""
    shapes = shapes_from_fields(QWEN25_7B, "Qwen2.5-7B")
    colocated = mode == "ppo"
    gpus = 128
    engines = gpus if colocated else 64
    trainer_gpus = gpus if colocated else 64
    probe = build_cost_model(
        shapes, "h100", engine_tp=1, engines=engines, trainer_gpus=trainer_gpus,
        kv_cache_bytes=1, max_model_len=10000, recompute=False, all_gpus=gpus,
    )  # fmt: skip
    costs = build_cost_model(
        shapes, "h100", engine_tp=1, engines=engines, trainer_gpus=trainer_gpus,
        kv_cache_bytes=_kv_bytes("h100", 0.9, probe.engine_weight_bytes),
        max_model_len=10000, recompute=False, all_gpus=gpus,
    )  # fmt: skip
    if colocated:
        costs = costs.with_(push_link="nvlink")
    settings = SimSettings(
        mode=mode,
        k=k,
        prompts_per_step=128,
        samples_per_prompt=8,
        engines=engines,
        max_num_seqs=64,
        generator_gpus=engines,
        trainer_gpus=trainer_gpus,
        steps=2 * k if colocated else 12,
        warmup=0 if colocated else 4,
    )
    return Setup(costs, lengths(150, 2000, 10000, 8192), settings, gpus)


@dataclass
class Row:
    """One case's published and predicted numbers, side by side."""

    case: str
    role: str
    metric: str
    published: float
    predicted: float
    source: str
    note: str = ""
    details: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.predicted / self.published

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1) <= TOLERANCE


@dataclass(frozen=True)
class Case:
    """A published number and how to predict it under given factors."""

    name: str
    role: str  # "fit", "check" or "reference"
    metric: str
    published: float
    source: str
    predict: Callable[[dict[str, float]], tuple[float, dict[str, float]]]
    note: str = ""

    def row(self, factors: dict[str, float]) -> Row:
        value, details = self.predict(factors)
        return Row(self.name, self.role, self.metric, self.published, value, self.source,
                   self.note, details)  # fmt: skip


def _step_seconds(setup_of: Callable[[], Setup]):
    def predict(factors):
        setup = setup_of()
        r = run_setup(setup, factors)
        return r.seconds_per_step, {
            "tokens/s/GPU": tokens_per_gpu_second(r, setup),
            "generator busy": r.generator_busy,
            "trainer busy": r.trainer_busy,
        }

    return predict


def _tokens_per_gpu(setup_of: Callable[[], Setup]):
    def predict(factors):
        setup = setup_of()
        r = run_setup(setup, factors)
        return tokens_per_gpu_second(r, setup), {"s/step": r.seconds_per_step}

    return predict


def _pipelinerl_ratio(factors):
    pipe_setup, conv_setup = pipelinerl_setup("pipeline_rl", 64), pipelinerl_setup("ppo", 8)
    pipe, conv = run_setup(pipe_setup, factors), run_setup(conv_setup, factors)
    rate = lambda r: r.samples / r.seconds  # noqa: E731  (both on 128 GPUs)
    return rate(pipe) / rate(conv), {
        "PipelineRL samples/s": rate(pipe),
        "conventional (G=8) samples/s": rate(conv),
    }


def _llama_on():
    return nemo_setup(shapes_from_fields(LLAMA31_8B, "Llama-3.1-8B"), "h100", colocated=True,
                      gpus=16, generator_gpus=16, engine_tp=1, prompt=132, mean_response=1060,
                      recompute=True, memory_fraction=0.6)  # fmt: skip


def _llama_off():
    return nemo_setup(shapes_from_fields(LLAMA31_8B, "Llama-3.1-8B"), "h100", colocated=False,
                      gpus=16, generator_gpus=8, engine_tp=1, prompt=132, mean_response=1129,
                      recompute=True, memory_fraction=0.8, steps=4)  # fmt: skip


def _qwen3_32b_on():
    return nemo_setup(shapes_from_fields(QWEN3_32B, "Qwen3-32B"), "h100", colocated=True,
                      gpus=32, generator_gpus=32, engine_tp=4, prompt=110, mean_response=3206,
                      recompute=False, memory_fraction=0.6)  # fmt: skip


def _qwen3_32b_off():
    return nemo_setup(shapes_from_fields(QWEN3_32B, "Qwen3-32B"), "h100", colocated=False,
                      gpus=64, generator_gpus=32, engine_tp=4, prompt=110, mean_response=3207,
                      recompute=False, memory_fraction=0.8, steps=4)  # fmt: skip


def _scalerl_8b(factors):
    """The ScaleRL 8B recipe (recipes/scalerl_8b.yaml) on the expected model, our length model,
    issue 31 items 2-4 done."""
    from pathlib import Path

    from megatron_rl.config import load_run_config
    from megatron_rl.simulation import predict
    from megatron_rl.simulation.costs import cost_model

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "scalerl_8b.yaml"
    config = load_run_config(str(recipe), [])
    r = predict.run(config, expected(cost_model(config, "gb200"), factors))
    return r.seconds_per_step, {"generator busy": r.generator_busy, "trainer busy": r.trainer_busy}


def _qwen3_gb200():
    return nemo_setup(qwen3_30b_a3b(), "gb200", colocated=True, gpus=16, generator_gpus=16,
                      engine_tp=1, prompt=99, mean_response=3199, recompute=False,
                      memory_fraction=0.6)  # fmt: skip


def _qwen3_h100():
    return nemo_setup(qwen3_30b_a3b(), "h100", colocated=True, gpus=32, generator_gpus=32,
                      engine_tp=2, prompt=99, mean_response=3203, recompute=False,
                      memory_fraction=0.6)  # fmt: skip


LLAMA_NOTE = (
    "16 H100: 64 prompts x 32 samples (T-GBS 512), Megatron PP 2 x DP 8 with recompute, vLLM "
    "TP 1; on-policy colocated (gpu_memory_utilization 0.6), 1-step off: 8 vLLM + 8 trainer "
    "GPUs (0.8); generated 1,060 / 1,129 tokens, prompt 132 (derived: tokens/s/GPU x 16 x "
    "step / 2,048 - generated)"
)

CASES: tuple[Case, ...] = (
    Case("NeMo-RL v0.4 Llama-3.1-8B on-policy, 16 H100", "fit", "s/step", 97.7, NEMO_V04,
         _step_seconds(_llama_on), LLAMA_NOTE + "; published 1,562 tokens/s/GPU"),
    Case("NeMo-RL v0.4 Llama-3.1-8B 1-step off, 16 H100", "fit", "s/step", 74.6, NEMO_V04,
         _step_seconds(_llama_off), "published 2,161 tokens/s/GPU"),
    Case("NeMo-RL v0.4 Qwen3-32B on-policy, 32 H100", "check", "s/step", 393,
         NEMO_V04.replace("grpo-llama3.1-8b-instruct-2n8g*", "grpo-qwen3-32b-4n8g"),
         _step_seconds(_qwen3_32b_on),
         "dense, not fitted: colocated, vLLM TP 4 x 8, Megatron TP 4 x PP 4 x DP 2 with "
         "sequence parallelism, no recompute; generated 3,206, prompt 110 (derived); published "
         "540 tokens/s/GPU"),
    Case("NeMo-RL v0.4 Qwen3-32B 1-step off, 64 H100", "check", "s/step", 215,
         NEMO_V04.replace("grpo-llama3.1-8b-instruct-2n8g*", "grpo-qwen3-32b-8n8g-async-1off"),
         _step_seconds(_qwen3_32b_off),
         "dense, not fitted: 32 vLLM GPUs (TP 4 x 8, 0.8) + 32 trainer GPUs (TP 4 x PP 4 x DP "
         "2); generated 3,207; published 494 tokens/s/GPU. Both 32B cases come out fast (-16%, "
         "-22%): TP 4 all-reduces and PP 4 bubbles cost a 32B on 4 x 4 ranks more than an 8B "
         "on PP 2, and one MFU does not carry that"),
    Case("NeMo-RL v0.6 Qwen3-30B-A3B on-policy, 16 GB200", "fit", "tokens/s/GPU", 1910,
         NEMO_V06, _tokens_per_gpu(_qwen3_gb200),
         "colocated, vLLM TP 1 x 16, Megatron EP 16, no recompute; generated 3,199, prompt 99 "
         "(derived); published 221 s a step"),
    Case("NeMo-RL v0.6 Qwen3-30B-A3B on-policy, 32 H100", "fit", "tokens/s/GPU", 1102,
         f"{NEMO_URL}, H100 BF16 table (recipe grpo-qwen3-30ba3b-4n8g.yaml at v0.6.0)",
         _tokens_per_gpu(_qwen3_h100),
         "colocated, vLLM TP 2 x 16, Megatron EP 8, no recompute; generated 3,203; published "
         "192 s a step. One MoE MFU fits both within 25%, not either exactly: GB200's update is "
         "not 2.5x H100's (the peak ratio) but 1.7x; small experts (768 wide) and all-to-all "
         "keep it off the FLOP roofline"),
    Case("PipelineRL vs conventional RL (G=8), Qwen2.5-7B, 128 H100", "check",
         "throughput ratio", 2.0, PIPELINERL, _pipelinerl_ratio,
         "the paper's ~2x is learning speed at similar effective sample size to conventional "
         "RL with G=8 (its comparison); equal learning per sample is assumed, so it reads as "
         "throughput. Conventional RL alternates all GPUs (its Figure 1a): colocated. Its body "
         "(lengths, split) was not in the stored sources: repository defaults, lengths assumed; "
         "with G=16 the model gives 1.33"),
    Case("ScaleRL 8B, PipelineRL-8, 16 + 64 GB200", "reference", "s/step", 608, SCALERL,
         _scalerl_8b,
         "100,000 GPU-h / 7,400 steps / 80 GPUs; our length model (median thinking 4,000); not "
         "reproduced: see the 8B section for what would explain the gap"),
)  # fmt: skip


def evaluate(factors: dict[str, float] | None = None, roles=("fit", "check")) -> list[Row]:
    """Every case of ``roles`` under ``factors`` (default: ``costs.CALIBRATED``)."""
    factors = factors or CALIBRATED
    return [c.row(factors) for c in CASES if c.role in roles]


def fit(start: dict[str, float] | None = None, iterations: int = 8) -> dict[str, float]:
    """The factors for which the ``fit`` cases' predictions equal the published numbers:
    generation efficiency and dense MFU on the dense cases (Newton's method on log factors vs
    log predictions, finite differences), then the MoE MFU on the MoE case (its tokens/s/GPU
    falls as the MoE update slows; secant steps)."""
    cases = [c for c in CASES if c.role == "fit" and "Qwen3" not in c.name]
    cases_moe = [c for c in CASES if "Qwen3" in c.name]
    keys = ("generation_efficiency", "train_mfu_dense")
    x = [math.log((start or {}).get(k, v)) for k, v in zip(keys, (0.3, 0.3))]

    def residual(x):
        f = dict(zip(keys, (math.exp(v) for v in x)))
        return [math.log(c.predict(f)[0] / c.published) for c in cases]

    for _ in range(iterations):
        r = residual(x)
        if max(abs(v) for v in r) < 1e-3:
            break
        h = 0.05
        cols = []
        for i in range(2):
            xi = list(x)
            xi[i] += h
            ri = residual(xi)
            cols.append([(a - b) / h for a, b in zip(ri, r)])
        (a, c), (b, d) = cols  # J = [[a, b], [c, d]] (rows: cases, columns: factors)
        det = a * d - b * c
        if abs(det) < 1e-9:
            raise ValueError("calibration: the fit cases do not determine both factors")
        dx = [(d * r[0] - b * r[1]) / det, (-c * r[0] + a * r[1]) / det]
        x = [xi - max(-1.0, min(1.0, di)) for xi, di in zip(x, dx)]
    factors = {k: round(math.exp(v), 4) for k, v in zip(keys, x)}
    # The MoE MFU: least squares over the MoE cases (log residuals), by secant steps.
    moe = [c for c in cases_moe if c.role == "fit"]

    def mean_residual(m: float) -> float:
        f = {**factors, "train_mfu_moe": m}
        return sum(math.log(c.predict(f)[0] / c.published) for c in moe) / len(moe)

    m = (start or {}).get("train_mfu_moe", 0.1)
    for _ in range(iterations):
        r = mean_residual(m)
        if abs(r) < 1e-3:
            break
        slope = (mean_residual(m * 1.05) - r) / math.log(1.05)
        m *= math.exp(-max(-1.0, min(1.0, r / slope)))
    return {**factors, "train_mfu_moe": round(m, 4)}
