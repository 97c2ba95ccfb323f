"""One job per configuration, and each table gathered back from its configurations.

A cluster runs a table faster as many small jobs than as one: ``make reproduce
LAUNCHER=slurm`` splits each table's :class:`~tplib.reproduce.jobs.Job` into one job per
configuration, the way the paper names its configurations:

==============  =====  ===============================================================
parameter       tag    the configurations
==============  =====  ===============================================================
``settings``    ``s``  Table 1's rows (main results, DP ablation, pipeline systems,
                       layout search; in measure mode only when given, on GPU nodes)
``seq_lens``    ``L``  Table 4's sequence lengths (with ``batches``, one per L, when
                       the mode takes them)
==============  =====  ===============================================================

A job is split over the first of these its mode's builder takes, as given or by the
builder's default: one job per value, the parameter set to that value alone, outputs in
``<results>/slurm/<table>/<table>-<mode>-<tag><value>.*``. A mode that takes neither,
or gets an empty list (the measure modes on this machine), stays one job with the
table's own outputs. The rows of a table come one configuration after another, each
computed alone (a rank or a speedup is taken within its setting), so :func:`gather`'s
concatenation of the parts' CSVs is the CSV one job would write.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from tplib.reproduce.jobs import Job, results_root
from tplib.tables import Rows, get_table
from tplib.util.files import save_figure, write_csv

__all__ = ["PARTS_DIR", "describe", "gather", "split_job", "split_jobs"]

# Builder parameter -> the tag of one of its values; the first a builder takes splits it.
_CONFIGURATIONS = {"settings": "s", "seq_lens": "L"}
# Lists given element-wise with a configuration parameter: they are split along with it
# when they are as long (Table 4 on this machine runs each L with its own batch).
_PAIRED = {"seq_lens": ("batches",)}
PARTS_DIR = "slurm"  # under the results folder: the configurations' outputs and logs


def _builder_list(job: Job, name: str) -> list[Any] | None:
    """The value of list parameter ``name`` in ``job``: given, else the builder's default;
    None if the builder does not take it."""
    spec = get_table(job.table).modes[get_table(job.table).check(job.mode, job.params)]
    param = inspect.signature(spec.build).parameters.get(name)
    if param is None:
        return None
    value = job.params.get(name, param.default)
    return list(value) if value is not None else None


def split_job(job: Job) -> list[Job]:
    """``job`` as one job per configuration (see the module docstring); ``[job]`` when
    its table's mode has no configurations to split over."""
    for name, short in _CONFIGURATIONS.items():
        values = _builder_list(job, name)
        if values is None:
            continue
        if not values:
            return [job]
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise ValueError(
                f"{job.table} ({job.mode}): {name}={values} names {repeated} more than once: "
                "each configuration runs once, as one job of its own"
            )
        paired = {
            other: given
            for other in _PAIRED.get(name, ())
            if (given := _builder_list(job, other)) is not None and len(given) == len(values)
        }
        root = Path(job.root) if job.root is not None else results_root()
        return [
            Job(
                job.table,
                job.mode,
                {**job.params, name: [v], **{k: [vs[i]] for k, vs in paired.items()}},
                str(root / PARTS_DIR),
                f"{job.mode}-{short}{v}",
            )
            for i, v in enumerate(values)
        ]
    return [job]


def split_jobs(jobs: Sequence[Job]) -> list[tuple[Job, list[Job]]]:
    """Each of ``jobs`` with its configurations' jobs, in order."""
    return [(job, split_job(job)) for job in jobs]


def describe(job: Job) -> str:
    """A configuration's job for messages: ``main_results (simulate) settings=[9]``."""
    split = [f"{k}={job.params[k]}" for k in _CONFIGURATIONS if k in job.params]
    return " ".join([f"{job.table} ({job.mode})", *split])


def gather(job: Job, parts: Sequence[Job]) -> None:
    """Write ``job``'s CSV from its ``parts``' CSVs, concatenated in order, and redraw its
    figure with the table's figure function, each atomically. Nothing to do when the job
    was not split (its one part wrote the table's outputs itself)."""
    if list(parts) == [job]:
        return
    import matplotlib.pyplot as plt

    # pandas (3.x) reads back every float exactly as the part wrote it (its default
    # parser round-trips), so the table's CSV is the one a single job writes.
    df = pd.concat([pd.read_csv(p.csv) for p in parts], ignore_index=True)
    table = get_table(job.table)
    fig = table.modes[table.check(job.mode, job.params)].figure(Rows(df))
    try:
        write_csv(df, job.csv)
        save_figure(fig, job.figure)
    finally:
        plt.close(fig)
