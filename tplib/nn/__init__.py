"""The model stack: the GPT model whose stages run over token slices, and the numerics
of training it. One mechanism per module:

- :mod:`~tplib.nn.configs`: the GPT-3 family of Table 1 and small CPU configs, parameter
  counts, the checks of #Op, precision and recomputation (no torch);
- :mod:`~tplib.nn.layer_ranges`: a stage as a contiguous range of layers (no torch);
- :mod:`~tplib.nn.model`: the GPT model, a stage a range of its blocks;
- :mod:`~tplib.nn.context`: the per-sequence K/V context that makes attention over token
  slices exact;
- :mod:`~tplib.nn.slicing`: a stage run over (batch slice, token slice) units;
- :mod:`~tplib.nn.linear`, :mod:`~tplib.nn.wgrad`: the matrix products, weight gradients
  deferred for split backwards;
- :mod:`~tplib.nn.oppart`: operation partitioning (Megatron's scheme);
- :mod:`~tplib.nn.ring`: context parallelism, ring attention over the #CP ranks;
- :mod:`~tplib.nn.dropout`: dropout keyed by position;
- :mod:`~tplib.nn.precision`, :mod:`~tplib.nn.optimizer`, :mod:`~tplib.nn.lr`: fp32, bf16
  and fp16, their optimizers, the learning-rate schedule;
- :mod:`~tplib.nn.sharded_optimizer`: Megatron's distributed optimizer, AdamW on one
  replica's shard of flat parameter and gradient buffers;
- :mod:`~tplib.nn.bytecount`: the bytes behind tensors, parameters, gradients and optimizer
  state;
- :mod:`~tplib.nn.data`, :mod:`~tplib.nn.corpus`: token batches, synthetic or real text;
- :mod:`~tplib.nn.doc_sources`: documents packed into rows, with their targets and
  boundaries;
- :mod:`~tplib.nn.hf`: a Hugging Face GPT-2 checkpoint loaded into stages.

Importing this package loads nothing; torch loads with the modules that need it.
"""
