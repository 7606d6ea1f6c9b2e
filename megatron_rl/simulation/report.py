"""Tables and the utilisation-vs-k plot of simulated runs."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.simulation.run import SimResult

HEADER = (
    "| mode | k | s/step | gen busy | gen occupancy | trainer busy | push | "
    "lag p50/p90/p99/max | samples/GPU-h | GPU-h ({steps} steps) |"
)


def label(result: SimResult) -> str:
    s = result.settings
    return "PipelineRL" if s.mode == "pipeline_rl" else "PPO-off-policy"


def markdown_table(results: list[SimResult], max_steps: int) -> str:
    """One Markdown row per simulated run."""
    lines = [HEADER.format(steps=max_steps), "|" + "---|" * 10]
    for r in results:
        lags = "/".join(str(r.lag_percentile(q)) for q in (0.5, 0.9, 0.99)) + f"/{r.max_lag}"
        lines.append(
            f"| {label(r)} | {r.settings.k} | {r.seconds_per_step:.1f} | "
            f"{r.generator_busy:.1%} | {r.generator_occupancy:.1%} | {r.trainer_busy:.1%} | "
            f"{r.push_fraction:.1%} | {lags} | {r.samples_per_gpu_hour:.0f} | "
            f"{r.gpu_hours(max_steps):,.0f} |"
        )
    return "\n".join(lines)


def plot_utilisation(runs: dict[str, list[SimResult]], path: str | Path) -> Path:
    """Generator occupancy, generator busy and trainer busy vs k, one panel per recipe
    (PipelineRL solid, PPO-off-policy dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.2), squeeze=False)
    for ax, (name, results) in zip(axes[0], runs.items()):
        for mode, style in (("pipeline_rl", "-"), ("ppo", "--")):
            rs = sorted((r for r in results if r.settings.mode == mode), key=lambda r: r.settings.k)
            if not rs:
                continue
            ks = [r.settings.k for r in rs]
            tag = "PipelineRL" if mode == "pipeline_rl" else "PPO"
            ax.plot(
                ks,
                [r.generator_occupancy for r in rs],
                "o" + style,
                color="C0",
                label=f"{tag}: generator occupancy",
            )
            ax.plot(
                ks,
                [r.generator_busy for r in rs],
                "s" + style,
                color="C1",
                label=f"{tag}: generator busy",
            )
            ax.plot(
                ks,
                [r.trainer_busy for r in rs],
                "^" + style,
                color="C2",
                label=f"{tag}: trainer busy",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k (max lag / PPO minibatches)")
        ax.set_ylabel("fraction")
        ax.set_ylim(0, 1.05)
        ax.set_title(name)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# The papers' runs the predictions are set against (docs/paper.md section 3): steps, GPUs and
# GPU-hours (source: arXiv 2510.13786; the 8B run's 608 s a step is 100k GPU-h / 7,400 / 80).
# The paper gives no Scout cluster: 128 GPUs is our recipe's (its s/step follows from that).
PAPER_RUNS = {
    "llama3-8b": {"steps": 7400, "gpus": 80, "gpu_hours": 100_000},
    "llama4-scout": {"steps": 7100, "gpus": 128, "gpu_hours": 50_000},
}


def _factor_lines(factors: dict[str, float]) -> list[str]:
    from megatron_rl.simulation.calibration import CASES

    fit = [c.name for c in CASES if c.role == "fit"]
    dense = "; ".join(n for n in fit if "Qwen3" not in n)
    moe = "; ".join(n for n in fit if "Qwen3" in n)
    return [
        f"- generation_efficiency = {factors['generation_efficiency']:.3f} of the roofline "
        f"(HBM at {0.7 * factors['generation_efficiency']:.0%} of peak), fitted on: {dense}",
        f"- train_mfu_dense = {factors['train_mfu_dense']:.3f}, fitted on: {dense}",
        f"- train_mfu_moe = {factors['train_mfu_moe']:.3f}, fitted on: {moe} (with the two above)",
    ]


def calibration_table(rows) -> str:
    lines = [
        "| case | role | metric | published | predicted | predicted / published | within 25% |",
        "|" + "---|" * 7,
    ]
    for r in rows:
        lines.append(
            f"| {r.case} | {r.role} | {r.metric} | {r.published:,.1f} | {r.predicted:,.1f} | "
            f"{r.ratio:.2f} | {'yes' if r.within else 'NO'} |"
        )
    return "\n".join(lines)


def _recipe_lines(config, residual: float, trained_fraction: float = 1.0) -> list[str]:
    from megatron_rl.simulation import predict
    from megatron_rl.simulation.costs import cost_model
    from megatron_rl.simulation.run import settings_from_config, simulate
    from megatron_rl.simulation.workload import length_model

    name = config.model.preset or config.model.hf_path
    paper = PAPER_RUNS.get(name)
    steps, gpus = config.training.max_steps, config.cluster.trainer_gpus
    gpus += config.cluster.generator_gpus
    hours = lambda s: s * steps * gpus / 3600  # noqa: E731
    k = config.off_policy.max_lag
    base = cost_model(config, "gb200")
    limit = simulate(
        base,
        length_model(config),
        settings_from_config(config, "pipeline_rl", k, steps=24, warmup=5),
    ).seconds_per_step
    kw = dict(trained_fraction=trained_fraction)
    central = predict.run(config, base.calibrated(), **kw).seconds_per_step
    lo, hi = predict.expected_range(config, base, residual, **kw)
    out = [
        f"\n### {name}: PipelineRL-{k}, {gpus} GB200, {steps:,} steps",
        "",
        "| model | s/step | GPU-hours |",
        "|---|---|---|",
        f"| physical limit (roofline) | {limit:.1f} | {hours(limit):,.0f} |",
        f"| expected (calibrated, items 2-4 done) | {central:.1f} "
        f"(range {lo:.1f}-{hi:.1f}) | {hours(central):,.0f} "
        f"({hours(lo):,.0f}-{hours(hi):,.0f}) |",
    ]
    if paper:
        paper_s = paper["gpu_hours"] * 3600 / paper["steps"] / paper["gpus"]
        out.append(f"| the paper | {paper_s:.0f} | {paper['gpu_hours']:,} |")
        cap = predict.run(config, base.calibrated(), think_median=1e6, **kw).seconds_per_step
        at_cap = "with every sample thinking to its budget (~11k + answer) the calibrated model "
        at_cap += f"takes {cap:.0f} s a step"
        if cap < paper_s:
            why = (
                f"Lengths alone do not explain it: {at_cap} ({paper_s / cap:.1f}x short). What "
                f"would: generators far below vLLM's calibrated speed (its engines are not "
                f"named), idle time (pipeline stalls, validation every 100 steps: +16k samples, "
                f"checkpoints, restarts) or GPU-hours counted beyond the steps' own."
            )
        else:
            why = f"Longer responses than our length model's could explain it: {at_cap}."
        out += ["", f"The paper's step is {paper_s / central:.1f}x the expected one. {why}"]
    if name == "llama3-8b" and paper:
        out += [
            "",
            f"What issue 31's items 2-4 move (calibrated model, central lengths, "
            f"{trained_fraction:.0%} of the groups trained on):",
            "",
            "| our code | s/step | GPU-hours | % of the paper's | generator busy | "
            "trainer busy | push |",
            "|" + "---|" * 7,
        ]
        for label, switches in predict.WHAT_IFS.items():
            r = predict.run(config, base.calibrated(), switches=switches, **kw)
            s = r.seconds_per_step
            out.append(
                f"| {label} | {s:.1f} | {hours(s):,.0f} | "
                f"{hours(s) / paper['gpu_hours']:.1%} | {r.generator_busy:.0%} | "
                f"{r.trainer_busy:.0%} | {r.push_fraction:.0%} |"
            )
    return out


def calibration_report(recipes, refit: bool = False, trained_fraction: float = 1.0):
    """The calibration table (published vs predicted), the fitted factors with the cases that
    fit them, and per recipe the physical limit, the expected cost with its range and the
    paper's; at 8B what items 2-4 move. Returns (Markdown text, rows)."""
    from megatron_rl.simulation import calibration
    from megatron_rl.simulation.costs import CALIBRATED

    factors = calibration.fit(CALIBRATED) if refit else CALIBRATED
    roles = ("fit", "check", "reference") if recipes else ("fit", "check")
    rows = calibration.evaluate(factors, roles)
    residual = max(abs(r.ratio - 1) for r in rows if r.role != "reference")
    out = ["## Calibration: published runs vs the simulator (expected model)", ""]
    out.append(calibration_table(rows))
    out += ["", "Setups and sources:"]
    for r in rows:
        details = ", ".join(f"{k} {v:,.2f}" for k, v in r.details.items())
        out.append(f"- {r.case}: {r.note}. Simulated: {details}. Source: {r.source}")
    out += ["", "Fitted factors (`costs.CALIBRATED`):", *_factor_lines(factors)]
    out.append(
        f"\nRanges below: the factors scaled by the worst residual ({residual:.0%}) either way "
        f"and median thinking of {' and '.join(f'{t:,.0f}' for t in _think_medians())} tokens."
    )
    for config in recipes:
        out += _recipe_lines(config, residual, trained_fraction)
    return "\n".join(out), rows


def _think_medians():
    from megatron_rl.simulation.predict import THINK_MEDIANS

    return THINK_MEDIANS


def plot_calibration(rows, path: str | Path) -> Path:
    """Predicted / published per calibration case, with the +-25% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.6))
    ys = list(range(len(rows)))[::-1]
    colors = [{"fit": "C0", "check": "C2"}.get(r.role, "C3") for r in rows]
    ax.barh(ys, [r.ratio for r in rows], color=colors, height=0.6)
    ax.axvline(1.0, color="k", lw=1)
    ax.axvspan(0.75, 1.25, color="0.9", zorder=0)
    ax.set_yticks(ys, [f"{r.case}\n({r.metric}: {r.published:,.1f})" for r in rows], fontsize=7)
    ax.set_xlabel(
        "predicted / published (blue: fit, green: check, red: not reproduced; band: +-25%)"
    )
    ax.set_xlim(0, 2)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# What the predictions in tools/README.md are computed from: the simulator, the scheduler it
# drives, the recipes it predicts. A change to any of them leaves the README's block stale
# until `tools/simulate_run.py --calibrate --write-readme` rewrites it (minutes, so not in CI:
# tests/unit/project compares this digest with the one the block records).
PREDICTION_INPUTS = (
    "megatron_rl/simulation/*.py",
    "megatron_rl/trainer/rollout_source.py",
    "recipes/base_scalerl.yaml",
    "recipes/scalerl_8b.yaml",
    "recipes/scalerl_scout.yaml",
)


def prediction_inputs_digest(root) -> str:
    """sha256 (16 hex digits) of :data:`PREDICTION_INPUTS` under the repository ``root``."""
    import hashlib
    from pathlib import Path

    digest = hashlib.sha256()
    for pattern in PREDICTION_INPUTS:
        for path in sorted(Path(root).glob(pattern)):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
