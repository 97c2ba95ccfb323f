"""What a profile timed, and how a run differs from it.

A profile times a stage on one device, in one ``precision`` (fp32; bf16 autocast over
fp32 weights; fp16), with one ``attention`` implementation and one ``dropout`` rate. A
plan is only as good as the cost it was priced with, so a run planned from a profile
that timed something else is told so: :func:`differences` names each mismatch and
:func:`warn_mismatch` raises a :class:`ProfileMismatchWarning` with the command that
re-profiles. Files older than these fields say :data:`UNKNOWN`. No torch here.
"""

from __future__ import annotations

import warnings

from tplib.nn.configs import PRECISIONS

__all__ = [
    "ATTENTIONS",
    "IMPLS",
    "UNKNOWN",
    "WIRE_BYTES",
    "ProfileMismatchWarning",
    "check_timed",
    "describe_timed",
    "differences",
    "run_attention",
    "warn_mismatch",
]

UNKNOWN = "unknown"  # what an older file does not say
# What a slice's attention was timed as: "default" (the implementation the runtime picks
# for the device, tplib.nn.context.slice_attention), "split" or "masked" (named ones), or
# "math" (written out, tplib.nn.context.math_attention: what any run with dropout runs).
IMPLS = ("split", "masked")  # tplib.nn.context.ATTENTION_IMPLS: the ones a profile may name
ATTENTIONS = ("default", *IMPLS, "math")
# Bytes per activation element sent between stages: the runtime sends the parameters'
# dtype (tplib.nn.precision.param_dtype), float32 under bf16 autocast too.
WIRE_BYTES = {"fp32": 4, "bf16": 4, "fp16": 2, UNKNOWN: 4}


class ProfileMismatchWarning(UserWarning):
    """A run is planned from a profile that timed something else than the run will do."""


def run_attention(dropout: float) -> str:
    """The attention a run with ``dropout`` runs (it has no other choice): written out
    ("math") to drop by position, else the device's default."""
    return "math" if dropout > 0 else "default"


def check_timed(precision: str, attention: str, dropout: object) -> None:
    """Raise ``ValueError`` unless these are conditions a profile can have timed."""
    if precision not in (*PRECISIONS, UNKNOWN):
        raise ValueError(f"precision {precision!r}: choose one of {PRECISIONS} (or {UNKNOWN!r})")
    if attention not in (*ATTENTIONS, UNKNOWN):
        raise ValueError(f"attention {attention!r}: choose one of {ATTENTIONS} (or {UNKNOWN!r})")
    if isinstance(dropout, bool) or not isinstance(dropout, int | float):
        raise ValueError(f"dropout={dropout!r}: must be a number in [0, 1)")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout}: must be in [0, 1)")
    if attention != UNKNOWN and (attention == "math") != (dropout > 0):
        raise ValueError(
            f"attention {attention!r} with dropout={dropout}: attention is written "
            "out ('math') exactly when the stage drops"
        )


def describe_timed(device: str, precision: str, attention: str, dropout: float) -> str:
    """What was timed, in words: device, precision, attention, dropout."""
    return f"{device}, precision {precision}, attention {attention}, dropout {dropout:g}"


def differences(timed: dict[str, str], *, precision: str, dropout: float, device: str) -> list[str]:
    """How a run in ``precision`` with ``dropout`` on ``device`` (its type is compared)
    differs from what was ``timed`` (device, precision, attention, dropout as text), one
    line per difference. The run's attention follows from its dropout
    (:func:`run_attention`); a profile of a named implementation ("split", "masked")
    differs from the run's "default", even where the device's default is that one."""
    run = {
        "device": device.split(":")[0],
        "precision": precision,
        "attention": run_attention(dropout),
        "dropout": f"{dropout:g}",
    }
    return [
        f"{name}: the profile timed {timed[name]!r}, the run {run[name]!r}"
        if timed[name] != UNKNOWN
        else f"{name}: the profile does not say (an older file), the run {run[name]!r}"
        for name in run
        if timed[name] != run[name]
    ]


def warn_mismatch(
    diffs: list[str], *, source: str, timed: str, precision: str, dropout: float, device: str
) -> None:
    """Warn (:class:`ProfileMismatchWarning`) that a run differs as ``diffs`` say from
    what ``source`` timed, naming the command that re-profiles; nothing if none."""
    if diffs:
        warnings.warn(
            f"{source} timed {timed}, not what the run does ({'; '.join(diffs)}): "
            "the plan is priced on another cost. Re-profile with the run's options "
            f"(python -m tplib profile --device {device.split(':')[0]} --dtype {precision} "
            f"--dropout {dropout:g})",
            ProfileMismatchWarning,
            stacklevel=3,
        )
