"""A scaling rule's window: the readings it saw over its `duration_s`, and whether they breach.

Why a window and not the breach timer of before: one reading every few seconds is noisy. Under an
overload a decode worker's reading dropped to 0.00 twice (a /health answer late, a batch just
drained) and each drop reset the timer, so a sustained breach never lasted the rule's duration; a
scale-in rule, conversely, started its breach in the middle of the load. So each rule keeps its
readings ([epoch seconds, value or null] in `ScalingRule.observations`, one per evaluation) and judges
the whole window at once:

- the window is [now - duration_s, now], cut to the readings after the role's last replica change and
  the rule's last firing: after any change the rule needs a fresh window measured with the new count;
- it *breaches* when at least SCALING_WINDOW_SHARE (0.8) of its readings are on the rule's side of the
  threshold. A missing reading (no worker reported: null) or a dissenting one counts against the
  breach but does not end it: with a reading every 10 s, two stray readings in a 60 s window are
  tolerated. We chose a share over the mean because a mean lets a few extreme readings carry the
  window (three readings of 1.0 in a mostly idle minute average above 0.5) and a missing reading
  has no value to average; every reading but a tolerated share is the same test in both directions,
  so scale-in rules are symmetric to scale-out ones;
- it is *covered* when its first reading is no later than SCALING_WINDOW_GAP_S (evaluation jitter)
  after `now - duration_s`: a rule never fires on a half-empty window, e.g. right after a change or
  after its window was paused. A reading missing at the very start delays firing by one evaluation;
  it never restarts the window;
- a rule fires when its window breaches and is covered (then its cooldown applies).
A rule with duration_s = 0 judges its latest reading alone.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

Reading = tuple[datetime, float | None]
# Readings go through epoch floats in JSON: compare window bounds with this much slack.
SLACK = timedelta(milliseconds=1)


def load_readings(raw: Any) -> list[Reading]:
    """Readings from the stored JSON ([[epoch, value|null], ...]); malformed entries are skipped."""
    readings: list[Reading] = []
    for item in raw if isinstance(raw, list) else []:
        try:
            at, value = item
            readings.append((datetime.fromtimestamp(float(at), tz=UTC), None if value is None else float(value)))
        except (TypeError, ValueError):
            continue
    return sorted(readings, key=lambda r: r[0])


def dump_readings(readings: Sequence[Reading]) -> list[list[float | None]]:
    """The JSON form stored on the rule."""
    return [[at.timestamp(), value] for at, value in readings]


@dataclass
class Verdict:
    """How a window of readings stands against a rule."""

    readings: int
    breaching: int
    share: float
    covered: bool
    first_breach_at: datetime | None
    mean: float | None
    needed: float  # the share of breaching readings that makes a breach

    @property
    def breaches(self) -> bool:
        """Enough readings breach (the window may still be too short to fire)."""
        return self.readings > 0 and self.share >= self.needed

    @property
    def fires(self) -> bool:
        """The window breaches and is covered."""
        return self.breaches and self.covered

    def describe(self) -> str:
        """For the ScaleEvent's reason: "9 of 10 readings (mean 0.93)"."""
        mean = f", mean {self.mean:.2f}" if self.mean is not None else ""
        return f"{self.breaching} of {self.readings} readings{mean}"


def judge(
    readings: Sequence[Reading],
    *,
    now: datetime,
    duration_s: float,
    after: datetime | None,
    breached: Callable[[float], bool],
    share: float,
    gap_s: float,
) -> Verdict:
    """Judge the readings of [now - duration_s, now] taken after `after` (module docstring)."""
    start = now - timedelta(seconds=duration_s)
    inside = [r for r in readings if start - SLACK <= r[0] <= now + SLACK and (after is None or r[0] > after)]
    if duration_s <= 0:
        inside = inside[-1:]
    hits = [r for r in inside if r[1] is not None and breached(r[1])]
    values = [v for _, v in inside if v is not None]
    covered = bool(inside) and inside[0][0] <= start + timedelta(seconds=gap_s) + SLACK
    return Verdict(
        readings=len(inside),
        breaching=len(hits),
        share=len(hits) / len(inside) if inside else 0.0,
        covered=covered,
        first_breach_at=hits[0][0] if hits else None,
        mean=sum(values) / len(values) if values else None,
        needed=share,
    )


def keep_recent(readings: Sequence[Reading], *, now: datetime, keep_s: float) -> list[Reading]:
    """The readings of the last `keep_s` seconds (what the rule stores for its next evaluation)."""
    since = now - timedelta(seconds=keep_s) - SLACK
    return [r for r in readings if r[0] >= since]
