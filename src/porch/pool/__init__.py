"""The key pool: N shard actors over one store, one bounded mailbox each.

A key always reaches the same shard, so everything about one key is serialized
through one actor without locks; a shard applies what is queued in one store
transaction (group commit) and answers its callers only once it is committed.
"""

from ._mailbox import Mailbox, MailboxStatistics
from ._pool import KeyPool, PoolStatistics

__all__ = ["KeyPool", "Mailbox", "MailboxStatistics", "PoolStatistics"]
