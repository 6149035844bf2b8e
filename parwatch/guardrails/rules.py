"""Guardrail rules: the data model, its invariants, and the YAML rules-file parser.

A Rule checks its own values and how they relate when it is built (cooldown >= for_steps,
a threshold check has exactly one of above/below ...), so a RuleSet made in code is held to
the same rules as one read from a file. The parser only turns YAML nodes into typed values,
reports unknown and missing fields, and maps every problem to the file line it came from.
"""

from __future__ import annotations

import difflib
import importlib.resources
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeGuard

from parwatch.vocabulary import CheckKind, Comparison, Reduce, RuleAction

KNOWN_METRICS = frozenset(
    {
        "loss",
        "bubble_ratio",
        "bubble_excess_ratio",
        "pipeline_skew_ratio",
        "collective_seconds_mean",
        "rank_up",
        "gpu_utilization_ratio",
        "step_seconds",
        # parwatch.sidecar.transfer: transfer time with waiting excluded (per p2p link / collective group),
        # and the straggler attribution's findings (share of the step, cause and place in the series key).
        "collective_transfer_seconds",
        "straggler_ratio",
        # parwatch.sidecar.ledger_window: the goodput ledger over the last minute (docs/goodput.md).
        "goodput_ratio",
        "ettr_ratio",
        # parwatch.guardrails.engine: transient faults per rank (and host) from the checks before the
        # optimizer step, counted over the run.
        "transient_faults",
    }
)
CHECKS = tuple(CheckKind)
ACTIONS = tuple(RuleAction)
REDUCES = tuple(Reduce)
BUILTIN_COOLDOWN_STEPS = 50
"""Cooldown when neither the rule nor `defaults` sets one (raised to the rule's for_steps)."""
MIN_BASELINE_VALUES = 5
"""spike/regression judge only once min(this, window_steps) earlier values form a baseline."""
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


@dataclass(frozen=True)
class RuleProblem:
    file: str
    line: int
    rule: str | None
    field: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}: " if self.line > 0 else f"{self.file}: "
        if self.rule:
            where += f"rule '{self.rule}': "
        if self.field:
            where += f"field '{self.field}': "
        return where + self.message


