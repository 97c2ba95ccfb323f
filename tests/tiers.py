"""The suite's tiers: the tests that start processes, run notebooks or take long are marked
when collected (tests/conftest.py calls :func:`mark`), so that ``make test-fast`` can leave
them out; and a guard keeps the marks true.

What a test runs is read from its code, not from a list of test names: the test function,
the fixtures it uses, and the functions and classes of ``tests/`` that those name, followed
through their bytecode's names. A test is marked

- ``notebook`` (and ``system``: a kernel is a process) where that code names a notebook
  runner (:data:`NOTEBOOK_NAMES`);
- ``system`` where it names something that starts a process (:data:`PROCESS_NAMES`: the
  standard library's ways, the interpreter's path, and tplib's functions that start
  processes of their own);
- ``slow`` where :data:`SLOW` lists it: a second or more of work in this process, measured.

A test that starts a process and is not marked ``system`` fails at its teardown, naming the
process: an audit hook sees every subprocess and fork of this interpreter, a wrapper every
multiprocessing start. So a new helper that starts processes behind a name this module does
not know is caught the first time the suite runs, not by a fast tier that quietly slows.
"""

from __future__ import annotations

import contextlib
import inspect
import multiprocessing.process
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

__all__ = ["NOTEBOOK_NAMES", "PROCESS_NAMES", "SLOW", "mark", "unmarked_processes", "watch"]

