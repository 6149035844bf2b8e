"""Integrations: instrument trainers parwatch does not own.

`parwatch.integrations.torch_pipelining` watches schedules of PyTorch's own
`torch.distributed.pipelining` (the stack torchtitan uses). Integrations depend on the
contract (span kinds, events, the hook registry) and on the framework they watch, never on
parwatch's bundled trainer.

`shared_run_id()` gives every rank the same new run id (made on rank 0), for any integration.
"""

from parwatch.integrations.run_id import new_run_id, shared_run_id

__all__ = ["new_run_id", "shared_run_id"]
