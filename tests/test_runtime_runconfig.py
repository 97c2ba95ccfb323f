"""RunConfig and its parts: every bad input fails when the config is made, naming the value
and the rule; a part checks its own fields, the run what spans parts. Its JSON is
tests/test_runtime_runfile.py's."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tplib.plan import Plan
from tplib.runtime import Data, Hooks, Optim, Parallelism, RunConfig, Timing
from tplib.runtime.parts import PARTS


def make(fields: Mapping[str, object]) -> RunConfig:
    """The run of ``fields``, a part's fields named "part.field": each part is made first,
    as a caller makes it, so a part's own error comes from the part."""
    top: dict[str, object] = {}
    parts: dict[str, dict[str, object]] = {}
    for key, value in fields.items():
        part, _, name = key.rpartition(".")
        if part:
            parts.setdefault(part, {})[name] = value
        else:
            top[key] = value
    made = {part: PARTS[part](**given) for part, given in parts.items()}  # type: ignore[arg-type]
    return RunConfig(**top, **made)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"parallelism.n_stages": 2, "data.batch": 4, "data.seq_len": 16, "slicing": Plan.gpipe(3, 16)}, r"sum to 3, not the batch size 4"),
        ({"parallelism.n_stages": 2, "data.seq_len": 16, "slicing": Plan((1,), ((8, 4),))}, r"token slices \[8, 4\] sum to 12, not the sequence length 16"),
        ({"parallelism.n_stages": 2, "parallelism.stage_ranges": ((0, 2), (2, 3))}, r"end at layer 3, not at the model's 4"),
        ({"parallelism.n_stages": 2, "parallelism.stage_ranges": ((0, 2), (3, 4))}, r"stage 1 covers layers \[3, 4\) but must start at layer 2"),
        ({"parallelism.n_stages": 3, "parallelism.stage_ranges": ((0, 2), (2, 4))}, r"give 2 stages for n_stages=3"),
        ({"schedule_name": "zero-bubble"}, r"unknown schedule 'zero-bubble'"),
        ({"precision": "fp16"}, r"precision 'fp16' needs device='cuda'"),
        ({"precision": "fp8"}, r"unknown precision 'fp8'"),
        ({"recompute": "partial"}, r"recompute='partial' is not a recompute mode: choose one of \('none', 'selective', 'full'\)"),
        ({"parallelism.n_op": 3}, r"n_op=3 must divide tiny's 4 attention heads"),
        ({"parallelism.n_op": 0}, r"Parallelism.n_op=0 must be a positive integer"),
        ({"parallelism.n_op": 4, "parallelism.ranks_per_node": 2}, r"n_op=4 with ranks_per_node=2: a stage's #Op ranks must lie on one node"),
        ({"data.batch": 3, "parallelism.n_data": 2}, r"batch=3 is not divisible by n_data=2"),
        ({"data.seq_len": 100}, r"seq_len=100 exceeds the model's context of 64"),
        ({"slicing": 0, "data.seq_len": 8}, r"slicing=0 token slices per sequence is outside \[1, seq_len=8\]"),
        ({"parallelism.n_stages": 0}, r"Parallelism.n_stages=0 must be a positive integer"),
        ({"timing.timeout_s": 0}, r"Timing.timeout_s=0 must be positive"),
        ({"model": "gpt-5"}, r"unknown model 'gpt-5'"),
        ({"device": "tpu"}, r"device='tpu'"),
        ({"optim.lr": 0.0}, r"Optim.lr=0.0 must be a finite positive learning rate"),
        ({"optim.grad_clip": -1.0}, r"Optim.grad_clip=-1.0 must be a finite norm >= 0 \(0: no clipping\)"),
        ({"optim.grad_clip": float("inf")}, r"Optim.grad_clip=inf must be a finite norm"),
        ({"optim.weight_decay_params": "biases"}, r"weight_decay_params='biases': choose one of \('matrices', 'all'\)"),
        ({"optim.lr_schedule_name": "linear"}, r"Optim.lr_schedule_name='linear': choose one of \('cosine', 'constant'\)"),
        ({"optim.lr_warmup_steps": -1}, r"Optim.lr_warmup_steps=-1 must be an integer >= 0"),
        ({"optim.lr_warmup_steps": 2.5}, r"Optim.lr_warmup_steps=2.5 must be an integer >= 0"),
        ({"optim.lr_warmup_steps": 4, "optim.lr_decay_steps": 3}, r"Optim.lr_decay_steps=3 must be an integer >= lr_warmup_steps=4"),
        ({"optim.lr_schedule_name": "constant", "optim.lr_decay_steps": 10}, r"lr_decay_steps=10 with lr_schedule_name='constant': only the cosine schedule decays"),
        ({"optim.min_lr_ratio": 1.5}, r"Optim.min_lr_ratio=1.5 must lie in \[0, 1\]"),
        ({"data.source": "web"}, r"Data.source='web': choose one of \('synthetic', 'stdlib', 'corpus-documents', 'lognormal-documents'\)"),
        ({"parallelism.sequence_parallel": True}, r"sequence_parallel=True with n_op=1: .* needs #Op > 1"),
        ({"parallelism.n_op": 2, "parallelism.sequence_parallel": 1}, r"Parallelism.sequence_parallel=1 must be True or False"),
        ({"parallelism.n_op": 2, "parallelism.sequence_parallel": True, "data.seq_len": 15}, r"sequence_parallel with seq_len=15 and n_op=2: .* #Op must divide L"),
        ({"parallelism.n_op": 4, "parallelism.sequence_parallel": True, "data.seq_len": 16, "slicing": Plan((1,), ((4, 6, 6),))}, r"n_op=4: token slices \[6, 6\] of batch slice 0 \(plan .*\) are not divisible by #Op"),
        ({"parallelism.n_op": 2, "parallelism.sequence_parallel": True, "data.seq_len": 16, "slicing": 16}, r"n_op=2: token slices \[1, 1, .*\] of batch slice 0"),
        ({"schedule_name": "pipedream", "parallelism.n_stages": 2, "parallelism.n_op": 2, "parallelism.sequence_parallel": True, "optim.grad_clip": 0.0}, r"schedule_name='pipedream' with sequence_parallel: asynchronous schedules are not supported"),
        ({"parallelism": {"n_stages": 2}}, r"RunConfig.parallelism=\{'n_stages': 2\} must be a Parallelism"),
        ({"timing": Data()}, r"RunConfig.timing=Data\(.*\) must be a Timing"),
        ({"parallelism.distributed_optimizer": 1}, r"Parallelism.distributed_optimizer=1 must be True or False"),
        ({"schedule_name": "pipedream", "optim.grad_clip": 0, "parallelism.n_stages": 2, "parallelism.distributed_optimizer": True}, r"schedule_name='pipedream' with distributed_optimizer=True: an asynchronous schedule swaps each parameter's storage"),
        ({"schedule_name": "2bw", "optim.grad_clip": 0, "parallelism.n_stages": 2, "data.batch": 4, "parallelism.n_data": 2, "parallelism.distributed_optimizer": True}, r"schedule_name='2bw' with distributed_optimizer=True"),
    ],
)  # fmt: skip
def test_bad_input_fails_when_the_config_is_made(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(fields)


def test_a_part_checks_its_own_fields_alone() -> None:
    """A part is checked when it is made, before any run holds it; what spans parts waits
    for the run."""
    with pytest.raises(ValueError, match=r"Parallelism.n_stages=0 must be a positive integer"):
        Parallelism(n_stages=0)
    with pytest.raises(ValueError, match=r"Timing.steps=0 must be a positive integer"):
        Timing(steps=0)
    with pytest.raises(ValueError, match=r"Data.seed=-1 must be an integer in \[0, "):
        Data(seed=-1)
    with pytest.raises(ValueError, match=r"Optim.betas=\(0.9,\) must be AdamW's two betas"):
        Optim(betas=(0.9,))  # type: ignore[arg-type]
    # Each of these is a part on its own; together they break a rule of the run.
    parallelism, data = Parallelism(n_data=2), Data(batch=3)
    with pytest.raises(ValueError, match=r"batch=3 is not divisible by n_data=2"):
        RunConfig(parallelism=parallelism, data=data)
    with pytest.raises(ValueError, match=r"schedule_name='2bw' with grad_clip=1.0"):
        RunConfig(schedule_name="2bw", parallelism=Parallelism(n_stages=2), data=Data(batch=2))
    with pytest.raises(TypeError, match="positional"):
        Parallelism(2)  # type: ignore[call-arg]


def test_derived_values_are_computed_once() -> None:
    run = RunConfig(
        parallelism=Parallelism(n_stages=2, n_data=2), data=Data(batch=4, seq_len=16), slicing=4
    )
    assert run.pipeline_batch == 2 and run.parallelism.world_size == 4
    assert run.plan == Plan.uniform(2, 16, n_token_slices=4)
    assert run.ranges == ((0, 2), (2, 4))
    assert run.cfg is run.cfg and run.schedule is run.schedule
    assert (run.schedule.name, run.schedule.n_stages) == (run.schedule_name, 2)


def test_ranks_are_laid_out_op_innermost() -> None:
    layout = Parallelism(n_stages=3, n_data=2, n_op=2)
    assert layout.world_size == 12
    # (replica, stage, op rank, CP rank)
    assert [layout.position(r) for r in (0, 1, 2, 5, 6, 11)] == [
        (0, 0, 0, 0), (0, 0, 1, 0), (0, 1, 0, 0), (0, 2, 1, 0), (1, 0, 0, 0), (1, 2, 1, 0)
    ]  # fmt: skip
    assert all(layout.rank_of(*layout.position(r)) == r for r in range(12))
    with pytest.raises(ValueError, match=r"world size 8 is not #Data x #Pipe x #Op = 2 x 3 x 2"):
        layout.check_world_size(8)


def test_the_optimiser_is_gpt3s_by_default() -> None:
    optim = RunConfig().optim
    assert (optim.betas, optim.adam_eps, optim.weight_decay) == ((0.9, 0.95), 1e-8, 0.1)
    assert (optim.weight_decay_params, optim.grad_clip) == ("matrices", 1.0)
    assert (optim.lr_schedule_name, optim.lr_warmup_steps, optim.min_lr_ratio) == ("cosine", 2, 0.1)
    # The cosine ends, by default, at the run's last iteration + 1, untimed ones included.
    schedule = RunConfig(timing=Timing(warmup=3, steps=5)).lr_schedule
    assert (schedule.kind, schedule.warmup_steps, schedule.decay_steps) == ("cosine", 2, 8)
    assert schedule.peak == 1e-3 and schedule.min_ratio == 0.1
    decayed = RunConfig(timing=Timing(steps=5), optim=Optim(lr_decay_steps=3))
    assert decayed.lr_schedule.decay_steps == 3
    # A run inside its warm-up needs no decay end of its own.
    short = RunConfig(timing=Timing(steps=1), optim=Optim(lr_warmup_steps=4))
    assert short.lr_schedule.decay_steps == 4
    constant = RunConfig(optim=Optim(lr_schedule_name="constant", lr_warmup_steps=0)).lr_schedule
    assert constant.decay_steps is None and constant.lr_at(7) == 1e-3
    RunConfig(optim=Optim(grad_clip=0))  # no clipping


def test_one_way_to_say_the_slicing() -> None:
    explicit = Plan((1, 1), ((5, 11), (16,)))
    two = Data(batch=2, seq_len=16)
    assert RunConfig(data=two, slicing=explicit).plan == explicit
    assert RunConfig(data=two, slicing=2).plan == Plan((1, 1), ((8, 8), (8, 8)))
    assert RunConfig(data=two).plan == Plan.gpipe(2, 16)  # default: one slice
    with pytest.raises(ValueError, match="give a Plan or a number"):
        RunConfig(slicing="[(1, [64])]")  # type: ignore[arg-type]


def test_hooks_are_checked() -> None:
    assert Hooks(fault="hang:3").fault_rank == 3 and Hooks().fault_rank is None
    with pytest.raises(ValueError, match=r"fault='explode:1'"):
        Hooks(fault="explode:1")
    with pytest.raises(ValueError, match=r"fault=3: expected 'raise:RANK' or 'hang:RANK'"):
        Hooks(fault=3)  # type: ignore[arg-type]


def test_a_run_config_is_checked_without_torch(fresh_python: Callable[..., str]) -> None:
    """Configs are made and checked on a login node: that must not load torch."""
    fresh_python(
        "from tplib.runtime import Data, Parallelism, RunConfig\n"
        "RunConfig(parallelism=Parallelism(n_stages=2, n_op=2), data=Data(batch=2, seq_len=16),"
        " slicing=4, recompute='full').lr_schedule.lr_at(3)\n"
        "try:\n"
        "    RunConfig(precision='fp16')\n"
        "except ValueError:\n"
        "    pass\n"
        'light("torch")\n'
    )


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

# Each field (a part's as "part.field") with values that break its rule (type or range), on
# the default config.
BAD_VALUES: dict[str, st.SearchStrategy[object]] = {
    **dict.fromkeys(
        ["parallelism.n_stages", "parallelism.n_data", "parallelism.n_op", "data.batch", "data.seq_len", "timing.steps"],
        st.one_of(NOT_INTEGERS, st.integers(max_value=0)),
    ),
    **dict.fromkeys(
        ["timing.warmup", "timing.threads", "parallelism.ranks_per_node", "optim.lr_warmup_steps"],
        st.one_of(NOT_INTEGERS, st.integers(max_value=-1)),
    ),
    **dict.fromkeys(
        ["seed", "data.seed"],
        st.one_of(NOT_INTEGERS, st.integers(max_value=-1), st.integers(min_value=2**63)),
    ),
    **{
        name: st.one_of(NOT_NUMBERS, st.booleans(), st.sampled_from([math.nan, math.inf, -math.inf]), bad)
        for name, bad in [
            ("optim.lr", st.floats(max_value=0)),
            ("optim.weight_decay", st.floats(max_value=-1e-9)),
            ("optim.adam_eps", st.floats(max_value=0)),
            ("optim.grad_clip", st.floats(max_value=-1e-9)),
            ("optim.min_lr_ratio", st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=1.001))),
            ("timing.timeout_s", st.floats(max_value=0)),
        ]
    },
    **dict.fromkeys(
        ["model", "schedule_name", "optim.weight_decay_params", "optim.lr_schedule_name", "data.source", "device", "precision", "recompute"],
        NOT_NAMES.filter(lambda v: v not in ("tiny", "terapipe", "gpipe", "1f1b", "matrices", "all",
                                              "cosine", "constant", "synthetic", "stdlib", "cpu",
                                              "fp32", "bf16", "none", "full", "TINY", "Tiny")),
    ),
    "optim.betas": st.one_of(
        NOT_NUMBERS,
        st.tuples(st.floats(0, 0.99)),
        st.tuples(st.floats(0, 0.99), st.floats(0, 0.99), st.floats(0, 0.99)),
        st.tuples(st.floats(min_value=1), st.floats(0, 0.99)),
        st.tuples(st.floats(0, 0.99), st.floats(max_value=-1e-9)),
        st.tuples(st.text(max_size=2), st.floats(0, 0.99)),
    ),
    "vertical_sync": st.one_of(NOT_NUMBERS, st.integers(), st.floats()),
    "parallelism.stage_ranges": st.one_of(
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
    "optim.lr_decay_steps": st.one_of(st.text(max_size=2), st.floats(), st.booleans(), st.integers(max_value=1)),
    # A part's field given no part, or another part.
    **{part: st.one_of(NOT_NUMBERS, st.just(Data() if part != "data" else Optim())) for part in PARTS},
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
        make({name: value})
    message = str(info.value)
    # The message names the field (or, for model overrides, GPTConfig's field; for the
    # schedule, the registry's "unknown schedule") and the value.
    field = name.rpartition(".")[2]
    named = (field, field.replace("_", " "), field.removesuffix("_name"), "GPTConfig")
    assert any(n in message for n in named), message
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
    # The rules, written from the README: which one a layout breaks first (the layout's
    # own rule when its part is made, then the run's).
    broken = [
        (bool(ranks_per_node % n_op), f"n_op={n_op} with ranks_per_node={ranks_per_node}"),
        (bool(TINY_HEADS % n_op), f"n_op={n_op} must divide tiny's 4 attention heads"),
        (bool(batch % n_data), f"batch={batch} is not divisible by n_data={n_data}"),
        (seq_len > TINY_CONTEXT, f"seq_len={seq_len} exceeds the model's context of 64"),
        (slicing > seq_len, f"slicing={slicing} token slices per sequence is outside"),
        (n_stages > TINY_LAYERS, f"n_stages={n_stages} must be between 1 and the model's 4"),
    ]
    if schedule == "gpipe" and slicing > 1 and not any(b for b, _ in broken):
        slicing = 1  # gpipe's units are whole sequences
    errors = [message for b, message in broken if b]

    def run() -> RunConfig:
        return RunConfig(
            schedule_name=schedule,
            parallelism=Parallelism(
                n_stages=n_stages, n_data=n_data, n_op=n_op, ranks_per_node=ranks_per_node
            ),
            data=Data(batch=batch, seq_len=seq_len),
            slicing=slicing,
        )

    if errors:
        with pytest.raises(ValueError, match=re.escape(errors[0])):
            run()
        return
    made = run()
    assert made.parallelism.world_size == n_data * n_stages * n_op
    assert made.plan.batch == batch // n_data and made.plan.seq_len == seq_len
    assert made.plan.n_units == (batch // n_data) * slicing
    assert made.ranges[0][0] == 0 and made.ranges[-1][1] == TINY_LAYERS


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"data.batch": 2**20, "data.seq_len": 64, "slicing": 64, "parallelism.n_stages": 4}, r"4 make 268435456 \(unit, stage\) pairs, more than the 262144"),
        ({"schedule_name": "2bw", "optim.grad_clip": 0, "parallelism.n_stages": 4, "timing.steps": 70_000}, r"x 70000 iterations make 280000 \(unit, stage\) pairs"),
        ({"slicing": Plan.gpipe(1, 64), "data.batch": 1, "timing.timeout_s": math.inf}, r"Timing.timeout_s=inf must be positive seconds, finite"),
        ({"optim.betas": (0.9, 1.0)}, r"Optim.betas=\(0.9, 1.0\) must be AdamW's two betas, each in \[0, 1\)"),
        ({"optim.adam_eps": 0.0}, r"Optim.adam_eps=0.0 must be a finite AdamW eps > 0"),
        ({"optim.weight_decay": -0.1}, r"Optim.weight_decay=-0.1 must be a finite weight decay >= 0"),
        ({"seed": 2**64}, r"RunConfig.seed=18446744073709551616 must be an integer in \[0, 9223372036854775807\]"),
        ({"data.seed": 2**64}, r"Data.seed=18446744073709551616 must be an integer in \[0, 9223372036854775807\]"),
        ({"timing.warmup": "2"}, r"Timing.warmup='2' must be an integer >= 0"),
        ({"parallelism.stage_ranges": ((0.0, 4.0),)}, r"Parallelism.stage_ranges=\(\(0.0, 4.0\),\) must be \(lo, hi\) integer pairs"),
        ({"parallelism.stage_ranges": ()}, r"stage ranges \[\] give 0 stages for n_stages=1"),
        ({"vertical_sync": "yes"}, r"RunConfig.vertical_sync='yes' must be True or False"),
        ({"model": None}, r"unknown model None: known models are"),
        ({"schedule_name": ["gpipe"]}, r"unknown schedule \['gpipe'\]"),
        ({"model_overrides": (("n_layers", 2),)}, r"model overrides name unknown fields \['n_layers'\]: GPTConfig's fields are"),
        ({"model_overrides": (("init_std", "0.02"),)}, r"GPTConfig.init_std='0.02': must be a finite number > 0"),
        ({"model_overrides": 5}, r"model overrides 5 are not \(field, value\) pairs"),
    ],
)  # fmt: skip
def test_bad_values_are_named_with_their_rule(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(fields)


def test_the_posting_plan_is_made_once_and_checked_for_cuda_runs() -> None:
    """A CUDA run's posting plan is made and checked under NCCL's semantics when the
    config is made, and the workers reuse it; a CPU run makes it on first use."""
    from tplib.schedule.nccl import posting_plan

    def run(device: str) -> RunConfig:
        return RunConfig(
            schedule_name="1f1b",
            parallelism=Parallelism(n_stages=2),
            data=Data(batch=4),
            slicing=2,
            device=device,
        )

    cuda = run("cuda")
    made = cuda._derived[4]
    assert made is not None and cuda.posting is made
    assert made == posting_plan(cuda.schedule)
    cpu = run("cpu")
    assert cpu._derived[4] is None
    assert cpu.posting == made and cpu.posting is cpu.posting