NOTEBOOK_NAMES = frozenset(
    {
        "papermill",
        "execute_notebook",
        "nbclient",
        "NotebookClient",
        "run_job",  # tplib.reproduce.jobs: a table's notebook under papermill
        "sync_playwright",  # the explorer in JupyterLab, in Chromium
    }
)
PROCESS_NAMES = frozenset(
    {
        "subprocess",
        "Popen",
        "executable",  # sys.executable: another interpreter
        "fork",
        "get_context",  # a multiprocessing context
        "Process",
        # tplib's functions that start processes: local pools and launches, measurements
        # on processes of their own, torchrun, gpu-check's steps. (A test whose processes
        # start deeper, in a call naming none of these, carries the marker itself.)
        "LocalPool",
        "launch",
        "measure_link",
        "measure_contention",
        "torchrun",
        "run_check",  # gpu-check's driver: each step a process of its own
        "run_step",
        "run_on_nodes",  # measure mode on nodes: a launch command per run
        "run_settings",
        "measured_systems",  # Table 4's systems measured on local pools
        "statistical_efficiency",
    }
)
# A second or more of work in the test's own process, measured on 2 cores (setup, call and
# teardown: make test-fast's run with --durations=0): "module::function" for every
# parametrisation, "module::function[id]" for one.
SLOW = frozenset(
    {
        "test_nn_doc_attention.py::test_sliced_packed_rows_match_documents_run_alone[split-none]",
        "test_nn_doc_attention.py::test_sliced_packed_rows_match_documents_run_alone[split-full]",
        "test_nn_doc_attention.py::test_sliced_packed_rows_match_documents_run_alone[split-selective]",
        "test_nn_doc_attention.py::test_sliced_packed_rows_match_documents_run_alone[masked-none]",
        "test_nn_doc_attention.py::test_sliced_packed_rows_match_documents_run_alone[masked-full]",
        "test_nn_doc_attention.py::test_sliced_packed_rows_match_documents_run_alone[masked-selective]",
        "test_cli.py::test_run_writes_a_setting_config_and_prints_how_to_launch_it",
        "test_cli.py::test_simulate_prints_the_paper_s_numbers_beside_ours[argv1-4-paper1]",
        "test_cli.py::test_table_command_prints_and_saves",
        "test_cli_partitioning.py::test_autoplan_json_has_the_best_first",
        "test_cli_planning.py::test_memory_limit",
        "test_cli_partitioning.py::test_autoplan_writes_the_best_layouts_run",
        "test_cluster.py::test_stored_calibration_equals_a_fresh_fit",
        "test_cluster.py::test_terapipe_zb_simulates_on_the_cluster_faster_than_terapipe",
        "test_explorer_widget.py::test_a_grid_too_fine_to_plan_interactively_is_refused",
        "test_explorer_widget.py::test_explorer_recomputes_on_change",
        "test_explorer_widget.py::test_the_table_cuts_long_plans_and_simulates_the_best_uniform",
        "test_nn_slicing.py::test_chained_stages_match_the_reference",
        "test_nn_slicing.py::test_sliced_whole_model_matches_the_reference",
        "test_partition_simulated.py::test_gpt3_1b_candidates_agree_with_their_schedules",
        "test_planner_zero_bubble.py::test_the_dp_plan_simulates_within_reach_of_the_best[48-2-4]",
        "test_runs_partitioned.py::test_the_searched_layout_is_a_run",
        "test_runs_settings.py::test_for_setting_is_the_table1_row[3]",
        "test_runs_settings.py::test_for_setting_is_the_table1_row[5]",
        "test_runs_settings.py::test_for_setting_is_the_table1_row[6]",
        "test_runs_settings.py::test_for_setting_is_the_table1_row[8]",
        "test_runs_settings.py::test_for_setting_is_the_table1_row[9]",
        "test_runs_settings.py::test_gpipe_and_paper_plan_sources[5]",
        "test_runs_settings.py::test_gpipe_and_paper_plan_sources[6]",
        "test_runs_settings.py::test_gpipe_and_paper_plan_sources[9]",
        "test_runs_settings.py::test_planned_configs_round_trip_through_json",
        "test_runs_settings.py::test_setting_5_at_longer_sequences[cluster-4096-8]",
        "test_runs_settings.py::test_setting_5_at_longer_sequences[cluster-6144-4]",
        "test_runs_settings.py::test_setting_5_at_longer_sequences[cluster-8192-2]",
        "test_runs_settings.py::test_setting_configs_round_trip_through_json[5]",
        "test_runs_settings.py::test_setting_configs_round_trip_through_json[6]",
        "test_runs_settings.py::test_setting_configs_round_trip_through_json[8]",
        "test_runs_settings.py::test_setting_configs_round_trip_through_json[9]",
        "test_runtime_torchrun.py::test_a_rank_that_stopped_reporting_is_named",
        "test_runtime_torchrun.py::test_await_every_rank_names_the_missing_ranks",
        "test_search_layout.py::test_paper_scale_search_ranks_and_explains",
        "test_search_layout.py::test_search_equals_exhaustive_evaluation[case0]",
        "test_search_setting.py::test_setting_7_with_virtual_stages",
        "test_sim_throughput.py::test_asynchronous_is_never_slower_than_1f1b_on_the_cluster",
        "test_tables.py::test_a_result_saves_its_csv_and_figure_atomically",
        "test_tables.py::test_dp_ablation_keeps_the_papers_ordering",
        "test_tables.py::test_exact_joint_is_never_worse_than_the_papers_joint_dp",
        "test_tables.py::test_main_results_run_terapipe_over_virtual_stages",
        "test_tables.py::test_main_results_simulates_the_papers_own_plan",
        "test_tables.py::test_main_results_stand_beside_the_papers_numbers",
        "test_tables.py::test_seqlen_sweep_row",
        "test_tables.py::test_simulate_setting",
        "test_tables.py::test_simulated_tables_equal_the_committed_results",
        "test_tables_layout_search.py::test_search_never_loses_to_the_papers_layout",
        # These share the module's setting (1) on both DGX clusters (4 s).
        "test_tables_modern_clusters.py::test_each_row_follows_from_its_latencies",
        "test_tables_modern_clusters.py::test_the_committed_rows_regenerate",
        "test_tables_modern_clusters.py::test_the_committed_search_regenerates",
        # These share the module's GPT3-13B study at 128K (2.5 s).
        "test_tables_long_context.py::test_the_committed_rows_regenerate",
        "test_tables_long_context.py::test_each_row_is_the_methods_best_layout",
        "test_tables_long_context.py::test_the_winner_is_the_fastest_fitting_method",
        "test_tables_long_context.py::test_the_dp_never_loses_to_seq1f1b",
        "test_tables_pipeline_systems.py::test_rows_agree_with_the_main_results",
        # These share the module's simulation of setting 8 (7.5 s), which whichever runs
        # first pays.
        "test_tables_pipeline_systems.py::test_rows_of_setting_8",
        "test_tables_pipeline_systems.py::test_chunked_rows_simulate_their_schedules",
        "test_tables_pipeline_systems.py::test_setting_8_equals_the_committed_table",
        "test_tables_pipeline_systems.py::test_two_bw_without_enough_microbatches_cannot_run",
        "test_search_megatron_fit.py::test_every_published_run_is_predicted_within_ten_percent",
        "test_search_megatron_fit.py::test_the_stored_efficiency_is_the_fits_minimum",
    }
)


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _ours(obj: object) -> bool:
    """A function or class of the test suite (not of tplib or a library)."""
    module = getattr(obj, "__module__", None) or ""
    return isinstance(obj, types.FunctionType | type) and module.partition(".")[0] == "tests"


