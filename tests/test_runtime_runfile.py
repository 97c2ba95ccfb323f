"""tplib.runtime.runfile: a RunConfig round-trips through JSON for torchrun jobs, and
a dict or file that is no RunConfig fails with a ValueError naming what is wrong."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.test_runtime_runconfig import FUZZ
from tplib.plan import Plan
from tplib.runtime import (
    RunConfig,
    load_run_config,
    run_config_from_dict,
    run_config_to_dict,
    save_run_config,
)


def test_run_config_round_trips_through_json(tmp_path: Path) -> None:
    run = RunConfig(
        n_stages=2,
        slicing=Plan((1, 1), ((5, 11), (16,))),
        seq_len=16,
        batch=2,
        stage_ranges=((0, 1), (1, 4)),
        model_overrides=(("n_layer", 4),),
        grad_clip=0.5,
        lr_schedule="cosine",
        lr_warmup_steps=3,
        lr_decay_steps=7,
        min_lr_ratio=0.2,
        weight_decay_params="all",
    )
    assert run_config_from_dict(run_config_to_dict(run)) == run
    save_run_config(run, tmp_path / "run.json")
    assert load_run_config(tmp_path / "run.json") == run
    uniform = RunConfig(batch=2, seq_len=16, slicing=4)
    assert run_config_to_dict(uniform)["slicing"] == 4
    assert run_config_from_dict(run_config_to_dict(uniform)) == uniform
    with pytest.raises(ValueError, match=r"unknown RunConfig fields \['stagez'\]"):
        run_config_from_dict({"stagez": 2})


JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 100), st.floats(), st.text(max_size=6)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
FIELD_NAMES = [f.name for f in dataclasses.fields(RunConfig) if f.init]


@FUZZ
@given(
    st.one_of(
        st.dictionaries(st.sampled_from(FIELD_NAMES), JSON_VALUES, max_size=4),
        st.dictionaries(st.sampled_from([*FIELD_NAMES, "stagez", "n_layer", ""]), JSON_VALUES, max_size=3),
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
        RunConfig(n_stages=2, batch=2, seq_len=16, slicing=Plan((1, 1), ((5, 11), (16,))))
    )
)


@FUZZ
@given(st.data())
def test_run_config_files_load_or_fail_with_a_value_error(
    json_dir: Path, data: st.DataObject
) -> None:
    text = VALID_JSON
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
        ('{"stage_ranges": [[0]]}', r"RunConfig.stage_ranges=\(\(0,\),\) must be \(lo, hi\) integer pairs"),
        ('{"model_overrides": [1, 2]}', r"model_overrides=\[1, 2\] must map GPTConfig fields to values"),
        ('{"n_stages": NaN}', r"RunConfig.n_stages=nan must be a positive integer"),
        ('{"slicing": "[(1, [64])] * -1"}', r"repeats a list -1 times"),
    ],
)  # fmt: skip
def test_bad_run_config_files_are_named(json_dir: Path, text: str, match: str) -> None:
    path = json_dir / "run.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_run_config(path)
