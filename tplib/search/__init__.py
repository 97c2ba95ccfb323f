"""A paper setting planned and simulated on the cluster model, and TeraPipe's layout
searched there:

- :mod:`~tplib.search.setting`: a setting's cost model, its TeraPipe plan and GPipe
  baseline, their simulated latency and FLOPs, beside the paper's;
- :mod:`~tplib.search.layout`: the layout search (#Data, #Pipe, #Op, recomputation and
  the plan) behind ``python -m tplib autoplan``.

Above the planners and the cluster model, below the runs and the tables. No torch.
"""
