"""The paper's joint batch x token DP against the exact joint DP, on every paper setting.

Both plan on the V100-cluster model; each plan is judged by the true fill-drain latency
(sum t + (K - 1) max t over all units) and by the simulator. Usage::

    python scripts/compare_joint.py [--settings 1 5 9] [--eps 1e-4]
"""

from __future__ import annotations

import argparse

import pandas as pd

from tplib.search.setting import EPS, compare_joint_methods


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", type=int, nargs="*", default=list(range(1, 11)))
    p.add_argument("--eps", type=float, default=EPS)
    args = p.parse_args()
    df = compare_joint_methods(args.settings, eps=args.eps)
    pd.set_option("display.width", 220, "display.max_colwidth", 60)
    cols = [
        "setting",
        "model",
        "latency_paper",
        "latency_exact",
        "paper_over_exact",
        "simulated_paper",
        "simulated_exact",
        "simulated_paper_over_exact",
        "plan_seconds_paper",
        "plan_seconds_exact",
    ]
    print(df[cols].round(4).to_string(index=False))
    print(df[["setting", "plan_paper", "plan_exact"]].to_string(index=False))


if __name__ == "__main__":
    main()
