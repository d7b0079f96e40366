"""Per-step timings of the engine thread, for finding where latency tails come from.

Off unless the environment names a folder in `ENGINE_STEP_LOG`: then each engine process appends one
line per step that ran to `<folder>/steps-<pid>.tsv`: wall-clock start (s), duration (ms), prefill
tokens, prefill sequences, decode sequences (the scheduler's `last_plan`), then the rule that set a
mixed step's prompt budget and the prompts waiting when it was planned (`StepPlan.rule` and `.waiting`;
"-" where no rule set one). One line-buffered write
per step (microseconds, against steps of milliseconds), so a worker stopped by a signal loses none.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from .scheduler import StepPlan

ENV = "ENGINE_STEP_LOG"


class StepLog:
    """Appends step timings to a per-process file (see the module docstring); `None` from `from_env`
    when the variable is unset."""

    def __init__(self, folder: Path) -> None:
        """Open `<folder>/steps-<pid>.tsv` for appending (the folder is created)."""
        folder.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = open(folder / f"steps-{os.getpid()}.tsv", "a", buffering=1)  # noqa: SIM115

    @classmethod
    def from_env(cls) -> StepLog | None:
        """A StepLog when `ENGINE_STEP_LOG` names a folder, else None."""
        folder = os.environ.get(ENV)
        return cls(Path(folder)) if folder else None

    def record(self, started: float, plan: StepPlan) -> None:
        """One step that began at `time.time()` value `started` and has just ended, as `plan` planned it
        (the scheduler's `last_plan`)."""
        self._file.write(f"{started:.4f}\t{1000 * (time.time() - started):.2f}\t{plan[0]}\t{plan[1]}\t{plan[2]}"
                         f"\t{plan.rule or '-'}\t{plan.waiting}\n")

    def close(self) -> None:
        """Flush and close the file."""
        self._file.close()
