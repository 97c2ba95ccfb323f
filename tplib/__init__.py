"""tplib: a reproducibility kit for TeraPipe, token-level pipeline parallelism for
training large transformer language models (Li et al., ICML 2021).

The front door: the nouns and verbs a user starts with, each loaded on first use, so
``import tplib`` loads neither torch nor numpy. The way through them, top to bottom::

    s = tplib.setting(9)                                   # a row of Table 1
    costs = tplib.ClusterCostModel.for_setting(s)          # the V100-cluster model
    plan = tplib.plan_slices(costs, seq_len=s.seq_len, batch=s.pipeline_batch,
                             n_stages=s.n_stages)          # Algorithm 1's plan
    schedule = tplib.make_schedule("terapipe", s.n_stages, plan)  # a schedule, as data
    tplib.simulate(schedule, costs).latency                # its iteration, simulated
    tplib.autoplan("GPT3-1B", 16, 32)                      # or search the whole layout
    run = tplib.setting_run(9)                             # the setting, as a run
    pipe = tplib.Parallelism(n_stages=2)                   # #Pipe = 2 (#Data, #Op: 1)
    tplib.launch(tplib.RunConfig(model="tiny", schedule_name="terapipe",
                                 parallelism=pipe, slicing=4))  # a run on local processes
    tplib.run_table("main_results", "simulate", settings=[9])  # a paper table's row

Everything else lives in the subpackages the README's layout table names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tplib.cluster import ClusterCostModel
    from tplib.nn.configs import GPTConfig, get_config
    from tplib.nn.model import build_model
    from tplib.paper import setting
    from tplib.perfmodel import Profile
    from tplib.plan import Plan
    from tplib.planner import plan_slices
    from tplib.runs import setting_run
    from tplib.runtime import Parallelism, RunConfig, launch
    from tplib.schedule import Schedule, make_schedule
    from tplib.search.layout import autoplan
    from tplib.sim.simulate import simulate, simulate_schedule
    from tplib.tables import run_table

# name -> the module it is loaded from on first use
_EXPORTS = {
    "ClusterCostModel": "tplib.cluster",
    "GPTConfig": "tplib.nn.configs",
    "Parallelism": "tplib.runtime",
    "Plan": "tplib.plan",
    "Profile": "tplib.perfmodel",
    "RunConfig": "tplib.runtime",
    "Schedule": "tplib.schedule",
    "autoplan": "tplib.search.layout",
    "build_model": "tplib.nn.model",
    "get_config": "tplib.nn.configs",
    "launch": "tplib.runtime",
    "make_schedule": "tplib.schedule",
    "plan_slices": "tplib.planner",
    "run_table": "tplib.tables",
    "setting": "tplib.paper",
    "setting_run": "tplib.runs",
    "simulate": "tplib.sim.simulate",
    "simulate_schedule": "tplib.sim.simulate",
}

__all__ = [
    "ClusterCostModel",
    "GPTConfig",
    "Parallelism",
    "Plan",
    "Profile",
    "RunConfig",
    "Schedule",
    "autoplan",
    "build_model",
    "get_config",
    "launch",
    "make_schedule",
    "plan_slices",
    "run_table",
    "setting",
    "setting_run",
    "simulate",
    "simulate_schedule",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # resolved once; later lookups skip this hook
        return value
    raise AttributeError(f"module 'tplib' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
