"""Guardrails: rules over the run's metrics that decide, record and (when enforcing) act.

rules.py        the Rule/RuleSet model and its invariants; rulefile.py reads YAML rules files
checks.py       one object per check kind (threshold, finite, spike, regression) + the
                ok/pending/firing state machine of one rule
policy.py       the decisions, pure: observations in, decision records and directives out
engine.py       GuardrailEngine: the policy under a lock, its state saved in the store
directives.py   directives handed to the trainer until every rank has applied them
engine_store.py the engine's state in one SQLite database; decisions.jsonl, the log people read, written from it
alerts.py       the same rules as Prometheus alert rules
"""

from parwatch.guardrails.engine import GuardrailEngine, Observation
from parwatch.guardrails.rules import (
    KNOWN_METRICS,
    Rule,
    RuleProblem,
    RulesError,
    RuleSet,
    default_rules,
    load_rules,
    parse_rules,
)

__all__ = [
    "GuardrailEngine",
    "Observation",
    "KNOWN_METRICS",
    "Rule",
    "RuleProblem",
    "RuleSet",
    "RulesError",
    "default_rules",
    "load_rules",
    "parse_rules",
]
