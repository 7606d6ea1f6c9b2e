"""`megatron-rl reward-audit FILE [--domain math|code] [--recipe RECIPE] [reward.key=value ...]`:
check the reward on your own evaluation outputs before a long run.

Scores every row of FILE (JSONL or Parquet: ``response``, ``reference``, optional ``label``
and ``domain``; see ``megatron_rl.rewards.audit``) with the reward of RECIPE (its ``reward``
section; default settings without one; ``reward.key=value`` overrides on top, e.g.
``reward.require_think_end=false`` for outputs of a model without a thinking block), through the reward worker pool and the code sandbox
as in training. With labels it prints the agreement, the disagreements by class and the
slowest rows, and writes the disagreements to a JSONL (``--out``, default beside FILE; checked
writable before scoring). Without labels it prints the distribution of extracted answers and
the rows where nothing was extracted (written to ``--out``). Both say how many rows the reward
paid, and name the cause when rows have no answer because they never close a thinking block.
Exit status: 0 once printed, 2 for a bad file, recipe or ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``megatron-rl reward-audit``."""
    parser.add_argument("file", type=Path, help="evaluation outputs: .jsonl or .parquet")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="reward.key=value",
        help="reward settings on top of the recipe's (or the defaults)",
    )
    parser.add_argument(
        "--domain",
        choices=("math", "code"),
        default="math",
        help="domain of rows without a domain field (default: math)",
    )
    parser.add_argument(
        "--recipe", type=Path, help="take the reward settings from this recipe's reward section"
    )
    parser.add_argument("--workers", type=int, help="reward workers (default: the recipe's)")
    parser.add_argument(
        "--out",
        type=Path,
        help="JSONL of the disagreements (without labels: of the rows where nothing was "
        "extracted); default: FILE.disagreements.jsonl, beside FILE",
    )
    parser.add_argument("--response-field", default="response", help="default: response")
    parser.add_argument("--reference-field", default="reference", help="default: reference")
    parser.add_argument("--label-field", default="label", help="default: label")
    parser.add_argument("--domain-field", default="domain", help="default: domain")
    parser.add_argument("--top", type=int, default=10, help="rows listed per table (default: 10)")


def _error(message: str) -> int:
    print(f"megatron-rl reward-audit: error: {message}", file=sys.stderr)
    return 2


def reward_config(recipe: Path | None, overrides: list[str]):
    """The reward section of ``recipe`` (defaults without one) with ``reward.*`` overrides.
    Raises ConfigError naming a key outside ``reward`` or a bad value."""
    from megatron_rl.config import ConfigError, load_run_config
    from megatron_rl.config.loader import apply_overrides, from_dict
    from megatron_rl.rewards import RewardConfig

    for item in overrides:
        if not item.startswith("reward."):
            raise ConfigError(f"override {item!r}: reward-audit takes reward.* keys only")
    if recipe is not None:
        return load_run_config(recipe, overrides, check_model=False).reward
    return from_dict(RewardConfig, apply_overrides({}, overrides).get("reward", {}), "reward")


def run(args: argparse.Namespace) -> int:
    """Audit and print; returns the exit status."""
    from tqdm import tqdm

    from megatron_rl.config import ConfigError
    from megatron_rl.rewards.audit import Fields, audit, read_rows, write_rows
    from megatron_rl.rewards.isolation import SandboxUnavailableError

    try:
        config = reward_config(args.recipe, args.overrides)
        if args.workers is not None:
            config = dataclasses.replace(config, num_workers=args.workers)
        config.validate()
        fields = Fields(
            args.response_field, args.reference_field, args.label_field, args.domain_field
        )
        rows = read_rows(args.file, args.domain, fields)
        out = args.out or args.file.with_name(f"{args.file.name}.disagreements.jsonl")
        _check_writable(out)
    except (ConfigError, ValueError) as exc:
        return _error(str(exc))
    with tqdm(total=len(rows), desc="scoring", unit="row", file=sys.stderr) as bar:
        try:
            result = audit(rows, config, progress=bar.update)
        except SandboxUnavailableError as exc:
            return _error(str(exc))
    top = max(1, args.top)
    domains = sorted({r.domain for r in rows})
    print(
        f"{len(rows)} rows ({', '.join(domains)}) scored in {result.seconds:.1f}s with "
        f"{config.num_workers} workers"
        + (f", reward settings of {args.recipe}" if args.recipe else ", default reward settings")
        + (f" with {' '.join(args.overrides)}" if args.overrides else "")
    )
    statuses = ", ".join(f"{k} {v}" for k, v in _counts(r.status for r in rows))
    print(f"statuses: {statuses}")
    print(f"rewarded: {len(result.rewarded())} of {len(rows)} rows")
    _print_think_end(result, config)
    if result.labelled:
        _print_labelled(result, top)
        write_rows(out, result.disagreements())
        print(f"\n{len(result.disagreements())} disagreements written to {out}")
    else:
        _print_unlabelled(result, top)
        write_rows(out, result.nothing_extracted())
        print(f"\nrows where nothing was extracted written to {out}")
    _print_slowest(result, top)
    return 0


