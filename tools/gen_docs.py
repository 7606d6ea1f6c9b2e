"""Write the generated references of docs/: ``docs/config.md`` (every recipe key, from the
config dataclasses and their docstrings), ``docs/metrics.md`` (every metrics.jsonl key,
from ``megatron_rl/trainer/metric_keys.py``) and the plans shown in ``docs/planning.md``
(its ``<!-- plan: ... -->`` blocks, from ``megatron-rl plan``).

Usage: python tools/gen_docs.py [--check]

``--check`` writes nothing and exits 1 when a page differs from what the code generates
(``tests/unit/project/test_docs.py`` runs the same comparison).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("gen_docs")


def pages() -> dict[Path, Callable[[], str]]:
    """Generated page -> the function that writes its text."""
    from megatron_rl.config import reference
    from megatron_rl.planning.docs import refresh_plans
    from megatron_rl.trainer import metric_keys

    pages = {
        ROOT / "docs" / "config.md": reference.markdown,
        ROOT / "docs" / "metrics.md": metric_keys.markdown,
    }
    # hand-written, with the plans they show (<!-- plan: ... --> blocks) from the planner
    for name in ("planning.md", "bring-your-own.md"):
        path = ROOT / "docs" / name
        pages[path] = lambda path=path: refresh_plans(path.read_text(), ROOT)
    return pages


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) every generated page; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a page is stale")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stale = []
    for path, make in pages().items():
        text = make()
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        else:
            path.write_text(text)
            logger.info("wrote %s", path.relative_to(ROOT))
    for path in stale:
        logger.error("%s is stale: run python tools/gen_docs.py", path.relative_to(ROOT))
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
