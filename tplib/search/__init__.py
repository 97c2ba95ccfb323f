"""A paper setting planned and simulated on the cluster model, and TeraPipe's layout
searched there:

- :mod:`~tplib.search.setting`: a setting's cost model, its TeraPipe plan and GPipe
  baseline, their simulated latency and FLOPs, beside the paper's;
- :mod:`~tplib.search.layout`: the layout search (#Data, #CP, #Pipe, #Op, recomputation,
  the schedule and the plan) behind ``python -m tplib autoplan``, with its floors
  (:mod:`~tplib.search.floors`) and its price of one layout under one schedule
  (:mod:`~tplib.search.pricing`);
- :mod:`~tplib.search.long_context`: a method's best layout at a sequence length;
- :mod:`~tplib.search.megatron`: a Megatron-style run priced (``python -m tplib predict``).

Above the planners and the cluster model, below the runs and the tables. No torch.
"""
