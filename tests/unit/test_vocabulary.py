"""One vocabulary: no code outside parwatch/vocabulary.py compares against a vocabulary name's string,
and the schedule registry resolves every name users type or old summaries carry."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from parwatch import vocabulary as vocab

ROOT = Path(vocab.__file__).parent
NAMES = frozenset(
    m.value
    for obj in vars(vocab).values()
    if isinstance(obj, type) and issubclass(obj, vocab.StrEnum) and obj is not vocab.StrEnum
    for m in obj
)


def _strings(node: ast.expr) -> list[str]:
    """The string literals a comparison's side holds: itself, or the items of a literal tuple/list/set."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e)]
    return []


def _patterns(pattern: ast.pattern) -> list[str]:
    if isinstance(pattern, ast.MatchValue):
        return _strings(pattern.value)
    if isinstance(pattern, ast.MatchOr):
        return [s for p in pattern.patterns for s in _patterns(p)]
    if isinstance(pattern, ast.MatchAs) and pattern.pattern is not None:
        return _patterns(pattern.pattern)
    return []


def _pairs(targets: ast.expr, value: ast.expr) -> list[ast.expr]:
    """The values of an assignment, paired through `a, b = "x", "y"`."""
    if isinstance(targets, ast.Tuple) and isinstance(value, ast.Tuple) and len(targets.elts) == len(value.elts):
        return value.elts
    return [value]


def _given(value: ast.expr | None) -> list[str]:
    """The string a typed place is given: the literal itself, or either branch of `x if c else y`."""
    if isinstance(value, ast.IfExp):
        return _given(value.body) + _given(value.orelse)
    return [value.value] if isinstance(value, ast.Constant) and isinstance(value.value, str) else []