def _inner(fn: Any) -> Any:
    """A test's own function under hypothesis's and functools' wrappers."""
    fn = getattr(getattr(fn, "hypothesis", None), "inner_test", fn)
    return inspect.unwrap(fn)


class _Names:
    """The names an object's code loads, with those of the suite's functions and classes
    that they are, memoised (the parametrisations of a test share their function)."""

    def __init__(self) -> None:
        self.memo: dict[int, frozenset[str]] = {}
        self.open: set[int] = set()

    def __call__(self, obj: object) -> frozenset[str]:
        key = id(obj)
        if key in self.memo:
            return self.memo[key]
        if key in self.open:  # helpers calling each other: the outer call has the rest
            return frozenset()
        self.open.add(key)
        try:
            names = self._read(obj)
        finally:
            self.open.discard(key)
        self.memo[key] = names
        return names

    def _read(self, obj: object) -> frozenset[str]:
        if isinstance(obj, type):
            members = (getattr(m, "__func__", m) for m in vars(obj).values())
            return frozenset().union(*(self(m) for m in members if callable(m)))
        obj = _inner(obj)
        code = getattr(obj, "__code__", None)
        if not isinstance(code, types.CodeType):
            return frozenset()
        names = set(_code_names(code))
        scope = getattr(obj, "__globals__", {})
        for name in list(names):
            if _ours(scope.get(name)):
                names |= self(scope[name])
        return frozenset(names)


def _functions(item: pytest.Function) -> Iterator[Callable[..., object]]:
    """The test function and the functions of every fixture it uses."""
    yield item.function
    info = getattr(item, "_fixtureinfo", None)
    for defs in getattr(info, "name2fixturedefs", {}).values():
        for d in defs:
            yield d.func


def _slow(item: pytest.Function) -> bool:
    module = item.path.name
    return f"{module}::{item.originalname}" in SLOW or f"{module}::{item.name}" in SLOW


def mark(items: Iterable[pytest.Item]) -> None:
    """Add the tiers' markers to ``items`` (a test's own markers stay)."""
    names = _Names()
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        used = frozenset().union(*(names(f) for f in _functions(item)))
        if used & NOTEBOOK_NAMES:
            item.add_marker(pytest.mark.notebook)
            item.add_marker(pytest.mark.system)
        elif used & PROCESS_NAMES and item.get_closest_marker("system") is None:
            item.add_marker(pytest.mark.system)
        if _slow(item) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


# ---- the guard ----------------------------------------------------------------------------

_EVENTS = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system"}
)


_OPEN: list[list[str]] = []  # the lists of the watches under way


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in _EVENTS and _OPEN:
        argv = args[1] if event == "subprocess.Popen" else args[:1]
        words = [str(a) for a in argv] if isinstance(argv, list | tuple) else [str(argv)]
        _note(f"{event}: {' '.join(words)[:120]}")


def _note(what: str) -> None:
    for started in _OPEN:
        started.append(what)


def _install() -> None:
    sys.addaudithook(_audit)  # for the interpreter's life: the hook only notes, and only in a test
    start = multiprocessing.process.BaseProcess.start

    def watched_start(self: multiprocessing.process.BaseProcess) -> None:
        _note(f"multiprocessing: {self.name}")
        start(self)

    multiprocessing.process.BaseProcess.start = watched_start  # type: ignore[method-assign]


_install()


@contextlib.contextmanager
def watch() -> Iterator[list[str]]:
    """The processes this interpreter starts inside the block, as it starts them."""
    started: list[str] = []
    _OPEN.append(started)
    try:
        yield started
    finally:
        _OPEN.remove(started)


def unmarked_processes(item: pytest.Item, started: list[str]) -> str | None:
    """Why ``item`` fails its teardown: it started processes without being marked
    ``system``; None where it did not, or is marked."""
    if not started or item.get_closest_marker("system") is not None:
        return None
    listed = "\n".join(f"  {s}" for s in started[:5])
    return (
        f"{item.nodeid} started processes but is not marked system (make test-fast would run "
        f"it):\n{listed}\nmark it @pytest.mark.system, or name the helper that starts them "
        "in tests/tiers.py's PROCESS_NAMES"
    )