class RulesError(Exception):
    """A rules file or Rule/RuleSet that cannot be used; carries every problem found."""

    def __init__(self, problems: list[RuleProblem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


def suggest(word: object, choices) -> str:
    """ "; did you mean 'x'?" for a near miss, else the list of choices."""
    close = difflib.get_close_matches(str(word), sorted(choices), n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{close[0]}'?"
    return "; choose one of: " + ", ".join(sorted(choices))


@dataclass(frozen=True)
class Rule:
    name: str
    """Unique id: lowercase letters, digits, '-' and '_' (used in metric labels and alert names)."""
    metric: str
    """Which observed metric the rule reads (one of KNOWN_METRICS)."""
    check: CheckKind = CheckKind.THRESHOLD
    """threshold (above/below), finite (NaN/inf fails), spike or regression (factor x rolling median)."""
    above: float | None = None
    """threshold: fail when the reduced value is greater than this."""
    below: float | None = None
    """threshold: fail when the reduced value is less than this."""
    factor: float | None = None
    """spike/regression: fail when the value exceeds factor x the median of the previous window_steps."""
    window_steps: int | None = None
    """spike/regression: how many previous values form the baseline (>= 2)."""
    min_increase: float | None = None
    """regression: a series counts only while it is more than this above its own median, in the metric's
    unit (None = any rise past the factor counts): a tiny path twice as slow costs nothing worth a page."""
    reduce: Reduce = Reduce.MAX
    """How several series (stages, ranks, ops) become one value: max, min or mean."""
    for_steps: int = 1
    """Consecutive failing evaluations before the rule fires (1 = at once)."""
    for_seconds: float | None = None
    """Also require the failure to last this long (None = no time condition)."""
    action: RuleAction = RuleAction.ALERT
    """What firing does: alert (record only), pause, or rollback."""
    cooldown_steps: int = BUILTIN_COOLDOWN_STEPS
    """After acting, the rule does not act again for this many executed steps (>= for_steps)."""
    no_data_seconds: float | None = None
    """The metric absent this long is itself a finding (None = never)."""
    skip_batches: int | str = 0
    """rollback: batches to skip after loading, or "window" for the failing window's batches."""
    line: int = 0
    """Line of the rule in its file (0 when built in code)."""

    def bound(self) -> tuple[Comparison, float]:
        """threshold: (above or below, the line); validation guarantees exactly one is set."""
        if self.above is not None:
            return Comparison.ABOVE, self.above
        if self.below is not None:
            return Comparison.BELOW, self.below
        raise ValueError(f"rule {self.name!r} ({self.check}) has neither 'above' nor 'below'")

    def baseline_terms(self) -> tuple[float, int]:
        """spike/regression: (factor, window_steps); validation guarantees both are set."""
        if self.factor is None or self.window_steps is None:
            raise ValueError(f"rule {self.name!r} ({self.check}) has no factor and window_steps")
        return self.factor, self.window_steps

    def __post_init__(self):
        problems = _rule_problems(self)
        if problems:
            raise RulesError([RuleProblem("<Rule>", self.line, self.name or None, f, m) for f, m in problems])
        for name, kind in (("check", CheckKind), ("reduce", Reduce), ("action", RuleAction)):
            object.__setattr__(self, name, kind(getattr(self, name)))  # a file's words become the members


def _is_number(x: object) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _rule_problems(r: Rule) -> list[tuple[str, str]]:
    """(field, message) for every value or relation of a rule that cannot work."""
    out = []
    if not isinstance(r.name, str) or not _NAME_RE.match(r.name):
        out.append(
            ("name", f"{r.name!r} is not a valid name; use lowercase letters, digits, '-' and '_', e.g. 'loss-spike'")
        )
    if r.metric not in KNOWN_METRICS:
        out.append(("metric", f"unknown metric {r.metric!r}" + suggest(r.metric, KNOWN_METRICS)))
    if r.check not in CHECKS:
        out.append(("check", f"unknown check {r.check!r}" + suggest(r.check, CHECKS)))
    if r.action not in ACTIONS:
        out.append(("action", f"unknown action {r.action!r}" + suggest(r.action, ACTIONS)))
    if r.reduce not in REDUCES:
        hint = "; did you mean 'mean'?" if r.reduce in ("avg", "average") else suggest(r.reduce, REDUCES)
        out.append(("reduce", f"unknown reduce {r.reduce!r}" + hint))
    for name in ("above", "below", "factor", "for_seconds", "no_data_seconds"):
        value = getattr(r, name)
        if value is not None and not _is_number(value):
            out.append((name, f"{value!r} is not a finite number; write a number such as 0.5"))
    for name in ("for_seconds", "no_data_seconds"):
        value = getattr(r, name)
        if _is_number(value) and value <= 0:
            out.append((name, f"must be > 0, got {value}; remove the field to disable it"))
    if r.check == CheckKind.THRESHOLD:
        if (r.above is None) == (r.below is None):
            which = "both are set" if r.above is not None else "neither is set"
            out.append(
                ("above", f"a threshold check needs exactly one of 'above' or 'below' ({which}); e.g. above: 0.1")
            )
    else:
        for name in ("above", "below"):
            if getattr(r, name) is not None:
                out.append((name, f"only the threshold check uses '{name}'; remove it, or set check: threshold"))
    if r.check in (CheckKind.SPIKE, CheckKind.REGRESSION):
        if not _is_number(r.factor) or r.factor <= 1:
            out.append(
                (
                    "factor",
                    f"{r.check} needs factor > 1 (how many times the baseline median fails), "
                    f"got {r.factor!r}; e.g. factor: 2.0",
                )
            )
        if not _is_int(r.window_steps) or r.window_steps < 2:
            out.append(
                (
                    "window_steps",
                    f"{r.check} needs window_steps >= 2 (values in the baseline), "
                    f"got {r.window_steps!r}; e.g. window_steps: 50",
                )
            )
    else:
        for name in ("factor", "window_steps"):
            if getattr(r, name) is not None:
                out.append((name, f"only spike and regression checks use '{name}'; remove it"))
    if r.min_increase is not None and r.check != CheckKind.REGRESSION:
        out.append(("min_increase", "only the regression check uses 'min_increase'; remove it"))
    elif r.min_increase is not None and (not _is_number(r.min_increase) or r.min_increase < 0):
        out.append(("min_increase", f"must be a number >= 0 in the metric's unit, got {r.min_increase!r}; e.g. 0.002"))
    if r.check == CheckKind.FINITE and r.reduce != Reduce.MAX:
        out.append(("reduce", "a finite check fails on any non-finite series, so 'reduce' has no effect; remove it"))
    if not _is_int(r.for_steps) or r.for_steps < 1:
        out.append(("for_steps", f"must be an integer >= 1 (1 = fire at once), got {r.for_steps!r}"))
    if not _is_int(r.cooldown_steps) or r.cooldown_steps < 0:
        out.append(("cooldown_steps", f"must be an integer >= 0, got {r.cooldown_steps!r}"))
    elif _is_int(r.for_steps) and r.cooldown_steps < r.for_steps:
        out.append(
            (
                "cooldown_steps",
                f"cooldown_steps ({r.cooldown_steps}) is less than for_steps "
                f"({r.for_steps}): the rule could act again on the same failure; "
                f"set cooldown_steps: {r.for_steps} or more",
            )
        )
    skip = r.skip_batches
    if not ((_is_int(skip) and skip >= 0) or skip == "window"):
        out.append(("skip_batches", f'must be an integer >= 0 or "window", got {skip!r}'))
    elif r.action != RuleAction.ROLLBACK and skip != 0:
        out.append(("skip_batches", "only a rollback skips batches; remove it or set action: rollback"))
    return out


@dataclass(frozen=True)
class RuleSet:
    version: int = 1
    """Rules-file format version; only 1 exists."""
    enforce: bool = True
    """False = dry run: decide and record, never hand out a directive."""
    rules: tuple[Rule, ...] = ()
    max_rollbacks: int = 3
    """More rule-made rollbacks than this within rollback_window_steps escalate to pause (0 = always pause)."""
    rollback_window_steps: int = 500
    """The window, in executed steps, over which rollbacks are counted."""
    source: str = "<code>"
    """Where the rules came from (a path, or <string>/<code>)."""
    line_of: dict = field(default_factory=dict, compare=False, repr=False)
    """Top-level field -> line in the file, for error messages."""

    def __post_init__(self):
        object.__setattr__(self, "rules", tuple(self.rules))
        problems = []

        def add(line, rule, fld, msg):
            problems.append(RuleProblem(self.source, line, rule, fld, msg))

        if self.version != 1:
            add(
                self.line_of.get("version", 1),
                None,
                "version",
                f"unsupported version {self.version!r}; this parwatch reads version: 1",
            )
        if not isinstance(self.enforce, bool):
            add(self.line_of.get("enforce", 1), None, "enforce", f"must be true or false, got {self.enforce!r}")
        if not _is_int(self.max_rollbacks) or self.max_rollbacks < 0:
            add(
                self.line_of.get("rollback.max_rollbacks", 1),
                None,
                "rollback.max_rollbacks",
                f"must be an integer >= 0, got {self.max_rollbacks!r}",
            )
        if not _is_int(self.rollback_window_steps) or self.rollback_window_steps < 1:
            add(
                self.line_of.get("rollback.window_steps", 1),
                None,
                "rollback.window_steps",
                f"must be an integer >= 1, got {self.rollback_window_steps!r}",
            )
        seen: dict[str, int] = {}
        for rule in self.rules:
            if rule.name in seen:
                add(
                    rule.line,
                    rule.name,
                    "name",
                    f"duplicate name (first defined on line {seen[rule.name]}); give each rule its own name",
                )
            seen.setdefault(rule.name, rule.line)
        if problems:
            raise RulesError(problems)

    def rule(self, name: str) -> Rule | None:
        return next((r for r in self.rules if r.name == name), None)


def parse_rules(text: str, source: str = "<string>") -> RuleSet:
    """Parse a rules file; every problem found is collected before RulesError is raised."""
    from parwatch.guardrails.rulefile import parse_ruleset

    return parse_ruleset(text, source)


def load_rules(path) -> RuleSet:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise RulesError(
            [RuleProblem(str(path), 0, None, None, f"cannot read the rules file: {e.strerror}; check the path")]
        ) from e
    return parse_rules(text, str(path))


def default_rules() -> RuleSet:
    """The packaged parwatch/sidecar/default_rules.yaml."""
    resource = importlib.resources.files("parwatch") / "sidecar" / "default_rules.yaml"
    return parse_rules(resource.read_text(encoding="utf-8"), "parwatch/sidecar/default_rules.yaml")
