"""Integrations: instrument trainers parwatch does not own.

`parwatch.integrations.torch_pipelining` watches schedules of PyTorch's own
`torch.distributed.pipelining` (the stack torchtitan uses). Integrations depend on the
contract (span kinds, events, the hook registry) and on the framework they watch, never on
parwatch's bundled trainer.
"""
