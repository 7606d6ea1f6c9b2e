"""A plan as tables: rich for the terminal, Markdown for docs (docs/planning.md)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.planning.gpus import GiB
from megatron_rl.planning.plan import Plan, TrainerPlan


@dataclass(frozen=True)
class Row:
    """One line of a table: what, bytes (None: a note-only line), how it is counted."""

    label: str
    bytes: int | None
    note: str = ""


def gb(n: int) -> str:
    """Bytes as GiB (2**30), as torch and vLLM print memory."""
    return f"{n / GiB:.1f}"


def verdict(headroom: float, target: float) -> str:
    """'fits', 'tight' (fits, less headroom than asked) or 'does not fit'."""
    if headroom >= target:
        return "fits"
    return "tight" if headroom >= 0 else "does not fit"


def describe_trainer(plan: Plan, trainer: TrainerPlan) -> str:
    lay = trainer.layout
    expert = f", expert-DP {trainer.expert_dp}" if plan.shapes.is_moe else ""
    return f"{lay.describe()}, DP {trainer.dp}{expert}"


def trainer_rows(plan: Plan, trainer: TrainerPlan | None = None) -> list[Row]:
    """The trainer GPU's table (the recipe's layout unless ``trainer`` is given)."""
    t = trainer or plan.trainer
    st, act = t.states, t.activations
    shard = f"sharded over DP {t.dp}" + (
        f" / expert-DP {t.expert_dp}" if plan.shapes.is_moe else ""
    )
    stage = f" (pipeline stage {t.stage})" if t.layout.pipeline > 1 else ""
    rows = [
        Row("weights", st.params, f"model dtype{stage}"),
        Row("gradients", st.grads, "fp32 DDP buffers (grad_reduce_in_fp32)"),
        Row("optimizer: fp32 main params", st.main_params, shard),
        Row("optimizer: Adam moments", st.moments + st.steps, f"2 x fp32, {shard}"),
    ]
    names = {
        "attention": "activations: attention",
        "mlp": "activations: dense MLP",
        "moe": "activations: MoE",
        "layer inputs": "activations: layer inputs (recompute)",
        "embedding": "activations: token ids",
        "head": "activations: FP32 head (logits, log-softmax)",
    }
    flight = f", x {act.in_flight} micro-batches in flight" if act.in_flight > 1 else ""
    for key, value in act.saved.items():
        if value * act.in_flight >= GiB // 20:  # below 0.05 GiB: in the total, not a row
            rows.append(Row(names[key], value * act.in_flight, f"saved for backward{flight}"))
    rows.append(Row("activations: transient", act.transient, act.transient_what))
    push_note = "rank 0 streams one full layer + two buckets, between steps"
    if t.push_extra > act.peak:
        rows.append(Row("weight push, beyond activations", t.push_extra - act.peak, push_note))
    else:
        note = f"{gb(t.push_extra)} GiB ({push_note}): within the activations' place"
        rows.append(Row("weight push", None, note))
    if t.nvls:
        rows.append(Row("NVLS buffers (estimate)", t.nvls, "NCCL groups of > 1 rank using NVLS"))
    if t.transfer:
        rows.append(
            Row(
                "weight-transfer NCCL buffers (estimate)",
                t.transfer,
                "nccl_m2n: a communicator per engine x its workers (NCCL_BUFFSIZE per channel)",
            )
        )
    rows.append(Row("allocator fragmentation (estimate)", t.fragmentation, "of the activations"))
    rows.append(Row("runtime reserve", t.reserve, "CUDA context, NCCL (estimate)"))
    return rows


def engine_rows(plan: Plan) -> list[Row]:
    e = plan.engine.bytes
    notes = {
        "weights": "model dtype, split over rollout.tensor_parallel"
        if not e.quantization
        else f"rollout.quantization {e.quantization}: linear layers in FP8 + scales, "
        f"{gb(e.fp8_freed)} GiB less than the model dtype; split over rollout.tensor_parallel",
        "KV cache": f"rollout.kv_cache_gb: {e.sequences_in_kv} full-length sequences",
        "weight receive buffers": f"2 x (bucket + {e.largest_tensor})",
        "FP8 reload workspace (estimate)": "a push quantizes one layer at a time on the engine",
        "forward workspace (estimate)": "16384 batched tokens + sampler logits",
        "CUDA graphs (estimate)": f"{e.graph_captures} captures (vLLM's default sizes)"
        if e.graph_captures
        else "rollout.enforce_eager: none",
        "NVLS buffers (estimate)": "cluster.engine_nccl_nvls",
        "allocator fragmentation (estimate)": "of the workspace",
    }
    rows = [Row(k, v, notes[k]) for k, v in e.parts.items() if v or k == "CUDA graphs (estimate)"]
    if plan.engine.transfer:
        note = "nccl_m2n: its communicator x the trainer's source ranks (NCCL_BUFFSIZE)"
        rows.append(Row("weight-transfer NCCL buffers (estimate)", plan.engine.transfer, note))
    rows.append(Row("runtime reserve", plan.engine.reserve, "CUDA context, NCCL (estimate)"))
    return rows


def episode_rows(plan: Plan) -> list[tuple[str, str, str]]:
    """The episode table (multi-turn runs; empty otherwise): what, tokens, how it is counted
    (``megatron_rl.planning.episodes``)."""
    e = plan.episode
    if e is None:
        return []
    per_node = e.tool_workers * plan.engines_per_node
    return [
        (
            "turns / tool calls",
            f"{e.max_turns} / {e.calls}",
            f"rollout.max_turns; {e.environment}, tool format {e.tool_format}",
        ),
        ("episode budget", str(e.budget), "rollout.max_tokens: model and tool tokens together"),
        (
            "longest sequence",
            str(e.longest_sequence),
            f"prompt {e.prompt} + longest response: micro-batches and a request's KV, as "
            "single-turn",
        ),
        (
            "tool tokens (prefilled, never decoded)",
            f"<= {e.tool_tokens}",
            f"{e.calls} x max_tool_output_tokens (wrappers apart): {e.tool_share:.0%} of the budget",
        ),
        ("model tokens (decoded)", f">= {e.model_tokens}", "when every call returns its most"),
        (
            "prefill, prefix-cache hits",
            f"<= {e.prefill_cached}",
            f"prompt + tool tokens + a KV block ({e.block}) per later turn"
            if e.prefix_caching
            else "prefix caching off: every turn prefills its whole context",
        ),
        (
            "prefill, no hits",
            f"<= {e.prefill_uncached}",
            f"prompt + {e.calls} x the longest context ({e.prefill_growth:.1f}x): eviction, or "
            "a push with kv_on_push recompute",
        ),
        (
            "tool calls at once",
            f"{e.tool_workers} / {per_node}",
            f"per engine / per engine node (rollout.environment.tool_workers); each <= "
            f"{e.tool_timeout_s:g} s",
        ),
        (
            "tool sandboxes' host memory (GiB)",
            f"{gb(e.tool_memory_bytes)} / {gb(e.tool_memory_bytes * plan.engines_per_node)}",
            "per engine / per engine node at most: tool_workers x tool_memory_mb",
        ),
    ]


def notes(plan: Plan) -> list[str]:
    """Caveats that apply to this plan."""
    out = []
    if plan.shapes.is_moe:
        out.append(
            "MoE activations assume balanced routing (--expert-load scales the busiest rank)."
        )
    e = plan.engine.bytes
    concurrency = e.sequences_in_kv
    if concurrency and concurrency < plan.max_num_seqs:
        out.append(
            f"The engines' KV cache holds {concurrency} sequences of max_model_len; vLLM "
            f"queues or preempts beyond that (max_num_seqs {plan.max_num_seqs})."
        )
        if plan.episode is not None and plan.episode.prefix_caching:
            out.append(
                "An episode waiting on a tool keeps its context only in the prefix cache, "
                "whose blocks running sequences take first when the KV cache is short: "
                "expect long episodes' later turns to be prefilled whole."
            )
    if fp8_kv_cache_bytes(e) > e.kv_cache:
        out.append(fp8_kv_note(e))
    if plan.engine_fix is not None:
        changes, fixed = plan.engine_fix
        out.append(
            f"The engines fit with {' '.join(f'`{c}`' for c in changes)}: "
            f"{gb(fixed.total)} GiB, {fixed.headroom:.0%} headroom, "
            f"{fixed.bytes.sequences_in_kv} full-length sequences in the KV cache."
        )
    elif not plan.engine_fits:
        out.append(
            "No smaller KV cache or twice the engines' tensor parallelism makes the engines "
            "fit with the headroom: use GPUs with more memory, or shorter sequences."
        )
    return out


def fp8_kv_cache_bytes(e) -> int:
    """The KV cache (``rollout.kv_cache_gb``, bytes) that FP8 rollouts leave room for at the
    total of the same plan without them: the weight bytes they free (``fp8_freed``) less the
    FP8 reload workspace they add (a push quantizes on the engine; a part of the FP8 plan's
    total that the unquantized plan does not have)."""
    return e.kv_cache + e.fp8_freed - e.reload_workspace


def fp8_kv_note(e) -> str:
    """Where the weight bytes FP8 rollouts free go: the KV cache, at the same total as
    without FP8 (:func:`fp8_kv_cache_bytes`)."""
    grown = fp8_kv_cache_bytes(e)
    sequences = grown // e.kv_bytes_per_sequence if e.kv_bytes_per_sequence else 0
    return (
        f"FP8 weights (rollout.quantization {e.quantization}) free {gb(e.fp8_freed)} GiB per "
        f"engine GPU, {gb(e.fp8_freed - e.reload_workspace)} GiB net of the FP8 reload "
        "workspace: at the total of the unquantized plan, rollout.kv_cache_gb can grow from "
        f"{e.kv_cache / GiB:g} to {grown / GiB:.2f} ({e.sequences_in_kv} -> {sequences} "
        "full-length sequences)."
    )


def _md_table(rows: list[Row], total: int, capacity: int, target: float) -> list[str]:
    lines = ["| part | GiB | how |", "|---|---:|---|"]
    for r in rows:
        lines.append(f"| {r.label} | {'' if r.bytes is None else gb(r.bytes)} | {r.note} |")
    headroom = 1 - total / capacity
    lines.append(
        f"| **total** | **{gb(total)}** | of {gb(capacity)} GiB: {headroom:.0%} headroom, "
        f"{verdict(headroom, target)} |"
    )
    return lines


def markdown(plan: Plan, alternatives: int = 5) -> str:
    """The plan as Markdown (trainer table, engine table, smallest fitting change)."""
    t = plan.trainer
    lines = [
        f"**{plan.name}**: {plan.shapes.name} ({plan.shapes.total_parameters() / 1e9:.1f}B "
        f"parameters) on {plan.gpu.name.upper()} ({gb(plan.gpu.memory_bytes)} GiB); micro-batch "
        f"{plan.tokens} tokens ({plan.tokens // plan.seq_len} x {plan.seq_len}).",
        "",
        f"Trainer GPU ({plan.trainer_gpus} GPUs: {describe_trainer(plan, t)}):",
        "",
        *_md_table(trainer_rows(plan), t.total, t.capacity, plan.headroom_target),
        "",
        f"Engine GPU ({plan.engines} engines x TP {plan.engine_tp}):",
        "",
        *_md_table(
            engine_rows(plan), plan.engine.total, plan.engine.capacity, plan.headroom_target
        ),
    ]
    episode = episode_rows(plan)
    if episode:
        lines += ["", "Episodes (tokens per episode):", "", "| what | tokens | how |"]
        lines += ["|---|---:|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in episode]
    if plan.alternatives and not plan.trainer_fits:
        lines += ["", "Layouts that fit, smallest change first:", ""]
        lines += alternatives_md(plan, alternatives)
    extra = notes(plan)
    if extra:
        lines += [""] + [f"- {n}" for n in extra]
    return "\n".join(lines) + "\n"


def alternatives_md(plan: Plan, count: int) -> list[str]:
    current = plan.trainer.layout
    lines = ["| change | layout | GiB | headroom |", "|---|---|---:|---:|"]
    for alt in plan.alternatives[:count]:
        keys = " ".join(f"`{k}={_yaml(v)}`" for k, v in alt.layout.changes_from(current).items())
        lines.append(
            f"| {keys} | {describe_trainer(plan, alt)} | {gb(alt.total)} | {alt.headroom:.0%} |"
        )
    return lines


def _yaml(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _rich_table(plan: Plan, title: str, rows: list[Row], total: int):
    from rich.table import Table

    tab = Table(title=title, title_justify="left")
    tab.add_column("part")
    tab.add_column("GiB", justify="right")
    tab.add_column("how")
    for r in rows:
        tab.add_row(r.label, "" if r.bytes is None else gb(r.bytes), r.note)
    capacity = plan.gpu.memory_bytes
    headroom = 1 - total / capacity
    word = verdict(headroom, plan.headroom_target)
    color = {"fits": "green", "tight": "yellow", "does not fit": "red"}[word]
    tab.add_row(
        "[bold]total[/]",
        f"[bold]{gb(total)}[/]",
        f"[{color}]{word}[/]: {headroom:.0%} headroom of {gb(capacity)} GiB "
        f"(target {plan.headroom_target:.0%})",
    )
    return tab


def print_rich(plan: Plan, alternatives: int = 5) -> None:
    """The plan as rich tables on stdout."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = plan.trainer
    console.print(
        f"[bold]{plan.name}[/]: {plan.shapes.name} "
        f"({plan.shapes.total_parameters() / 1e9:.1f}B parameters) on "
        f"{plan.gpu.name.upper()} ({gb(plan.gpu.memory_bytes)} GiB, {plan.gpu.source}); "
        f"micro-batch {plan.tokens} tokens ({plan.tokens // plan.seq_len} x {plan.seq_len})"
    )

    title = f"Trainer GPU: {plan.trainer_gpus} GPUs, {describe_trainer(plan, t)}"
    console.print(_rich_table(plan, title, trainer_rows(plan), t.total))
    title = f"Engine GPU: {plan.engines} engines x TP {plan.engine_tp}"
    console.print(_rich_table(plan, title, engine_rows(plan), plan.engine.total))
    episode = episode_rows(plan)
    if episode:
        tab = Table(title="Episodes (tokens per episode)", title_justify="left")
        tab.add_column("what")
        tab.add_column("tokens", justify="right")
        tab.add_column("how")
        for row in episode:
            tab.add_row(*row)
        console.print(tab)
    if not plan.trainer_fits:
        if plan.suggestion is None:
            console.print("[red]No layout of these GPUs fits.[/]")
        else:
            s = plan.suggestion
            keys = " ".join(f"{k}={_yaml(v)}" for k, v in s.layout.changes_from(t.layout).items())
            console.print(
                f"[bold]Smallest change that fits:[/] {keys}  ->  {gb(s.total)} GiB, "
                f"{s.headroom:.0%} headroom"
            )
            alt = Table(title="Layouts that fit, smallest change first", title_justify="left")
            for col in ("change", "layout", "GiB", "headroom"):
                alt.add_column(col, justify="right" if col in ("GiB", "headroom") else "left")
            for a in plan.alternatives[:alternatives]:
                keys = " ".join(
                    f"{k}={_yaml(v)}" for k, v in a.layout.changes_from(t.layout).items()
                )
                alt.add_row(keys, describe_trainer(plan, a), gb(a.total), f"{a.headroom:.0%}")
            console.print(alt)
    for n in notes(plan):
        console.print(f"note: {n}")
