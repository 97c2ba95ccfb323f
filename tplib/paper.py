"""The paper's numbers as data: Table 1 (settings) and appendix C Tables 2-4 (results).

These values are the REFERENCE the reproduction is compared against; nothing in tplib
uses them as reproduced numbers. The only paper numbers any model may be fitted to are
the "w/o TeraPipe" (GPipe) rows of Table 2 (see :mod:`tplib.cluster`).

Table 1 lists ten settings ``(1)``..``(10)``: a model (N layers, hidden size H), the
sequence length L, the global batch B and the parallel layout: #Data data-parallel
replicas, each a pipeline of #Pipe stages, each stage operation-partitioned over #Op GPUs
(Megatron), so #GPUs = #Data x #Pipe x #Op. One pipeline processes B / #Data sequences per
iteration. "w/o TeraPipe" is GPipe with microbatches of one sequence, which the paper
writes as the slicing scheme ``[(1, [2048])] * (B / #Data)``.

Table 4 varies L for GPT3-13B in setting (5) with the batch shrunk to fit memory:
L = 2048, 4096, 6144, 8192 with B = 32, 8, 4, 2 (:data:`SEQLEN_BATCH`); :func:`setting`
derives those variants with ``seq_len=``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from tplib.nn.configs import GPTConfig, get_config
from tplib.plan import Plan

__all__ = [
    "GPIPE",
    "MAIN_SPEEDUPS",
    "SEQLEN_BATCH",
    "SEQLEN_SPEEDUPS",
    "SETTINGS",
    "TABLE2",
    "TABLE3",
    "TABLE4",
    "TERAPIPE",
    "PaperResult",
    "Setting",
    "ablation_rows",
    "main_row",
    "seqlen_row",
    "setting",
]

GPIPE = "w/o TeraPipe"
TERAPIPE = "w/ TeraPipe"


@dataclass(frozen=True)
class Setting:
    """One row of Table 1: a model and its parallel training layout."""

    index: int  # (1)..(10) in the paper
    model: str  # name in tplib.nn.configs.MODELS
    n_layer: int  # N
    hidden: int  # H
    params_text: str  # the "#Params" column as printed ("1B", "175B")
    seq_len: int  # L
    n_gpus: int  # #GPUs
    batch: int  # B, global batch (all data-parallel replicas together)
    n_data: int  # #Data
    n_stages: int  # #Pipe, K
    n_op: int  # #Op

    def __post_init__(self) -> None:
        if self.n_data * self.n_stages * self.n_op != self.n_gpus:
            raise ValueError(
                f"setting ({self.index}): #Data x #Pipe x #Op = "
                f"{self.n_data * self.n_stages * self.n_op} != #GPUs = {self.n_gpus}"
            )
        if self.batch % self.n_data or self.n_layer % self.n_stages:
            raise ValueError(
                f"setting ({self.index}): B={self.batch} must split over #Data={self.n_data} "
                f"and N={self.n_layer} layers over #Pipe={self.n_stages} stages evenly"
            )

    @property
    def pipeline_batch(self) -> int:
        """Sequences one pipeline (one data-parallel replica) processes: B / #Data."""
        return self.batch // self.n_data

    @property
    def layers_per_stage(self) -> int:
        return self.n_layer // self.n_stages

    @property
    def config(self) -> GPTConfig:
        """The model config, with this setting's sequence length."""
        cfg = get_config(self.model)
        return cfg if cfg.seq_len == self.seq_len else cfg.with_(seq_len=self.seq_len)

    def gpipe_plan(self) -> Plan:
        """The "w/o TeraPipe" plan: microbatches of one sequence, no token slicing."""
        return Plan.gpipe(self.pipeline_batch, self.seq_len, microbatch=1)

    @property
    def label(self) -> str:
        return f"({self.index}) {self.model}" + (
            f" L={self.seq_len}" if self.seq_len != 2048 else ""
        )


def _table1() -> tuple[Setting, ...]:
    # Columns as printed: model, N, H, #Params, L, #GPUs, then B, #Data, #Pipe, #Op per row.
    models = {
        "GPT3-1B": (24, 2048, "1B", 2048, 192),
        "GPT3-13B": (40, 5120, "13B", 2048, 320),
        "GPT3-44B": (96, 6144, "44B", 2048, 384),
        "GPT3-175B": (96, 12288, "175B", 2048, 384),
    }
    rows = [
        ("GPT3-1B", 128, 8, 24, 1),
        ("GPT3-1B", 72, 2, 12, 8),
        ("GPT3-1B", 72, 1, 24, 8),
        ("GPT3-13B", 32, 2, 20, 8),
        ("GPT3-13B", 32, 1, 40, 8),
        ("GPT3-44B", 8, 4, 96, 1),
        ("GPT3-44B", 8, 2, 24, 8),
        ("GPT3-44B", 8, 1, 48, 8),
        ("GPT3-175B", 2, 1, 96, 4),
        ("GPT3-175B", 2, 1, 48, 8),
    ]
    return tuple(
        Setting(i, m, *models[m], batch, n_data, n_pipe, n_op)
        for i, (m, batch, n_data, n_pipe, n_op) in enumerate(rows, start=1)
    )


