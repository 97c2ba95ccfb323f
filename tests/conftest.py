"""Shared test helpers: the exactness criterion used across the suite, the local process
pools the runtime tests share within a module, a fresh interpreter for what an import
loads, the explorer's synthetic profile, and the hooks of the suite's tiers
(tests/tiers.py: the markers make test-fast selects by, and the guard that keeps them
true). HYPOTHESIS_PROFILE picks the hypothesis profile."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import torch

from tests import tiers
from tests.explorer_cases import write_profile
from tplib.runtime import LocalPool

try:
    from hypothesis import settings
except ImportError:  # a GPU node running gpu-check's tests needs no hypothesis
    pass
else:
    # HYPOTHESIS_PROFILE picks one: ci (the default; hypothesis's own example counts) or
    # quick (make test-fast: a few examples each, the property still tried).
    settings.register_profile("ci", deadline=None, print_blob=True)
    settings.register_profile("quick", settings.get_profile("ci"), max_examples=10)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

ROOT = Path(__file__).resolve().parents[1]


def assert_scaled_close(
    actual: torch.Tensor | None, expected: torch.Tensor | None, rel: float = 1e-5, what: str = ""
) -> None:
    """Differences within ``rel`` relative to the scale of ``expected`` (its largest
    magnitude). Both must exist: a missing gradient is a failure, not a pass."""
    assert actual is not None and expected is not None, f"{what}: a tensor is missing"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    assert err <= rel * max(scale, 1e-12), (
        f"{what}: max abs diff {err:.3e} > {rel} x scale {scale:.3e}"
    )


class Pools:
    """Local process pools by world size, each started on first use and closed together:
    ``make(world)`` starts one."""

    def __init__(self, make: Callable[[int], LocalPool] | None = None) -> None:
        self.make = make or (lambda world: LocalPool(world, timeout_s=60))
        self.made: dict[int, LocalPool] = {}

    def __call__(self, world: int) -> LocalPool:
        if world not in self.made:
            self.made[world] = self.make(world)
        return self.made[world]

    def close(self) -> None:
        for pool in self.made.values():
            pool.close()


@pytest.fixture(scope="module")
def pools() -> Iterator[Callable[[int], LocalPool]]:
    """``pools(world)``: a pool of ``world`` local ranks, started once per test module."""
    made = Pools()
    yield made
    made.close()


@pytest.fixture(scope="session")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The explorer tests' synthetic profile (tests/explorer_cases.py), written once."""
    return write_profile(tmp_path_factory.mktemp("profile"))


# What a fresh interpreter runs before a test's code: ``light(*packages)`` fails naming every
# module of ``packages`` loaded so far.
_LIGHT = """\
import sys


def light(*packages):
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in packages)
    assert not loaded, f"loaded {loaded}"


"""


def _fresh_python(code: str, timeout_s: float = 300) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _LIGHT + textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture()
def fresh_python() -> Callable[..., str]:
    """``fresh_python(code)``: ``code`` run by a new interpreter in the checkout, with
    ``light(*packages)`` to check what it has imported so far (only a process that has
    imported nothing else shows what an import costs a user); fails with its stderr unless
    it exits 0, else returns its stdout."""
    return _fresh_python


def code_copy(dest: Path, paths: Sequence[str]) -> Path:
    """The checkout's files under ``paths`` (tracked or not, but not ignored), copied to
    ``dest`` with their modes: a code version of its own, which edits to this checkout
    while a test runs do not change."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z", "--", *paths],
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes((ROOT / rel).read_bytes())
            (dest / rel).chmod((ROOT / rel).stat().st_mode)
    return dest


# ---- tiers: the markers make test-fast selects by (tests/tiers.py) ----------------------

_STARTED = pytest.StashKey[list[str]]()


# First, so that -m selects on these markers too.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tiers.mark(items)


# Watched in setup and call only: a teardown also closes the module's and the session's
# fixtures (their processes ending, a namespace removed), which belong to no one test.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with tiers.watch() as started:
        yield
    item.stash[_STARTED] = started


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with tiers.watch() as started:
        yield
    item.stash[_STARTED] = item.stash.get(_STARTED, []) + started


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    if call.when == "teardown" and report.passed:
        why = tiers.unmarked_processes(item, item.stash.get(_STARTED, []))
        if why is not None:
            report.outcome = "failed"
            report.longrepr = why