def literal_uses(path: Path, root: Path = ROOT.parent) -> list[str]:
    """`file:line: 'name'` for each vocabulary name written as a string where a member belongs: a comparison
    (==, !=, in, not in, match-case), a value assigned (`x = `, `x.f = `, a field's default), a keyword
    argument, a parameter's default, a returned value. Not counted: dict keys and subscripts (`row["step"]`
    names a key that happens to be spelt like a member), positional arguments (mypy checks them against a
    parameter typed with the enum) and the items of a tuple or list (label and column names)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        strings: list[str] = []
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for i, op in enumerate(node.ops):
                if isinstance(op, (ast.Eq, ast.NotEq)):
                    strings += _strings(sides[i]) + _strings(sides[i + 1])
                elif isinstance(op, (ast.In, ast.NotIn)):  # `"loss" in row` asks for a key: only the right side
                    strings += _strings(sides[i + 1])
        elif isinstance(node, ast.match_case):
            strings, node = _patterns(node.pattern), node.pattern  # (a case has no line number; its pattern has)
        elif isinstance(node, ast.Assign):
            strings = [s for t in node.targets for v in _pairs(t, node.value) for s in _given(v)]
        elif isinstance(node, (ast.AnnAssign, ast.Return)) or (isinstance(node, ast.keyword) and node.arg != "help"):
            strings = _given(node.value)
        elif isinstance(node, ast.arguments):
            strings = [s for d in (*node.defaults, *node.kw_defaults) for s in _given(d)]
            node = next(iter(node.args + node.kwonlyargs), node)  # (arguments have no line number; an arg has)
        found += [(node.lineno, f"{path.relative_to(root)}:{node.lineno}: {s!r}") for s in strings if s in NAMES]
    return [hit for _, hit in sorted(found, key=lambda f: f[0])]


ALLOWED = {
    # Words spelt like a member that mean something else (the file and the word; the reason).
    "parwatch/cli/sidecar.py: 'info'": "a logging level",
    "parwatch/guardrails/engine_store.py: 'ok'": "what SQLite's quick_check answers",
    "parwatch/report/plots.py: 'loss'": "a plot's legend",
    "parwatch/wire/steps.py: 'loss'": "a JSON key (field(name=...))",
    "trainer/tensor_parallel.py: 'max'": "torch's reduce op",
    "trainer/faults.py: 'hang'": "a fault the trainer injects",
    "trainer/optim.py: 'step'": "torch's optimizer state key",
    # msgspec decodes no Literal of enum members: a Literal of words, which mypy checks.
    "parwatch/collector/fallback.py: 'nonfinite-loss'": "LocalDecision.rule",
}
"""Places a vocabulary word is written on purpose; help text (help=) and docstrings are not looked at."""


def test_no_vocabulary_name_written_as_a_string():
    # parwatch/trainer links to the checkout's trainer/, which rglob does not follow
    files = sorted({p for d in (ROOT, (ROOT / "trainer").resolve()) for p in d.rglob("*.py")} - {Path(vocab.__file__)})
    found = [hit for f in files for hit in literal_uses(f) if _place(hit) not in ALLOWED]
    assert not found, f"{len(found)} vocabulary names written as strings (use the enum):\n" + "\n".join(found)


def _place(hit: str) -> str:
    """`file:line: 'name'` -> `file: 'name'` (an allowance holds wherever the file writes that name)."""
    path, _, name = hit.split(":", 2)
    return f"{path}:{name}"


def test_the_check_sees_comparisons_of_every_shape(tmp_path):
    code = (
        "a == 'pause'\n"
        "'firing' != b\n"
        "c in ('tp', 'x')\n"
        "d not in ['gpipe']\n"
        "match e:\n"
        "    case 'ok' | 'nope':\n"
        "        pass\n"
        "f == 'not a vocabulary name'\n"
        "'pause' in row\n"
        "g < 'pause'\n"
    )
    (tmp_path / "m.py").write_text(code)
    hits = literal_uses(tmp_path / "m.py", root=tmp_path)
    assert [h.split(": ")[1] for h in hits] == ["'pause'", "'firing'", "'tp'", "'gpipe'", "'ok'"]


def test_the_check_sees_names_given_to_typed_places(tmp_path):
    code = (
        "m.state = 'firing'\n"
        "state, reason = 'pending', 'why'\n"
        "class Rule:\n"
        "    action: str = 'alert'\n"
        "x = 'gone' if y else 'silent'\n"
        "f(source='operator')\n"
        "def g(op='all_reduce', *, group='tp'):\n"
        "    return 'send'\n"
        "# Not looked at: keys, positional arguments, the items of a tuple or list, help text.\n"
        "row['step'] = {'rank': 1}\n"
        "h('pause', labels=('tp', 'pp'), help='pause')\n"
        "LABELS = ['rank', 'stage']\n"
    )
    (tmp_path / "m.py").write_text(code)
    hits = literal_uses(tmp_path / "m.py", root=tmp_path)
    assert [h.split(": ")[1] for h in hits] == [
        "'firing'",
        "'pending'",
        "'alert'",
        "'gone'",
        "'silent'",
        "'operator'",
        "'all_reduce'",
        "'tp'",
        "'send'",
    ]


def test_members_equal_their_wire_strings():
    assert vocab.Action.PAUSE == "pause" and f"{vocab.Action.PAUSE}" == "pause"
    assert {vocab.RuleState.FIRING: 1}["firing"] == 1
    assert vocab.Action.from_code(vocab.Action.ROLLBACK.code) is vocab.Action.ROLLBACK


@pytest.mark.parametrize(
    "typed,name",
    [
        ("interleaved", "interleaved1f1b"),
        ("interleaved1f1b", "interleaved1f1b"),
        ("ScheduleInterleaved1F1B", "interleaved1f1b"),
        ("interleaved-1f1b", "interleaved1f1b"),
        ("Schedule1F1B", "1f1b"),
        ("ZBVZeroBubble", "zbv"),
        ("GPipe", "gpipe"),
    ],
)
def test_a_schedule_is_found_by_its_name_alias_or_torch_class(typed, name):
    entry = vocab.schedule(typed)
    assert entry is not None and entry.name == name
    assert vocab.canonical_schedule(typed) == name


def test_an_unknown_schedule_keeps_its_name():
    assert vocab.schedule("mine") is None and vocab.canonical_schedule("mine") == "mine"


def test_the_registry_is_consistent():
    for s in vocab.SCHEDULES.values():
        assert s.chunks is None or s.default_chunks in s.chunks
        assert not s.v_shape or s.chunks == (2,)
    assert vocab.REFERENCE_SCHEDULES == ("gpipe", "1f1b", "interleaved1f1b")


def test_the_old_name_interleaved_still_works_everywhere_and_summaries_carry_one_name():
    from parwatch.bubble import has_closed_form, theoretical
    from parwatch.collector.context import RunContext
    from parwatch.trainer.config import parse_args
    from parwatch.trainer.schedules import pipeline_order

    cfg = parse_args(["--schedule", "interleaved", "--pp", "2", "--chunks", "2"])  # what users typed before
    cfg.validate()
    assert pipeline_order(cfg.schedule, 2, 4, 2) == pipeline_order("interleaved1f1b", 2, 4, 2)
    ctx = RunContext.for_rank("r", 0, tp=1, pp=2, dp=1, schedule=cfg.schedule, microbatches=4, chunks=2)
    assert ctx.schedule == "interleaved1f1b"  # what its summaries say
    # A stored summary of the old name gets the same theory.
    assert has_closed_form("interleaved") and theoretical("interleaved", 2, 4, 2) == theoretical(
        "interleaved1f1b", 2, 4, 2
    )
    with pytest.raises(ValueError, match="needs an interleaved schedule"):
        RunContext.for_rank("r", 0, tp=1, pp=2, dp=1, schedule="ScheduleGPipe", microbatches=4, chunks=2)
