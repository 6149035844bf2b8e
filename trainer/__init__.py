"""A reference tensor + pipeline parallel trainer on plain torch.distributed.

It imports nothing of parwatch but the instrumentation contract (`parwatch.contract`): everything it does
is announced there, for any observer. Watched, it is started by parwatch's launcher (`parwatch train`),
which attaches the collector; alone, `python -m parwatch.trainer`.
"""
