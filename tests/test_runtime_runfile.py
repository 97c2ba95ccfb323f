"""tplib.runtime.runfile: a RunConfig round-trips through JSON for torchrun jobs, a file
written before the run came in parts (format 1) still loads to the same run, and a dict
or file that is no RunConfig fails with a ValueError naming what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.test_runtime_runconfig import FUZZ
from tplib.plan import Plan
from tplib.runtime import (
    Data,
    Optim,
    Parallelism,
    RunConfig,
    Timing,
    load_run_config,
    run_config_from_dict,
    run_config_to_dict,
    save_run_config,
)
from tplib.runtime.parts import PARTS
from tplib.runtime.runfile import FORMAT_1_FIELDS

DATA = Path(__file__).parent / "data"


def test_run_config_round_trips_through_json(tmp_path: Path) -> None:
    run = RunConfig(
        parallelism=Parallelism(n_stages=2, stage_ranges=((0, 1), (1, 4))),
        slicing=Plan((1, 1), ((5, 11), (16,))),
        data=Data(seq_len=16, batch=2),
        model_overrides=(("n_layer", 4),),
        optim=Optim(
            grad_clip=0.5,
            lr_schedule_name="cosine",
            lr_warmup_steps=3,
            lr_decay_steps=7,
            min_lr_ratio=0.2,
            weight_decay_params="all",
        ),
    )
    assert run_config_from_dict(run_config_to_dict(run)) == run
    save_run_config(run, tmp_path / "run.json")
    assert load_run_config(tmp_path / "run.json") == run
    chunked = RunConfig(
        schedule_name="interleaved-1f1b",
        parallelism=Parallelism(n_stages=2, n_chunks=2),
        data=Data(batch=2, seq_len=16),
    )
    again = run_config_from_dict(run_config_to_dict(chunked))
    assert again == chunked and again.schedule.placement == (0, 1, 0, 1)
    sequence_parallel = RunConfig(
        parallelism=Parallelism(n_stages=2, n_op=2, sequence_parallel=True),
        data=Data(batch=2, seq_len=16),
        slicing=4,
    )
    written = run_config_to_dict(sequence_parallel)
    assert written["parallelism"]["sequence_parallel"] is True
    assert run_config_from_dict(written) == sequence_parallel
    sharded = RunConfig(
        parallelism=Parallelism(n_data=2, distributed_optimizer=True), data=Data(batch=2)
    )
    assert run_config_from_dict(run_config_to_dict(sharded)) == sharded
    uniform = RunConfig(data=Data(batch=2, seq_len=16), slicing=4)
    assert run_config_to_dict(uniform)["slicing"] == 4
    assert run_config_from_dict(run_config_to_dict(uniform)) == uniform
    cut = Plan((1, 1), ((5, 11), (16,)))
    packed = RunConfig(
        parallelism=Parallelism(n_stages=2),
        data=Data(batch=2, seq_len=16, source="lognormal-documents", packing="greedy"),
        slicing=cut,
        timing=Timing(steps=2),
        batch_plans=(cut, Plan((1, 1), ((8, 8), (2, 14)))),
    )
    assert run_config_to_dict(packed)["batch_plans"][1] == "[(1, [8] * 2)] + [(1, [2, 14])]"
    assert run_config_from_dict(run_config_to_dict(packed)) == packed


def test_format_2_nests_each_part() -> None:
    written = run_config_to_dict(RunConfig(parallelism=Parallelism(n_stages=2)))
    assert written["format"] == 2
    assert set(written) == {"format"} | {f for f in RunConfig.__dataclass_fields__ if f[0] != "_"}
    assert written["parallelism"] == {
        "n_stages": 2, "n_data": 1, "n_op": 1, "n_cp": 1, "ranks_per_node": 0, "stage_ranges": None,
        "n_chunks": 1, "sequence_parallel": False, "distributed_optimizer": False,
    }  # fmt: skip
    assert written["timing"] == {"steps": 1, "warmup": 0, "timeout_s": 180.0, "threads": 0}
    # A part or a field left out takes its default.
    assert run_config_from_dict({"format": 2, "data": {"batch": 2}}) == RunConfig(
        data=Data(batch=2)
    )


# What tests/data/run-format1.json holds: every field off its default, written by
# RunConfig as it was before its parts (flat, no "format" key).
FORMAT_1_RUN = RunConfig(
    model="tiny",
    model_overrides=(("dropout", 0.0), ("n_layer", 4)),
    schedule_name="pipedream",
    vertical_sync=True,
    slicing=Plan((1,), ((5, 11),)),
    parallelism=Parallelism(
        n_stages=2, n_data=2, n_op=2, ranks_per_node=4, stage_ranges=((0, 1), (1, 4))
    ),
    data=Data(batch=2, seq_len=16, source="stdlib", seed=7),
    optim=Optim(
        lr=3e-4,
        betas=(0.8, 0.9),
        weight_decay=0.05,
        adam_eps=1e-6,
        weight_decay_params="all",
        grad_clip=0.0,
        lr_schedule_name="cosine",
        lr_warmup_steps=1,
        lr_decay_steps=3,
        min_lr_ratio=0.2,
    ),
    timing=Timing(steps=3, warmup=1, timeout_s=30.0, threads=1),
    seed=5,
    device="cpu",
    precision="bf16",
    recompute="full",
)


def test_a_format_1_file_loads_to_the_same_run(tmp_path: Path) -> None:
    old = json.loads((DATA / "run-format1.json").read_text())
    assert "format" not in old and set(old) == set(FORMAT_1_FIELDS)  # every old field
    run = load_run_config(DATA / "run-format1.json")
    assert run == FORMAT_1_RUN
    # Each old field went somewhere, and nowhere twice.
    places = list(FORMAT_1_FIELDS.values())
    assert len(set(places)) == len(places)
    for part, name in places:
        assert name in (RunConfig if part is None else PARTS[part]).__dataclass_fields__
    # Saved again, it is format 2.
    save_run_config(run, tmp_path / "run.json")
    assert json.loads((tmp_path / "run.json").read_text())["format"] == 2
    assert load_run_config(tmp_path / "run.json") == run


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"stagez": 2}, r"unknown RunConfig fields \['stagez'\] in a run file without a \"format\" key, read as format 1"),
        ({"parallelism": {"n_stages": 2}}, r"unknown RunConfig fields \['parallelism'\] .* a file of nested parts says \"format\": 2"),
        ({"format": 2, "n_stages": 2}, r"unknown RunConfig fields \['n_stages'\]: known fields are"),
        ({"format": 2, "timing": {"stepz": 2}}, r"unknown Timing fields \['stepz'\] in 'timing': known fields are \['steps', 'threads', 'timeout_s', 'warmup'\]"),
        ({"format": 2, "optim": 0.1}, r"RunConfig.optim=0.1 must be a JSON object of Optim fields"),
        ({"format": 3}, r"run file format 3 is not one tplib reads"),
        ({"format": True}, r"run file format True is not one tplib reads"),
        ({"format": "2"}, r"run file format '2' is not one tplib reads"),
        ({"format": 2, "parallelism": {"n_stages": 0}}, r"Parallelism.n_stages=0 must be a positive integer"),
        ({"n_stages": 0}, r"Parallelism.n_stages=0 must be a positive integer"),
    ],
)  # fmt: skip
def test_unknown_fields_and_formats_are_named(data: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_config_from_dict(data)


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 100), st.floats(), st.text(max_size=6)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
FORMAT_1_NAMES = sorted(FORMAT_1_FIELDS)
FORMAT_2 = st.fixed_dictionaries(
    {"format": st.just(2)},
    optional={
        **{name: JSON_VALUES for name in ("model", "schedule_name", "slicing", "seed", "device")},
        **{
            part: st.one_of(
                JSON_VALUES,
                st.dictionaries(
                    st.sampled_from([*cls.__dataclass_fields__, "stagez"]), JSON_VALUES, max_size=3
                ),
            )
            for part, cls in PARTS.items()
        },
    },
)


@FUZZ
@given(
    st.one_of(
        st.dictionaries(st.sampled_from(FORMAT_1_NAMES), JSON_VALUES, max_size=4),
        st.dictionaries(st.sampled_from([*FORMAT_1_NAMES, "stagez", "n_layer", "", "format"]), JSON_VALUES, max_size=3),
        FORMAT_2,
        JSON_VALUES,
    )
)  # fmt: skip
def test_run_config_dicts_make_a_config_or_a_value_error(data: object) -> None:
    try:
        run = run_config_from_dict(data)  # type: ignore[arg-type]
    except ValueError as exc:
        assert str(exc)
        return
    # Accepted: it is a config that survives its own JSON.
    assert run_config_from_dict(json.loads(json.dumps(run_config_to_dict(run)))) == run


@pytest.fixture(scope="module")
def json_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("run_json")


VALID_JSON = json.dumps(
    run_config_to_dict(
        RunConfig(
            parallelism=Parallelism(n_stages=2),
            data=Data(batch=2, seq_len=16),
            slicing=Plan((1, 1), ((5, 11), (16,))),
        )
    )
)


@FUZZ
@given(st.data(), st.sampled_from([VALID_JSON, (DATA / "run-format1.json").read_text()]))
def test_run_config_files_load_or_fail_with_a_value_error(
    json_dir: Path, data: st.DataObject, text: str
) -> None:
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(text)))
        junk = data.draw(
            st.one_of(
                st.sampled_from([*'{}[]",:0-.', "null", "NaN", "\\u00ff"]),
                st.text(max_size=2),
            )
        )
        text = text[:i] + junk + text[i + data.draw(st.integers(0, 3)) :]
    path = json_dir / "run.json"
    path.write_text(text)
    try:
        load_run_config(path)
    except ValueError as exc:
        assert str(exc)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", r"run config .*run.json is not JSON: Expecting value"),
        ("{", r"run config .*run.json is not JSON"),
        ("[]", r"a run config is a JSON object of RunConfig fields, not \[\]"),
        ('{"stage_ranges": [[0]]}', r"Parallelism.stage_ranges=\(\(0,\),\) must be \(lo, hi\) integer pairs"),
        ('{"format": 2, "parallelism": {"stage_ranges": [[0]]}}', r"Parallelism.stage_ranges=\(\(0,\),\) must be \(lo, hi\)"),
        ('{"model_overrides": [1, 2]}', r"model_overrides=\[1, 2\] must map GPTConfig fields to values"),
        ('{"n_stages": NaN}', r"Parallelism.n_stages=nan must be a positive integer"),
        ('{"slicing": "[(1, [64])] * -1"}', r"repeats a list -1 times"),
    ],
)  # fmt: skip
def test_bad_run_config_files_are_named(json_dir: Path, text: str, match: str) -> None:
    path = json_dir / "run.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_run_config(path)
