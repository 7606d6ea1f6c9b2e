"""Public model outputs with their harness's verdicts, as a file for ``megatron-rl reward-audit``.

Source: https://github.com/microsoft/ToRA (MIT), ``src/outputs/llm-agents/<model>/gsm8k/
test_tora_-1_seed0_t0.0_s0_e1319.jsonl``: the released GSM8K test outputs of ToRA-70B and
ToRA-Code-34B (tool-integrated reasoning: a program, its output, then a boxed answer), with
ToRA's own extracted answer (``pred``) and the reference (``gt``). The files carry no per-row
score; ToRA's harness scores GSM8K by ``math_equal(pred, gt)``, which for these numeric
references is: equal within a relative 1e-4, or equal to gt/100 or gt*100 (its percentage
tolerance). That verdict is the ``label`` written here; it reproduces the mean score of each
model's ``.metrics`` file exactly (84.3 and 80.7), which this tool checks.

Each output row: ``response`` (the model's whole text), ``reference`` (gt), ``label`` (ToRA's
verdict), ``domain`` (math), ``model``, ``idx``, and ``tora_pred`` (ToRA's extraction). The
first line is a ``#`` comment naming the source and commit (reward-audit skips it).

Usage: python tools/build_tora_audit_file.py GIT_DIR [--rows N] [--out FILE]
(GIT_DIR: a clone or mirror of microsoft/ToRA; HEAD is read. --rows N keeps the first N rows
of each model: the test slice in tests/data is built with --rows 60).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path

REPOSITORY = "https://github.com/microsoft/ToRA"
OUTPUTS = "src/outputs/llm-agents/{model}/gsm8k/test_tora_-1_seed0_t0.0_s0_e1319"
MODELS = {"tora-70b-v1.0": 84.3, "tora-code-34b-v1.0": 80.7}  # their .metrics mean scores


def _number(text: str) -> float | None:
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return None


def tora_verdict(pred: str, gt: str) -> bool:
    """ToRA's ``math_equal`` on a numeric GSM8K reference (its percentage tolerance kept)."""
    p, g = _number(pred), _number(gt)
    if p is None or g is None:
        return False
    return any(math.isclose(p, x, rel_tol=1e-4) for x in (g / 100, g, g * 100))


def _git_show(git_dir: Path, path: str) -> str:
    return subprocess.run(
        ["git", "--git-dir", str(git_dir), "show", f"HEAD:{path}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def build(git_dir: Path, rows: int | None) -> list[str]:
    commit = subprocess.run(
        ["git", "--git-dir", str(git_dir), "rev-parse", "HEAD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    lines = [
        f"# ToRA's released GSM8K test outputs ({', '.join(MODELS)}), {REPOSITORY} @ {commit}, "
        "MIT license; label = ToRA's own verdict (math_equal); built by "
        "tools/build_tora_audit_file.py"
    ]
    for model, published in MODELS.items():
        records = [
            json.loads(x)
            for x in _git_show(git_dir, OUTPUTS.format(model=model) + ".jsonl").splitlines()
        ]
        verdicts = [tora_verdict(r["pred"][0], r["gt"]) for r in records]
        score = round(100 * sum(verdicts) / len(verdicts), 1)
        if score != published:
            raise SystemExit(f"{model}: verdicts score {score}, its .metrics file says {published}")
        for record, verdict in list(zip(records, verdicts, strict=True))[:rows]:
            row = {
                "response": record["code"][0],
                "reference": record["gt"],
                "label": verdict,
                "domain": "math",
                "model": model,
                "idx": record["idx"],
                "tora_pred": record["pred"][0],
            }
            lines.append(json.dumps(row, ensure_ascii=False))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("git_dir", type=Path)
    parser.add_argument("--rows", type=int, default=None, help="first N rows of each model")
    parser.add_argument("--out", type=Path, default=Path("tora_gsm8k_outputs.jsonl"))
    args = parser.parse_args()
    lines = build(args.git_dir, args.rows)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"{len(lines) - 1} rows -> {args.out}")


if __name__ == "__main__":
    main()
