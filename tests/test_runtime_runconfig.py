"""RunConfig: every bad input fails when the config is made, naming the value and the
rule. Its JSON is tests/test_runtime_runfile.py's."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tplib.plan import Plan
from tplib.runtime import Hooks, RunConfig


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"n_stages": 2, "batch": 4, "seq_len": 16, "slicing": Plan.gpipe(3, 16)}, r"sum to 3, not the batch size 4"),
        ({"n_stages": 2, "seq_len": 16, "slicing": Plan((1,), ((8, 4),))}, r"token slices \[8, 4\] sum to 12, not the sequence length 16"),
        ({"n_stages": 2, "stage_ranges": ((0, 2), (2, 3))}, r"end at layer 3, not at the model's 4"),
        ({"n_stages": 2, "stage_ranges": ((0, 2), (3, 4))}, r"stage 1 covers layers \[3, 4\) but must start at layer 2"),
        ({"n_stages": 3, "stage_ranges": ((0, 2), (2, 4))}, r"give 2 stages for n_stages=3"),
        ({"schedule": "zero-bubble"}, r"unknown schedule 'zero-bubble'"),
        ({"precision": "fp16"}, r"precision 'fp16' needs device='cuda'"),
        ({"precision": "fp8"}, r"unknown precision 'fp8'"),
        ({"recompute": "selective"}, r"recompute='selective' is not a recompute mode"),
        ({"n_op": 3}, r"n_op=3 must divide tiny's 4 attention heads"),
        ({"n_op": 0}, r"RunConfig.n_op=0 must be a positive integer"),
        ({"n_op": 4, "ranks_per_node": 2}, r"n_op=4 with ranks_per_node=2: a stage's #Op ranks must lie on one node"),
        ({"batch": 3, "n_data": 2}, r"batch=3 is not divisible by n_data=2"),
        ({"seq_len": 100}, r"seq_len=100 exceeds the model's context of 64"),
        ({"slicing": 0, "seq_len": 8}, r"slicing=0 token slices per sequence is outside \[1, seq_len=8\]"),
        ({"n_stages": 0}, r"RunConfig.n_stages=0 must be a positive integer"),
        ({"timeout_s": 0}, r"timeout_s=0 must be positive"),
        ({"model": "gpt-5"}, r"unknown model 'gpt-5'"),
        ({"device": "tpu"}, r"device='tpu'"),
        ({"lr": 0.0}, r"RunConfig.lr=0.0 must be a finite positive learning rate"),
        ({"grad_clip": -1.0}, r"RunConfig.grad_clip=-1.0 must be a finite norm >= 0 \(0: no clipping\)"),
        ({"grad_clip": float("inf")}, r"RunConfig.grad_clip=inf must be a finite norm"),
        ({"weight_decay_params": "biases"}, r"weight_decay_params='biases': choose one of \('matrices', 'all'\)"),
        ({"lr_schedule": "linear"}, r"RunConfig.lr_schedule='linear': choose one of \('cosine', 'constant'\)"),
        ({"lr_warmup_steps": -1}, r"RunConfig.lr_warmup_steps=-1 must be an integer >= 0"),
        ({"lr_warmup_steps": 2.5}, r"RunConfig.lr_warmup_steps=2.5 must be an integer >= 0"),
        ({"lr_warmup_steps": 4, "lr_decay_steps": 3}, r"RunConfig.lr_decay_steps=3 must be an integer >= lr_warmup_steps=4"),
        ({"lr_schedule": "constant", "lr_decay_steps": 10}, r"lr_decay_steps=10 with lr_schedule='constant': only the cosine schedule decays"),
        ({"min_lr_ratio": 1.5}, r"RunConfig.min_lr_ratio=1.5 must lie in \[0, 1\]"),
    ],
)  # fmt: skip
def test_bad_input_fails_when_the_config_is_made(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RunConfig(**fields)  # type: ignore[arg-type]


def test_derived_values_are_computed_once() -> None:
    run = RunConfig(n_stages=2, n_data=2, batch=4, seq_len=16, slicing=4)
    assert run.pipeline_batch == 2 and run.world_size == 4
    assert run.plan == Plan.uniform(2, 16, n_token_slices=4)
    assert run.ranges == ((0, 2), (2, 4))
    assert run.cfg is run.cfg and run.schedule_data.n_stages == 2


def test_the_optimiser_is_gpt3s_by_default() -> None:
    run = RunConfig()
    assert (run.betas, run.adam_eps, run.weight_decay) == ((0.9, 0.95), 1e-8, 0.1)
    assert (run.weight_decay_params, run.grad_clip) == ("matrices", 1.0)
    assert (run.lr_schedule, run.lr_warmup_steps, run.min_lr_ratio) == ("cosine", 2, 0.1)
    # The cosine ends, by default, at the run's last iteration + 1, untimed ones included.
    schedule = RunConfig(warmup=3, steps=5).lr_schedule_data
    assert (schedule.kind, schedule.warmup_steps, schedule.decay_steps) == ("cosine", 2, 8)
    assert schedule.peak == 1e-3 and schedule.min_ratio == 0.1
    assert RunConfig(steps=5, lr_decay_steps=3).lr_schedule_data.decay_steps == 3
    # A run inside its warm-up needs no decay end of its own.
    assert RunConfig(steps=1, lr_warmup_steps=4).lr_schedule_data.decay_steps == 4
    constant = RunConfig(lr_schedule="constant", lr_warmup_steps=0).lr_schedule_data
    assert constant.decay_steps is None and constant.lr_at(7) == 1e-3
    RunConfig(grad_clip=0)  # no clipping


def test_one_way_to_say_the_slicing() -> None:
    explicit = Plan((1, 1), ((5, 11), (16,)))
    assert RunConfig(batch=2, seq_len=16, slicing=explicit).plan == explicit
    assert RunConfig(batch=2, seq_len=16, slicing=2).plan == Plan((1, 1), ((8, 8), (8, 8)))
    assert RunConfig(batch=2, seq_len=16).plan == Plan.gpipe(2, 16)  # default: one slice
    with pytest.raises(ValueError, match="give a Plan or a number"):
        RunConfig(slicing="[(1, [64])]")  # type: ignore[arg-type]


def test_hooks_are_checked() -> None:
    assert Hooks(fault="hang:3").fault_rank == 3 and Hooks().fault_rank is None
    with pytest.raises(ValueError, match=r"fault='explode:1'"):
        Hooks(fault="explode:1")
    with pytest.raises(ValueError, match=r"fault=3: expected 'raise:RANK' or 'hang:RANK'"):
        Hooks(fault=3)  # type: ignore[arg-type]


def test_a_run_config_is_checked_without_torch() -> None:
    """Configs are made and checked on a login node: that must not load torch."""
    code = (
        "import sys\n"
        "from tplib.runtime import RunConfig\n"
        "RunConfig(n_stages=2, n_op=2, batch=2, seq_len=16, slicing=4, recompute='full')"
        ".lr_schedule_data.lr_at(3)\n"
        "try:\n"
        "    RunConfig(precision='fp16')\n"
        "except ValueError:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


# ---- bad input, generated -------------------------------------------------------------
# Derandomized: the same inputs on every run. Each example makes one RunConfig (about a
# millisecond on the tiny model), never a process.

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=300)

NOT_NUMBERS: st.SearchStrategy[object] = st.one_of(
    st.none(), st.text(max_size=3), st.lists(st.integers(), max_size=2), st.just({})
)
NOT_INTEGERS = st.one_of(NOT_NUMBERS, st.booleans(), st.floats(allow_nan=True, allow_infinity=True))
NOT_NAMES = st.one_of(
    st.none(), st.integers(), st.text(max_size=8), st.lists(st.text(max_size=3), max_size=2)
)

# Each field with values that break its rule (type or range), on the default config.
BAD_VALUES: dict[str, st.SearchStrategy[object]] = {
    **dict.fromkeys(
        ["n_stages", "n_data", "n_op", "batch", "seq_len", "steps"],
        st.one_of(NOT_INTEGERS, st.integers(max_value=0)),
    ),
    **dict.fromkeys(
        ["warmup", "threads", "ranks_per_node", "lr_warmup_steps"],
        st.one_of(NOT_INTEGERS, st.integers(max_value=-1)),
    ),
    **dict.fromkeys(
        ["seed", "data_seed"],
        st.one_of(NOT_INTEGERS, st.integers(max_value=-1), st.integers(min_value=2**63)),
    ),
    **{
        name: st.one_of(NOT_NUMBERS, st.booleans(), st.sampled_from([math.nan, math.inf, -math.inf]), bad)
        for name, bad in [
            ("lr", st.floats(max_value=0)),
            ("weight_decay", st.floats(max_value=-1e-9)),
            ("adam_eps", st.floats(max_value=0)),
            ("grad_clip", st.floats(max_value=-1e-9)),
            ("min_lr_ratio", st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=1.001))),
            ("timeout_s", st.floats(max_value=0)),
        ]
    },
    **dict.fromkeys(
        ["model", "schedule", "weight_decay_params", "lr_schedule", "data", "device", "precision", "recompute"],
        NOT_NAMES.filter(lambda v: v not in ("tiny", "terapipe", "gpipe", "1f1b", "matrices", "all",
                                              "cosine", "constant", "synthetic", "stdlib", "cpu",
                                              "fp32", "bf16", "none", "full", "TINY", "Tiny")),
    ),
    "betas": st.one_of(
        NOT_NUMBERS,
        st.tuples(st.floats(0, 0.99)),
        st.tuples(st.floats(0, 0.99), st.floats(0, 0.99), st.floats(0, 0.99)),
        st.tuples(st.floats(min_value=1), st.floats(0, 0.99)),
        st.tuples(st.floats(0, 0.99), st.floats(max_value=-1e-9)),
        st.tuples(st.text(max_size=2), st.floats(0, 0.99)),
    ),
    "vertical_sync": st.one_of(NOT_NUMBERS, st.integers(), st.floats()),
    "stage_ranges": st.one_of(
        st.integers(),
        st.text(max_size=3),
        st.just(((0, 4, 5),)),
        st.tuples(st.tuples(st.floats(0, 4), st.floats(0, 4))),
        st.tuples(st.tuples(st.text(max_size=1), st.integers(0, 4))),
        st.tuples(st.tuples(st.integers(-3, 8), st.integers(-3, 8))).filter(lambda r: r != ((0, 4),)),
        st.just(()),
    ),
    "slicing": st.one_of(
        st.none(), st.booleans(), st.floats(), st.text(max_size=6), st.integers(max_value=0),
        st.integers(min_value=65), st.lists(st.integers(), max_size=2),
    ),
    "lr_decay_steps": st.one_of(st.text(max_size=2), st.floats(), st.booleans(), st.integers(max_value=1)),
    "model_overrides": st.one_of(
        st.integers(),
        st.text(min_size=1, max_size=3),
        st.just((("nope", 1),)),
        st.tuples(st.tuples(st.sampled_from(["n_layer", "hidden", "n_head", "seq_len", "vocab_size"]), NOT_INTEGERS)),
        st.tuples(st.tuples(st.sampled_from(["dropout", "layer_norm_eps", "init_std"]), NOT_NUMBERS)),
        st.tuples(st.tuples(st.just("tie_embeddings"), st.one_of(st.integers(), st.text(max_size=2)))),
    ),
}  # fmt: skip


@st.composite
def one_bad_field(draw: st.DrawFn) -> tuple[str, object]:
    name = draw(st.sampled_from(sorted(BAD_VALUES)))
    return name, draw(BAD_VALUES[name])


@FUZZ
@given(one_bad_field())
def test_a_bad_field_is_named_when_the_config_is_made(case: tuple[str, object]) -> None:
    name, value = case
    with pytest.raises(ValueError) as info:
        RunConfig(**{name: value})  # type: ignore[arg-type]
    message = str(info.value)
    # The message names the field (or, for model overrides, GPTConfig's field) and the value.
    assert name in message or name.replace("_", " ") in message or "GPTConfig" in message, message
    shown = [repr(value), str(value)]
    if isinstance(value, tuple):
        shown.append(repr(list(value)))  # how the stage-range checks print them
    assert any(s in message for s in shown) or "GPTConfig" in message, message


TINY_LAYERS, TINY_HEADS, TINY_CONTEXT = 4, 4, 64  # tplib.nn.configs's "tiny", written out


@FUZZ
@given(
    n_stages=st.integers(1, 6),
    n_data=st.integers(1, 4),
    n_op=st.integers(1, 8),
    batch=st.integers(1, 12),
    seq_len=st.integers(1, 80),
    slicing=st.integers(1, 80),
    ranks_per_node=st.sampled_from([0, 1, 2, 4, 8]),
    schedule=st.sampled_from(["gpipe", "terapipe", "1f1b", "terapipe-zb"]),
)
def test_layouts_are_accepted_exactly_when_they_are_consistent(
    n_stages: int,
    n_data: int,
    n_op: int,
    batch: int,
    seq_len: int,
    slicing: int,
    ranks_per_node: int,
    schedule: str,
) -> None:
    # The rules, written from the README: which one a layout breaks first.
    broken = [
        (bool(TINY_HEADS % n_op), f"n_op={n_op} must divide tiny's 4 attention heads"),
        (bool(ranks_per_node % n_op), f"n_op={n_op} with ranks_per_node={ranks_per_node}"),
        (bool(batch % n_data), f"batch={batch} is not divisible by n_data={n_data}"),
        (seq_len > TINY_CONTEXT, f"seq_len={seq_len} exceeds the model's context of 64"),
        (slicing > seq_len, f"slicing={slicing} token slices per sequence is outside"),
        (n_stages > TINY_LAYERS, f"n_stages={n_stages} must be between 1 and the model's 4"),
    ]
    fields = {
        "n_stages": n_stages, "n_data": n_data, "n_op": n_op, "batch": batch,
        "seq_len": seq_len, "slicing": slicing, "ranks_per_node": ranks_per_node,
        "schedule": schedule,
    }  # fmt: skip
    if schedule == "gpipe" and slicing > 1 and not any(b for b, _ in broken):
        slicing = fields["slicing"] = 1  # gpipe's units are whole sequences
    errors = [message for b, message in broken if b]
    if errors:
        with pytest.raises(ValueError, match=re.escape(errors[0])):
            RunConfig(**fields)  # type: ignore[arg-type]
        return
    run = RunConfig(**fields)  # type: ignore[arg-type]
    assert run.world_size == n_data * n_stages * n_op
    assert run.plan.batch == batch // n_data and run.plan.seq_len == seq_len
    assert run.plan.n_units == (batch // n_data) * slicing
    assert run.ranges[0][0] == 0 and run.ranges[-1][1] == TINY_LAYERS


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"batch": 2**20, "seq_len": 64, "slicing": 64, "n_stages": 4}, r"4 make 268435456 \(unit, stage\) pairs, more than the 262144"),
        ({"schedule": "2bw", "grad_clip": 0, "n_stages": 4, "steps": 70_000}, r"x 70000 iterations make 280000 \(unit, stage\) pairs"),
        ({"slicing": Plan.gpipe(1, 64), "batch": 1, "timeout_s": math.inf}, r"RunConfig.timeout_s=inf must be positive seconds, finite"),
        ({"betas": (0.9, 1.0)}, r"RunConfig.betas=\(0.9, 1.0\) must be AdamW's two betas, each in \[0, 1\)"),
        ({"adam_eps": 0.0}, r"RunConfig.adam_eps=0.0 must be a finite AdamW eps > 0"),
        ({"weight_decay": -0.1}, r"RunConfig.weight_decay=-0.1 must be a finite weight decay >= 0"),
        ({"seed": 2**64}, r"RunConfig.seed=18446744073709551616 must be an integer in \[0, 9223372036854775807\]"),
        ({"warmup": "2"}, r"RunConfig.warmup='2' must be an integer >= 0"),
        ({"stage_ranges": ((0.0, 4.0),)}, r"RunConfig.stage_ranges=\(\(0.0, 4.0\),\) must be \(lo, hi\) integer pairs"),
        ({"stage_ranges": ()}, r"stage ranges \[\] give 0 stages for n_stages=1"),
        ({"vertical_sync": "yes"}, r"RunConfig.vertical_sync='yes' must be True or False"),
        ({"model": None}, r"unknown model None: known models are"),
        ({"schedule": ["gpipe"]}, r"unknown schedule \['gpipe'\]"),
        ({"model_overrides": (("n_layers", 2),)}, r"model overrides name unknown fields \['n_layers'\]: GPTConfig's fields are"),
        ({"model_overrides": (("init_std", "0.02"),)}, r"GPTConfig.init_std='0.02': must be a finite number > 0"),
        ({"model_overrides": 5}, r"model overrides 5 are not \(field, value\) pairs"),
    ],
)  # fmt: skip
def test_bad_values_are_named_with_their_rule(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RunConfig(**fields)  # type: ignore[arg-type]


def test_the_posting_plan_is_made_once_and_checked_for_cuda_runs() -> None:
    """A CUDA run's posting plan is made and checked under NCCL's semantics when the
    config is made, and the workers reuse it; a CPU run makes it on first use."""
    from tplib.schedule.nccl import posting_plan

    options: dict[str, Any] = {"schedule": "1f1b", "n_stages": 2, "batch": 4, "slicing": 2}
    cuda = RunConfig(**options, device="cuda")
    made = cuda._derived[4]
    assert made is not None and cuda.posting is made
    assert made == posting_plan(cuda.schedule_data)
    cpu = RunConfig(**options)
    assert cpu._derived[4] is None
    assert cpu.posting == made and cpu.posting is cpu.posting
