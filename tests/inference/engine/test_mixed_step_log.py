"""The step log's columns (ENGINE_STEP_LOG, step_log.py): a mixed step's budget rule and the prompts that
waited, beside the plan's numbers, so a tail can be traced to the rule that made it."""
from __future__ import annotations

import os
from pathlib import Path

from inference.engine.scheduler import StepPlan
from inference.engine.step_log import StepLog


def test_a_step_plan_compares_as_its_numbers() -> None:
    """A StepPlan equals the plain (tokens, prefill sequences, decode sequences) tuple it carries."""
    plan = StepPlan(64, 1, 6, "cost", 2)
    assert plan == (64, 1, 6) and plan[0] == 64 and (plan.rule, plan.waiting) == ("cost", 2)
    assert (StepPlan(0, 0, 3).rule, StepPlan(0, 0, 3).waiting) == ("", 0)


def test_the_log_writes_the_rule_and_the_queue(tmp_path: Path) -> None:
    """Seven tab-separated columns: start, ms, tokens, prefill sequences, decode sequences, rule ("-"
    for none), waiting prompts."""
    log = StepLog(tmp_path)
    log.record(1000.0, StepPlan(896, 7, 1, "burst", 7))
    log.record(1001.0, StepPlan(0, 0, 8))
    log.record(1002.0, StepPlan(16, 1, 2, "", 3))
    log.close()
    rows = [line.split("\t") for line in (tmp_path / f"steps-{os.getpid()}.tsv").read_text().splitlines()]
    assert [r[2:] for r in rows] == [["896", "7", "1", "burst", "7"], ["0", "0", "8", "-", "0"],
                                     ["16", "1", "2", "-", "3"]]
    assert all(float(r[1]) >= 0 for r in rows)
