"""The packed-sequences table (tplib.tables.packed_sequences): the DP's plan per packed
batch never loses to uniform slices or to the unpacked plan on its own cost model, the
stream conserves its tokens and reports the packings' padding, and bad input is refused."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pandas as pd
import pytest

from tplib.nn.doc_lengths import document_stream, lognormal_lengths
from tplib.packing import Packing
from tplib.tables import Rows, run_table
from tplib.tables.packed_report import findings
from tplib.tables.packed_sequences import SEQ_LEN, batches, simulate

L = SEQ_LEN
N_BATCHES = 4


@pytest.fixture(scope="module")
def built() -> Rows:
    """Setting (6) (B = 2 rows, K = 96) on DGX H100, both sources, an exact DP (eps = 0)."""
    return simulate(settings=[6], clusters=["dgx-h100"], n_batches=N_BATCHES, eps=0.0,
                    cache_buckets=[32, L])  # fmt: skip


def _per_batch(rows: Rows) -> pd.DataFrame:
    per_batch: pd.DataFrame = rows.traces["per_batch"]
    return per_batch.pivot_table(
        index=["source", "batch"], columns="scheme", values="iteration_s", aggfunc="first"
    )


def _row(rows: Rows, source: str, scheme: str) -> dict[str, Any]:
    """The table's row of ``source`` and ``scheme``."""
    found = [
        r for r in rows.df.to_dict("records") if (r["source"], r["scheme"]) == (source, scheme)
    ]
    assert len(found) == 1
    return {str(k): v for k, v in found[0].items()}


def test_the_dp_never_loses_to_uniform_slices_or_the_unpacked_plan(built: Rows) -> None:
    t = _per_batch(built)
    assert len(t) == 2 * N_BATCHES
    assert (t["packed-dp"] <= t["packed-uniform"] * (1 + 1e-12)).all()
    assert (t["packed-dp"] <= t["packed-unmasked"] * (1 + 1e-12)).all()
    # Somewhere the documents are worth a plan of their own (log-normal rows hold several).
    assert (t["packed-dp"] < 0.99 * t["packed-uniform"]).any()
    assert "at least as fast as uniform slices" in findings(built.df)


def test_packing_changes_the_tokens_not_the_unmasked_iteration(built: Rows) -> None:
    t = _per_batch(built)
    assert (t["packed-unmasked"] == t["pad"]).all()  # the same plan on whole rows
    assert t["pad"].nunique() == 1  # every padded batch is the same unpacked batch
    for source in ("corpus", "lognormal"):
        pad, packed = _row(built, source, "pad"), _row(built, source, "packed-unmasked")
        assert packed["real_tokens"] > pad["real_tokens"]
        gain = packed["real_tokens"] / pad["real_tokens"]  # same seconds, more tokens
        assert packed["speedup_over_pad"] == pytest.approx(gain)


def _pieces(lengths: list[int]) -> list[int]:
    out = []
    for n in lengths:
        while n > L:
            out.append(L)
            n -= L
        out.append(n)
    return out


def test_the_pad_scheme_is_the_streams_first_pieces_one_per_row(built: Rows) -> None:
    rows = 2 * N_BATCHES  # B = 2 rows a batch
    pieces = _pieces(lognormal_lengths(rows, seq_len=L, seed=0))[:rows]
    row = _row(built, "lognormal", "pad")
    assert row["real_tokens"] == sum(pieces)
    assert row["padding_fraction"] == pytest.approx(1 - sum(pieces) / (rows * L))


def _new_pieces(packings: list[Packing]) -> list[int]:
    """The pieces each batch drew from the stream, after those carried over to it."""
    out, carried = [], 0
    for p in packings:
        out += list(p.lengths[carried:])
        carried = len(p.left_out)
    return out


@pytest.mark.parametrize("packed", [False, True])
def test_the_stream_places_every_piece_once_and_carries_the_rest(packed: bool) -> None:
    packings = batches(
        document_stream("lognormal", seq_len=L, seed=0), rows=8, n_batches=5, packed=packed
    )
    drawn = _new_pieces(packings)
    # What the batches drew is the stream's prefix, cut into pieces of at most L.
    lengths = lognormal_lengths(len(drawn), seq_len=L, seed=0)
    assert drawn == _pieces(lengths)[: len(drawn)]
    for before, after in itertools.pairwise(packings):
        carried = [before.lengths[d] for d in before.left_out]
        assert list(after.lengths[: len(carried)]) == carried
    last = packings[-1]
    left = sum(last.lengths[d] for d in last.left_out)
    assert sum(p.real_tokens for p in packings) + left == sum(drawn)  # tokens conserved
    assert all(p.batch == 8 for p in packings)
    if packed:  # first-fit decreasing leaves little room in a full batch
        assert all(p.padding_fraction < 0.05 for p in packings)


def test_the_table_reports_the_packings_padding_and_real_tokens(built: Rows) -> None:
    for source in ("corpus", "lognormal"):
        packings = batches(
            document_stream(source, seq_len=L, seed=0), rows=2, n_batches=N_BATCHES, packed=True
        )
        for scheme in ("packed-unmasked", "packed-uniform", "packed-dp", "packed-snap"):
            row = _row(built, source, scheme)
            assert row["real_tokens"] == sum(p.real_tokens for p in packings)
            assert row["padding_fraction"] == pytest.approx(
                np.mean([p.padding_fraction for p in packings])
            )


def test_the_cache_extra_counts_hits(built: Rows) -> None:
    cache = {r["bucket"]: r for r in built.extras["cache"].to_dict("records")}
    assert {r["source"] for r in cache.values()} == {"corpus"}
    # A bucket of L tokens keys every batch alike: all but the first batch hit.
    assert cache[L]["hit_rate"] == (N_BATCHES - 1) / N_BATCHES and cache[L]["plans"] == 1
    assert cache[32]["hit_rate"] <= cache[L]["hit_rate"]


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"settings": [11]}, r"settings=\[11\]: Table 1's settings are"),
        ({"clusters": ["tpu"]}, r"clusters=\['tpu'\]: choose among"),
        ({"sources": ["web"]}, r"sources=\['web'\]: choose among"),
        ({"granularity": 12}, r"granularity=12: the DP's grid must be a multiple"),
        ({"cache_buckets": [8]}, r"cache_buckets=\[8\]: a bucket is no finer than"),
        ({"n_batches": 0}, r"n_batches=0, bmax=4, eps=1e-05: at least one batch"),
        ({"eps": -1.0}, r"eps=-1.0: at least one batch"),
        ({"settings": 5}, r"settings=5 is not of type"),
    ],
)
def test_bad_parameters_are_refused_before_any_work(params: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_table("packed_sequences", **params)  # type: ignore[arg-type]
