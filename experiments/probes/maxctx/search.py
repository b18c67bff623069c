"""The search of experiments/probes/max_context.py: the largest multiple of a granule whose load fits (<= 1), for a load
that does not decrease with the length (`search_max`); plain Python, tested on synthetic loads."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable


@dataclasses.dataclass
class SearchResult:
    """`best`: the longest probed length that fits (None: none did); `first_failing`: the shortest probed length
    that does not (None: none failed); `exact`: the two are one granule apart, or `best` is the cap."""

    best: int | None
    first_failing: int | None
    exact: bool
    probes: list[tuple[int, float]]
    stopped: str


def _floor(t: float, g: int) -> int:
    return int(math.floor(t / g)) * g


def search_max(load: Callable[[int], float], start: int, granularity: int, *, t_min: int, t_max: int,
               max_probes: int = 8, should_stop: Callable[[], bool] | None = None,
               slope: float | None = None) -> SearchResult:
    """The largest multiple T of `granularity` in [t_min, t_max] with load(T) <= 1, for a load that does not
    decrease with T (a probe that raised may return math.inf). `slope` (load per token) guides the step after
    the first probe; afterwards secant steps through the two probes nearest the boundary. Stops when the bracket
    is one granule wide, at `max_probes`, or when `should_stop()` says so before a probe (a deadline)."""
    g = granularity
    t_min, t_max = -(-t_min // g) * g, _floor(t_max, g)
    if t_min > t_max:
        raise ValueError(f"search_max: no multiple of {g} in [{t_min}, {t_max}]")
    points: dict[int, float] = {}
    lo = hi = None
    t = min(max(_floor(start, g), t_min), t_max)
    stopped, crept, sides = "probes", False, []
    while len(points) < max_probes:
        if should_stop is not None and should_stop():
            stopped = "deadline"
            break
        points[t] = value = load(t)
        if value <= 1.0:
            lo = t if lo is None else max(lo, t)
        else:
            hi = t if hi is None else min(hi, t)
        if lo is not None and (lo >= t_max or (hi is not None and hi - lo <= g)):
            stopped = "bracket" if lo < t_max else "cap"
            break
        if hi is not None and hi <= t_min:
            stopped = "nothing fits"
            break
        sides.append(value <= 1.0)
        # Regula falsi on a curved load creeps from one side: after two probes on the same side (or one pulled
        # to a bracket end that did not close it), the next probe halves the bracket.
        same_side = len(sides) >= 3 and sides[-1] == sides[-2] and hi is not None and lo is not None
        t, crept = _next_guess(points, lo, hi, g, t_min, t_max, slope, bisect=crept or same_side)
    exact = lo is not None and (lo >= t_max or (hi is not None and hi - lo <= g))
    exact = exact or (hi is not None and hi <= t_min)
    return SearchResult(lo, hi, exact, sorted(points.items()), stopped)


def _next_guess(points, lo, hi, g, t_min, t_max, slope, *, bisect: bool) -> tuple[int, bool]:
    """(next length, whether it was pulled to a bracket end): the secant's root (where the load rises through the
    two points), floored to the granule and kept strictly inside the bracket; the bracket's middle after a pulled
    probe that did not close the bracket (a load with jumps stalls the secant at one end)."""
    if bisect and lo is not None and hi is not None:
        return max(_floor((lo + hi) / 2, g), lo + g), False
    finite = {t: v for t, v in points.items() if math.isfinite(v)}
    if lo is not None and hi is not None and math.isfinite(points[hi]):
        (ta, va), (tb, vb) = (lo, points[lo]), (hi, points[hi])
    elif len(finite) >= 2:  # all on one side: the two probes nearest the other side (a load with jumps, as
        # nested blocks', is only locally affine: the nearest by load may lie before a jump)
        ends = sorted(finite.items())
        (ta, va), (tb, vb) = ends[-2:] if hi is None else ends[:2]
    elif finite and slope:
        ta, va = next(iter(finite.items()))
        tb, vb = ta + 1.0, va + slope
    else:
        ta = vb = va = tb = None
    # A load falling with T (nested blocks: a longer row takes larger blocks, so fewer host copies) has no secant
    # root ahead: double or halve the bracket instead.
    if ta is not None and (vb - va) * (tb - ta) > 0:
        guess = ta + (1.0 - va) * (tb - ta) / (vb - va)
    elif lo is not None and hi is not None:
        guess = (lo + hi) / 2
    elif lo is not None:
        guess = 2 * lo
    else:
        guess = hi / 2
    guess = _floor(min(max(guess, t_min), t_max), g)
    low = t_min if lo is None else lo + g  # strictly inside the bracket
    high = t_max if hi is None else hi - g
    pulled = min(max(guess, low), high)
    return pulled, pulled != guess
