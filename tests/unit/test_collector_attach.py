"""attach_from_config: the bundled trainer's way to a Collector (parwatch/trainer/launch.py calls it)."""

from __future__ import annotations

import pytest

from parwatch.collector import attach_from_config
from parwatch.collector.attach import AttachError, read_token
from parwatch.trainer.config import TrainConfig


def test_builds_this_ranks_context_and_run_directory_files(hook_registry, tmp_path):
    cfg = TrainConfig(
        tp=2,
        pp=2,
        dp=1,
        schedule="interleaved",
        chunks=2,
        microbatches=4,
        layers=4,
        run_id="run-7",
        parwatch="on",
        parwatch_log=str(tmp_path / "run"),
    )
    collector = attach_from_config(cfg, rank=3, world_size=4, local_rank=1, backend="gloo")
    try:
        ctx = collector.ctx
        assert (ctx.run_id, ctx.rank, ctx.tp_rank, ctx.stage, ctx.dp_rank) == ("run-7", 3, 1, 1, 0)
        assert (ctx.chunks, ctx.tokens_per_step, ctx.local_gpu) == (2, cfg.tokens_per_step, None)  # gloo: no GPU
        assert hook_registry.observers == [collector]
        assert collector.shipper._paths == {
            "summary": str(tmp_path / "run" / "summaries.jsonl"),
            "spans": str(tmp_path / "run" / "spans.jsonl"),
        }
        assert collector.shipper.url is None
    finally:
        collector.close(timeout=5)


def test_token_file_is_read_and_a_bad_one_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("PARWATCH_TOKEN", raising=False)
    (tmp_path / "token").write_text("s3cret\n")
    assert read_token(str(tmp_path / "token")) == "s3cret"
    assert read_token("") is None
    monkeypatch.setenv("PARWATCH_TOKEN", "from-env")
    assert read_token("") == "from-env"
    with pytest.raises(AttachError, match="--parwatch-token-file"):
        read_token(str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(AttachError, match="empty"):
        read_token(str(tmp_path / "empty"))