SETTINGS: dict[int, Setting] = {s.index: s for s in _table1()}

# Table 4 / Figure 7: GPT3-13B, setting (5), batch per sequence length.
SEQLEN_BATCH: dict[int, int] = {2048: 32, 4096: 8, 6144: 4, 8192: 2}


def setting(index: int, seq_len: int | None = None) -> Setting:
    """Setting ``(index)`` of Table 1; with ``seq_len`` the Table 4 variant (setting 5
    only) with the batch the paper shrank to fit memory."""
    if index not in SETTINGS:
        raise ValueError(f"setting ({index}) is not in Table 1: settings are 1..10")
    s = SETTINGS[index]
    if seq_len is None or seq_len == s.seq_len:
        return s
    if index != 5 or seq_len not in SEQLEN_BATCH:
        raise ValueError(
            f"the paper varies L only for setting (5) with L in {sorted(SEQLEN_BATCH)}; "
            f"got setting ({index}) with L={seq_len}"
        )
    return replace(s, seq_len=seq_len, batch=SEQLEN_BATCH[seq_len])


@dataclass(frozen=True)
class PaperResult:
    """One row of appendix C: an algorithm's slicing scheme and its measured latency."""

    table: int  # 2, 3 or 4
    setting: int  # Table-1 index (Table 4 rows are setting 5)
    seq_len: int
    algorithm: str  # "w/o TeraPipe", "w/ TeraPipe", "#Slices=4", "DP"
    scheme: str  # the slicing scheme exactly as printed
    latency: float  # seconds, mean of 10 runs
    latency_std: float  # seconds
    tflops: float  # the paper's "TFlops (per GPU)" column

    @cached_property
    def plan(self) -> Plan:
        return Plan.from_paper(self.scheme)

    @property
    def n_slices(self) -> int | None:
        """Token slices per sequence for the uniform ablation rows ("#Slices=n")."""
        if self.algorithm.startswith("#Slices="):
            return int(self.algorithm.removeprefix("#Slices="))
        return None


def _rows(table: int, rows: list[tuple[int, int, str, str, float, float, float]]) -> tuple:
    return tuple(PaperResult(table, *r) for r in rows)


_G, _T = GPIPE, TERAPIPE

TABLE2: tuple[PaperResult, ...] = _rows(2, [
    (1, 2048, _G, "[(1, [2048])] * 16", 1.517, 0.107, 0.8841),
    (1, 2048, _T, "[(1, [776, 640, 632])] * 16", 1.254, 0.160, 1.0695),
    (2, 2048, _G, "[(1, [2048])] * 36", 1.018, 0.065, 2.9643),
    (2, 2048, _T, "[(1, [2048])] * 36", 1.018, 0.065, 2.9643),
    (3, 2048, _G, "[(1, [2048])] * 72", 0.913, 0.027, 6.6105),
    (3, 2048, _T, "[(1, [2048])] * 72", 0.913, 0.027, 6.6105),
    (4, 2048, _G, "[(1, [2048])] * 16", 2.637, 0.055, 3.0305),
    (4, 2048, _T, "[(1, [1024, 1024])] * 16", 1.891, 0.084, 4.2261),
    (5, 2048, _G, "[(1, [2048])] * 32", 1.863, 0.007, 8.5792),
    (5, 2048, _T, "[(1, [704, 688, 656])] * 32", 1.328, 0.037, 12.0354),
    (6, 2048, _G, "[(1, [2048])] * 2", 13.319, 0.067, 0.2148),
    (6, 2048, _T, "[(1, [64] * 26 + [56] * 6 + [48])] * 2", 7.103, 0.243, 0.4028),
    (7, 2048, _G, "[(1, [2048])] * 4", 4.311, 0.032, 1.3274),
    (7, 2048, _T, "[(1, [368, 384, 384, 368, 256, 288])] * 4", 2.771, 0.112, 2.0652),
    (8, 2048, _G, "[(1, [2048])] * 8", 2.662, 0.001, 4.2995),
    (8, 2048, _T, "[(1, [384, 384, 368, 320, 296, 296])] * 8", 1.111, 0.002, 10.3018),
    (9, 2048, _G, "[(1, [2048])] * 2", 9.990, 0.005, 1.1300),
    (9, 2048, _T, "[(1, [120] * 4 + [112] * 6 + [104] * 8 + [64])] * 2", 1.481, 0.002, 7.6225),
    (10, 2048, _G, "[(1, [2048])] * 2", 5.822, 0.003, 1.9390),
    (10, 2048, _T, "[(1, [128] * 16)] * 2", 1.160, 0.001, 9.7318),
])  # fmt: skip

