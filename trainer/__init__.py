"""A reference tensor + pipeline parallel trainer on plain torch.distributed.

It knows nothing of parwatch: everything it does is announced through
`trainer.hooks`, which any observer may subscribe to.
"""
