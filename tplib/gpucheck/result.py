"""A step's outcome, as the step's process prints it and the driver reads it back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RESULT_MARK", "StepResult"]

RESULT_MARK = "GPU_CHECK_RESULT "  # starts the last line of a step's output: its result as JSON


@dataclass(frozen=True)
class StepResult:
    """One step's outcome: ``status`` "ok", "failed" or "skipped"; ``summary`` its line in
    the printed summary; ``target`` what it was held to and whether it met it."""

    name: str
    status: str
    summary: str
    target: str = ""
    seconds: float = 0.0
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"