def _check_writable(out: Path) -> None:
    """ValueError naming ``out`` when the disagreements cannot be written there: checked
    before scoring, so that a long audit is not lost at its end."""
    existed = out.exists()
    try:
        with open(out, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise ValueError(
            f"--out {out}: cannot write the disagreements there ({exc.strerror or exc}); "
            "choose another --out"
        ) from exc
    if not existed:
        out.unlink()


def _print_think_end(result, config) -> None:
    """Name the cause when rows extracted nothing because they never close their thinking."""
    missing = result.without_think_end(config)
    if not missing:
        return
    tag = config.think_end_tag
    print(
        f"no answer read in {len(missing)} of {len(result.rows)} rows because they have no "
        f"{tag!r} (reward.think_end_tag): with reward.require_think_end=true (the default) a "
        "response that never closes its thinking has no answer. If the model writes no "
        "thinking block, run again with reward.require_think_end=false (and set it in the "
        "recipe's reward section)."
    )


def _counts(values) -> list[tuple[str, int]]:
    from collections import Counter

    return Counter(values).most_common()


def _print_labelled(result, top: int) -> None:
    agree, total = result.agreement()
    unlabelled = len(result.rows) - total
    print(
        f"\nagreement with labels: {agree}/{total} = {agree / total:.1%}"
        + (f" ({unlabelled} rows without a label not counted)" if unlabelled else "")
    )
    rewarded_wrong = len(result.by_class()["rewarded_label_wrong"])
    print(f"rewarded where the label says wrong: {rewarded_wrong}")
    print("\ndisagreements by class:")
    print(f"  {'class':<22} {'rows':>5}  first rows")
    for name, members in result.by_class().items():
        first = ", ".join(_short(r) for r in members[:3])
        print(f"  {name:<22} {len(members):>5}  {first}")
    for name, members in result.by_class().items():
        if not members:
            continue
        print(f"\n{name}:")
        for row in members[:top]:
            reference = str(row.reference).replace("\n", " ")[:60]
            extracted = (
                "nothing" if row.extracted is None else repr(row.extracted.replace("\n", " ")[:60])
            )
            print(
                f"  {_short(row)}: label {'correct' if row.label else 'wrong'}, reward "
                f"{row.reward:+g} ({row.status}); extracted {extracted}, reference {reference!r}"
            )


def _print_unlabelled(result, top: int) -> None:
    answers = result.extracted_answers()
    if answers:
        print(f"\nextracted answers ({len(answers)} distinct), most frequent:")
        for answer, count in answers.most_common(top):
            print(f"  {count:>6}  {answer[:80]!r}")
    empty = result.nothing_extracted()
    print(f"\nnothing extracted: {len(empty)} rows")
    for row in empty[:top]:
        tail = row.response[-80:].replace("\n", " ")
        print(f"  {_short(row)}: ...{tail!r}")


def _print_slowest(result, top: int) -> None:
    print("\nslowest rows (seconds to verify; math: in its worker, code: its tests' runs):")
    for row in result.slowest(min(top, 5)):
        print(f"  {row.seconds:8.3f}s  {_short(row)} ({row.domain}, {row.status})")


def _short(row) -> str:
    where = row.name.rsplit(" ", 2)
    label = " ".join(where[-2:]) if len(where) == 3 else row.name
    return f"{label} [{row.id}]" if row.id is not None else label
