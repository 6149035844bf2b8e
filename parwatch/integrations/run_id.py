"""One run id on every rank: made on rank 0, broadcast to the others.

Directives, summaries and checkpoints name the run by its id, so every rank must hold the same
string; a fresh id per launch keeps a relaunch from mixing with the last run's records."""

from __future__ import annotations

from parwatch.contract import new_run_id


def shared_run_id(group=None) -> str:
    """A new run id made on the group's first rank and broadcast to all of its ranks (default
    group: the world). A collective: every rank of the group calls it, after init_process_group."""
    import torch.distributed as dist

    src = 0 if group is None else dist.get_global_rank(group, 0)
    box: list[str | None] = [new_run_id() if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return str(box[0])
