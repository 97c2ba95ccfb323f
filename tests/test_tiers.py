"""Tests for tests/tiers.py: what marks a test system, and the guard that sees a process
started by a test the marks missed."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

from tests import tiers


def _starts_a_python() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def _calls_a_helper_that_does() -> None:
    _starts_a_python()


class _Runner:
    def go(self) -> None:
        _calls_a_helper_that_does()


def _quiet() -> int:
    return len([x * x for x in range(3)])


def test_names_are_followed_through_the_suites_helpers_and_classes() -> None:
    names = tiers._Names()
    assert "subprocess" in names(_calls_a_helper_that_does)
    assert "subprocess" in names(_Runner)
    assert not names(_quiet) & tiers.PROCESS_NAMES


def test_a_test_that_names_a_process_helper_is_system_and_one_that_does_not_is_not() -> None:
    names = tiers._Names()
    assert names(test_the_guard_sees_subprocesses_and_multiprocessing) & tiers.PROCESS_NAMES
    # Naming a helper that starts processes is enough, called or not: the scan errs on the
    # side of the system tier.
    assert names(test_names_are_followed_through_the_suites_helpers_and_classes) & (
        tiers.PROCESS_NAMES
    )
    assert not names(test_an_unmarked_test_that_started_a_process_is_told_what_to_do) & (
        tiers.PROCESS_NAMES
    )


def test_the_guard_sees_subprocesses_and_multiprocessing() -> None:
    with tiers.watch() as started:
        _starts_a_python()
        process = multiprocessing.get_context("spawn").Process(target=_quiet, name="quiet")
        process.start()
        process.join()
    assert [s.split(":")[0] for s in started] == ["subprocess.Popen", "multiprocessing"]
    assert sys.executable in started[0] and "quiet" in started[1]


def test_an_unmarked_test_that_started_a_process_is_told_what_to_do(
    request: pytest.FixtureRequest,
) -> None:
    why = tiers.unmarked_processes(request.node, ["subprocess.Popen: git status"])
    assert why is not None and "is not marked system" in why and "git status" in why
    assert "@pytest.mark.system" in why
    assert tiers.unmarked_processes(request.node, []) is None


def test_every_slow_entry_names_a_test_of_the_suite() -> None:
    here = Path(__file__).parent
    for key in tiers.SLOW:
        module, _, test = key.partition("::")
        source = (here / module).read_text(encoding="utf-8")
        assert f"def {test.partition('[')[0]}(" in source, f"SLOW names no test: {key}"
