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