TABLE3: tuple[PaperResult, ...] = _rows(3, [
    (8, 2048, "#Slices=1", "[(1, [2048])] * 8", 2.662, 0.001, 4.2995),
    (8, 2048, "#Slices=4", "[(1, [512] * 4)] * 8", 1.241, 0.003, 9.2226),
    (8, 2048, "#Slices=8", "[(1, [256] * 8)] * 8", 1.255, 0.004, 9.1197),
    (8, 2048, "#Slices=16", "[(1, [128] * 16)] * 8", 1.241, 0.003, 9.2226),
    (8, 2048, "DP", "[(1, [384, 384, 368, 320, 296, 296])] * 8", 1.111, 0.002, 10.3018),
    (9, 2048, "#Slices=1", "[(1, [2048])] * 2", 9.990, 0.005, 1.1300),
    (9, 2048, "#Slices=4", "[(1, [512] * 4)] * 2", 2.902, 0.003, 3.8900),
    (9, 2048, "#Slices=8", "[(1, [256] * 8)] * 2", 1.892, 0.002, 5.9667),
    (9, 2048, "#Slices=16", "[(1, [128] * 16)] * 2", 1.547, 0.01, 7.2973),
    (9, 2048, "#Slices=32", "[(1, [64] * 32)] * 2", 1.593, 0.002, 7.0866),
    (9, 2048, "#Slices=64", "[(1, [32] * 64)] * 2", 2.227, 0.002, 5.0691),
    (9, 2048, "#Slices=128", "[(1, [16] * 128)] * 2", 3.252, 0.004, 3.4714),
    (9, 2048, "DP", "[(1, [120] * 4 + [112] * 6 + [104] * 8 + [64])] * 2", 1.481, 0.002, 7.6225),
])  # fmt: skip

TABLE4: tuple[PaperResult, ...] = _rows(4, [
    (5, 2048, _G, "[(1, [2048])] * 32", 1.863, 0.007, 8.5792),
    (5, 2048, _T, "[(1, [704, 688, 656])] * 32", 1.328, 0.037, 12.0354),
    (5, 4096, _G, "[(1, [4096])] * 8", 2.526, 0.001, 1.5819),
    (5, 4096, _T, "[(1, [552, 536, 528, 512, 504, 496, 488, 480])] * 8", 0.913, 0.085, 4.3765),
    (5, 6144, _G, "[(1, [6144])] * 4", 3.754, 0.006, 0.5322),
    (5, 6144, _T, "[(1, [584, 568] + [512] * 6 + [496, 488, 472, 464])] * 4", 0.756, 0.008, 2.6427),
    (5, 8192, _G, "[(1, [8192])] * 2", 4.978, 0.004, 0.2007),
    (5, 8192, _T, "[(1, [512] * 6 + [480] * 2 + [416] * 10)] * 2", 0.636, 0.001, 1.5707),
])  # fmt: skip

# Speedups the main text states (§4.1, §4.3), to check the tables against the prose.
MAIN_SPEEDUPS: dict[int, float] = {
    1: 1.21, 2: 1.0, 3: 1.0, 4: 1.40, 5: 1.40, 6: 1.88, 7: 1.56, 8: 2.40, 9: 6.75, 10: 5.02,
}  # fmt: skip
SEQLEN_SPEEDUPS: dict[int, float] = {4096: 2.76, 6144: 4.97, 8192: 7.83}


def main_row(index: int, algorithm: str) -> PaperResult:
    """Table 2's row for setting ``(index)`` and ``GPIPE`` or ``TERAPIPE``."""
    for r in TABLE2:
        if r.setting == index and r.algorithm == algorithm:
            return r
    raise ValueError(f"Table 2 has no row for setting ({index}) and {algorithm!r}")


def seqlen_row(seq_len: int, algorithm: str) -> PaperResult:
    """Table 4's row for sequence length ``seq_len`` and ``GPIPE`` or ``TERAPIPE``."""
    for r in TABLE4:
        if r.seq_len == seq_len and r.algorithm == algorithm:
            return r
    raise ValueError(f"Table 4 has no row for L={seq_len} and {algorithm!r}")


def ablation_rows(index: int) -> tuple[PaperResult, ...]:
    """Table 3's rows for setting (8) or (9), in the printed order."""
    rows = tuple(r for r in TABLE3 if r.setting == index)
    if not rows:
        raise ValueError(f"Table 3 covers settings (8) and (9), not ({index})")
    return rows
