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


def literal_comparisons(path: Path, root: Path = ROOT.parent) -> list[str]:
    """`file:line: 'name'` for each comparison (==, !=, in, not in, match-case) against a vocabulary name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            strings = []
            for i, op in enumerate(node.ops):
                if isinstance(op, (ast.Eq, ast.NotEq)):
                    strings += _strings(sides[i]) + _strings(sides[i + 1])
                elif isinstance(op, (ast.In, ast.NotIn)):  # `"loss" in row` asks for a key: only the right side
                    strings += _strings(sides[i + 1])
        elif isinstance(node, ast.match_case):
            strings, node = _patterns(node.pattern), node.pattern  # (a case has no line number; its pattern has)
        else:
            continue
        found += [f"{path.relative_to(root)}:{node.lineno}: {s!r}" for s in strings if s in NAMES]
    return found


def test_no_comparison_against_a_vocabulary_string():
    # parwatch/trainer links to the checkout's trainer/, which rglob does not follow
    files = sorted({p for d in (ROOT, (ROOT / "trainer").resolve()) for p in d.rglob("*.py")} - {Path(vocab.__file__)})
    found = [hit for f in files for hit in literal_comparisons(f)]
    assert not found, f"{len(found)} comparisons against vocabulary strings (use the enum):\n" + "\n".join(found)


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
    hits = literal_comparisons(tmp_path / "m.py", root=tmp_path)
    assert [h.split(": ")[1] for h in hits] == ["'pause'", "'firing'", "'tp'", "'gpipe'", "'ok'"]


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
