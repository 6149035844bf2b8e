"""Read a rules file's YAML into a RuleSet, keeping each field's line for error messages.

YAML is composed into nodes (which carry line numbers) and each scalar is constructed
on its own, so a problem can point at the line of the field that caused it. Every
problem is collected before one RulesError is raised: a user fixes a file in one pass.
"""

from __future__ import annotations

import yaml

from parwatch.guardrails.rules import (
    BUILTIN_COOLDOWN_STEPS,
    Rule,
    RuleProblem,
    RulesError,
    RuleSet,
    suggest,
)

TOP_FIELDS = ("version", "enforce", "defaults", "rollback", "rules")
DEFAULTS_FIELDS = ("cooldown_steps", "no_data_seconds")
ROLLBACK_FIELDS = ("max_rollbacks", "window_steps")
RULE_TYPES = {
    "name": "text",
    "metric": "text",
    "check": "text",
    "above": "number",
    "below": "number",
    "factor": "number",
    "window_steps": "int",
    "min_increase": "number",
    "reduce": "text",
    "for_steps": "int",
    "for_seconds": "number",
    "action": "text",
    "cooldown_steps": "int",
    "no_data_seconds": "number or null",
    "skip_batches": "int or window",
}
REQUIRED_RULE_FIELDS = ("name", "metric", "action")
_EXAMPLES = {
    "text": "a word",
    "int": "a whole number such as 10",
    "number": "a number such as 0.5",
    "number or null": "a number such as 120, or null to disable",
    "int or window": "a whole number such as 0, or window",
    "bool": "true or false",
}


def _describe(value) -> str:
    if value is None:
        return "nothing (an empty value)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (true/false)"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, str):
        return f"the text {value!r}"
    return repr(value)


