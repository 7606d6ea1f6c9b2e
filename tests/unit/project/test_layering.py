"""The package's layers, read from the source (ast: lazy imports inside functions count):
the rollout wing imports nothing from the trainer or the launcher, the scaling tools nothing
from the trainer; the pools meet one interface (``RolloutClient``), and tests reach the pool
through it, never through its private attributes."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _imports(package: str) -> list[tuple[str, str]]:
    """(file:line, imported module) of every import in ``megatron_rl/<package>``, relative
    imports resolved."""
    found = []
    for path in sorted((ROOT / "megatron_rl" / package).rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        package_parts = module.split(".")[:-1]  # the package a relative import starts from
        where = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(f"{where}:{node.lineno}", a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from .x import y: . is the module's package, .. its parent
                    up = package_parts[: len(package_parts) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names] if base else []
                found += [(f"{where}:{node.lineno}", n) for n in [base, *names] if n]
    return found


def _offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{where} imports {name}"
        for where, name in _imports(package)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("rollout", ("megatron_rl.trainer", "megatron_rl.launch")),
        ("scaling", ("megatron_rl.trainer",)),
        # The rollout loop will use environments (and rollout.config holds their section).
        ("environments", ("megatron_rl.trainer", "megatron_rl.launch", "megatron_rl.rollout")),
    ],
)
def test_a_package_imports_nothing_from_the_layers_above_it(package, forbidden):
    assert _imports(package), "no imports found: the walk is broken"
    assert not _offenders(package, forbidden)


def test_the_pools_collaborators_do_not_import_each_other():
    """The supervisor, the request book and the pusher meet only in the pool's front."""
    collaborators = ("supervisor", "requests", "pusher")
    for name in collaborators:
        others = tuple(f"megatron_rl.rollout.pool.{o}" for o in collaborators if o != name)
        imports = [n for where, n in _imports("rollout/pool") if f"/{name}.py:" in where]
        assert imports, name
        assert not [n for n in imports if n.startswith(others)], name


def test_the_import_walk_sees_lazy_and_relative_imports(tmp_path, monkeypatch):
    """The check itself: an import inside a function and a relative one are both found."""
    pkg = tmp_path / "megatron_rl" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "def f():\n    from megatron_rl.trainer.loop import train\nfrom ..launch import generator\n"
    )
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert sorted(_offenders("demo", ("megatron_rl.trainer", "megatron_rl.launch"))) == [
        "megatron_rl/demo/a.py:2 imports megatron_rl.trainer.loop",
        "megatron_rl/demo/a.py:2 imports megatron_rl.trainer.loop.train",
        "megatron_rl/demo/a.py:3 imports megatron_rl.launch",
        "megatron_rl/demo/a.py:3 imports megatron_rl.launch.generator",
    ]


def _shape(fn) -> list[tuple[str, object, bool]]:
    """A method's parameters as a caller sees them: (name, kind, has a default)."""
    return [
        (p.name, p.kind, p.default is not p.empty)
        for p in inspect.signature(fn).parameters.values()
        if p.kind is not p.KEYWORD_ONLY or p.default is p.empty
    ]


def test_both_pools_meet_the_rollout_client_interface():
    """GeneratorPool (vLLM engines) and the simulator's EmulatedPool take the same calls
    (a pool may add keyword-only options with defaults) and return the same types."""
    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.rollout.pool import GeneratorPool
    from megatron_rl.simulation.engines import EmulatedPool

    methods = [
        "submit",
        "poll",
        "push_weights",
        "reweigh",
        "needs_weights",
        "reset_engine_load",
        "engine_idle_fractions",
    ]
    for pool in (GeneratorPool, EmulatedPool):
        for name in methods:
            want, got = getattr(RolloutClient, name), getattr(pool, name)
            assert [p[:2] for p in _shape(got)] == [p[:2] for p in _shape(want)], (pool, name)
            required = [p[0] for p in _shape(got) if not p[2]]
            assert required == [p[0] for p in _shape(want) if not p[2]], (pool, name)
            hints = inspect.get_annotations(got)
            assert hints.get("return") == inspect.get_annotations(want).get("return"), (
                pool,
                name,
            )


def test_the_emulated_pool_pushes_like_the_real_one():
    """A push advances the version by one (or to the emulator's trainer's count) and
    reports its seconds in PushStats, the cost model's; a reweigh changes nothing."""
    from support.tiny_sim import TINY_LENGTHS, tiny_costs

    from megatron_rl.rollout.client import RolloutClient
    from megatron_rl.rollout.samples import PushStats
    from megatron_rl.simulation.engines import EmulatedPool

    costs = tiny_costs()
    pool = EmulatedPool(costs, TINY_LENGTHS, engines=2, max_num_seqs=4)
    assert isinstance(pool, RolloutClient)
    stats = pool.push_weights(iter([]))
    assert isinstance(stats, PushStats) and stats.version == pool.version == 1
    assert stats.seconds == pytest.approx(costs.push()) and pool.now == pytest.approx(stats.seconds)
    assert pool.push_weights((), version=5).version == pool.version == 5
    assert pool.reweigh(()).version == 5 and pool.pushes == 2
    assert not pool.needs_weights() and pool.engine_idle_fractions() == []


def test_no_test_reaches_into_a_pool():
    """Tests drive a pool through its public interface (``pool._x``: none)."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, (ast.Name, ast.Attribute))
                and "pool" in ast.unparse(node.value).split(".")[-1].lower()
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, "\n".join(offenders)


def test_tests_import_helpers_from_support_or_their_own_directory():
    """A test module imported by another is found only when its directory is on sys.path,
    which depends on what else was collected: shared helpers live in tests/support/."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("test_"):
                if not (path.parent / f"{node.module}.py").exists():
                    offenders.append(f"{path.relative_to(ROOT)}: from {node.module} import ...")
    assert not offenders, offenders