class _Reader:
    def __init__(self, text: str, source: str):
        self.source = source
        self.problems: list[RuleProblem] = []
        self.loader = yaml.SafeLoader(text)

    def problem(self, line, rule, fld, message):
        self.problems.append(RuleProblem(self.source, line, rule, fld, message))

    def mapping(self, node, rule, allowed, what) -> dict:
        """field -> (key line, value node); reports non-mappings, duplicates and unknown fields."""
        line = node.start_mark.line + 1
        if not isinstance(node, yaml.MappingNode):
            self.problem(
                line,
                rule,
                None,
                f"{what} must be a mapping of 'field: value' lines, "
                f"got {_describe(self.loader.construct_object(node, deep=True))}",
            )
            return {}
        out: dict[str, tuple[int, yaml.Node]] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            key_line = key_node.start_mark.line + 1
            if key is None or key not in allowed:  # a non-scalar key is never allowed
                self.problem(key_line, rule, str(key), f"unknown field in {what}" + suggest(key, allowed))
            elif key in out:
                self.problem(key_line, rule, key, f"given twice (also on line {out[key][0]}); keep one")
            else:
                out[key] = (key_line, value_node)
        return out

    def value(self, node, kind, rule, fld):
        """(ok, value) with the YAML value converted to `kind`, or a problem reported."""
        value = self.loader.construct_object(node, deep=True)
        line = node.start_mark.line + 1
        if kind == "number" or kind == "number or null":
            if value is None and kind == "number or null":
                return True, None
            # YAML 1.1 reads an unquoted 1e-2 as text; accept it as the number it looks like.
            if isinstance(value, str) and isinstance(node, yaml.ScalarNode) and node.style is None:
                try:
                    return True, float(value)
                except ValueError:
                    pass
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif kind == "int" or kind == "int or window":
            ok = (isinstance(value, int) and not isinstance(value, bool)) or (
                kind == "int or window" and value == "window"
            )
        elif kind == "bool":
            ok = isinstance(value, bool)
        else:
            ok = isinstance(value, str) and value != ""
        if not ok:
            self.problem(line, rule, fld, f"expected {_EXAMPLES[kind]}, got {_describe(value)}")
        return ok, value

    def top(self, root) -> RuleSet | None:
        fields = self.mapping(root, None, TOP_FIELDS, "the rules file")
        line_of = {k: v[0] for k, v in fields.items()}
        settings = {}
        for key, kind in (("version", "int"), ("enforce", "bool")):
            if key in fields:
                ok, value = self.value(fields[key][1], kind, None, key)
                if ok:
                    settings[key] = value
        if "version" not in fields and isinstance(root, yaml.MappingNode):
            self.problem(1, None, "version", "missing; add 'version: 1' at the top of the file")
        defaults = self.section(
            fields, "defaults", DEFAULTS_FIELDS, {"cooldown_steps": "int", "no_data_seconds": "number or null"}, line_of
        )
        rollback = self.section(
            fields, "rollback", ROLLBACK_FIELDS, {"max_rollbacks": "int", "window_steps": "int"}, line_of
        )
        rules = []
        if "rules" not in fields:
            if isinstance(root, yaml.MappingNode):
                self.problem(1, None, "rules", "missing; add a 'rules:' list (an empty one is 'rules: []')")
        elif not isinstance(fields["rules"][1], yaml.SequenceNode):
            self.problem(fields["rules"][0], None, "rules", "must be a list of rules, each starting with '- name:'")
        else:
            first_line: dict[str, int] = {}
            for index, node in enumerate(fields["rules"][1].value):
                rule = self.rule(node, index, defaults)
                name, line = self.name_of(node)
                if name in first_line:
                    self.problem(
                        line,
                        name,
                        "name",
                        f"duplicate name (first defined on line {first_line[name]}); give each rule its own name",
                    )
                elif rule is not None:
                    rules.append(rule)
                if name is not None:
                    first_line.setdefault(name, line)
        try:
            limits = {
                "max_rollbacks": rollback.get("max_rollbacks"),
                "rollback_window_steps": rollback.get("window_steps"),
            }
            ruleset = RuleSet(
                version=settings.get("version", 1),
                enforce=settings.get("enforce", True),
                rules=tuple(rules),
                source=self.source,
                line_of=line_of,
                **{k: v[0] for k, v in limits.items() if v is not None},
            )
            return None if self.problems else ruleset
        except RulesError as e:
            self.problems.extend(e.problems)
            return None

    def section(self, fields, name, allowed, kinds, line_of) -> dict:
        """A small settings mapping (defaults, rollback): field -> (value, line)."""
        if name not in fields:
            return {}
        out = {}
        for key, (line, node) in self.mapping(fields[name][1], None, allowed, f"'{name}'").items():
            ok, value = self.value(node, kinds[key], None, f"{name}.{key}")
            if ok:
                out[key] = (value, line)
                line_of[f"{name}.{key}"] = line
        return out

    @staticmethod
    def name_of(node) -> tuple[str | None, int]:
        """A rule node's name (None if it has none) and line."""
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if getattr(key_node, "value", None) == "name" and isinstance(value_node, yaml.ScalarNode):
                    return value_node.value or None, node.start_mark.line + 1
        return None, node.start_mark.line + 1

    def rule(self, node, index, defaults) -> Rule | None:
        """The rule at rules[index], or None after reporting its problems."""
        label = self.name_of(node)[0] or f"rules[{index}]"
        line = node.start_mark.line + 1
        fields = self.mapping(node, label, tuple(RULE_TYPES), "a rule")
        if not fields and not isinstance(node, yaml.MappingNode):
            return None
        for required in REQUIRED_RULE_FIELDS:
            if required not in fields:
                hint = {"name": "name: my-rule", "metric": "metric: loss", "action": "action: alert"}[required]
                self.problem(line, label, required, f"missing; every rule needs it, e.g. '{hint}'")
        kwargs, lines = {}, {k: v[0] for k, v in fields.items()}
        unusable = {k for k in REQUIRED_RULE_FIELDS if k not in fields}
        for key, (_, value_node) in fields.items():
            ok, value = self.value(value_node, RULE_TYPES[key], label, key)
            if ok:
                kwargs[key] = value
            else:
                unusable.add(key)
        inherited = set()
        for key in DEFAULTS_FIELDS:
            if key not in fields and key in defaults:
                kwargs[key], lines[key] = defaults[key]
                inherited.add(key)
        if "cooldown_steps" not in kwargs:
            kwargs["cooldown_steps"] = max(
                BUILTIN_COOLDOWN_STEPS, kwargs.get("for_steps", 1) if isinstance(kwargs.get("for_steps"), int) else 1
            )
        # Stand-ins for missing or mistyped fields let the Rule report every other problem too;
        # problems about the stand-ins themselves are already reported above.
        for key, stand_in in (("name", "unnamed"), ("metric", "loss"), ("action", "alert")):
            if key in unusable:
                kwargs[key] = stand_in
        complete = not unusable and not any(p.rule == label for p in self.problems)
        try:
            rule = Rule(**kwargs, line=line)
            return rule if complete else None
        except RulesError as e:
            for p in e.problems:
                if p.field in unusable:
                    continue
                note = f" (inherited from defaults.{p.field}; override it in this rule)" if p.field in inherited else ""
                self.problem(lines.get(p.field, line), label, p.field, p.message + note)
            return None


def parse_ruleset(text: str, source: str) -> RuleSet:
    reader = _Reader(text, source)
    try:
        root = reader.loader.get_single_node()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark else 1
        column = f" at column {mark.column + 1}" if mark else ""
        raise RulesError(
            [RuleProblem(source, line, None, None, f"not valid YAML: {e.problem}{column}; fix the syntax there")]
        ) from e
    except yaml.YAMLError as e:
        raise RulesError([RuleProblem(source, 1, None, None, f"not valid YAML: {e}")]) from e
    if root is None:
        raise RulesError(
            [RuleProblem(source, 1, None, None, "the file is empty; start with 'version: 1' and a 'rules:' list")]
        )
    ruleset = reader.top(root)
    reader.loader.dispose()
    if reader.problems or ruleset is None:
        raise RulesError(sorted(reader.problems, key=lambda p: p.line))
    return ruleset
