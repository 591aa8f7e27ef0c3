"""The trainer's reader: receipts out of the sharded streams, each rollout held by one reader until acknowledged.

One module per role: :mod:`~sink.trainer.reader.rollout_reader` (:class:`RolloutReader`, the async reader) and
:mod:`~sink.trainer.reader.sync_reader` (its blocking twin for DataLoader workers);
:mod:`~sink.trainer.reader.backlog` (new receipts per shard, reads cut short re-read),
:mod:`~sink.trainer.reader.held` (what one reader holds), :mod:`~sink.trainer.reader.claims` (leases taken over
from readers that stopped), :mod:`~sink.trainer.reader.guards` (acknowledgement outcomes, foreign rows) and
:mod:`~sink.trainer.reader.retention` (how long consumed rollouts stay). The public names are exported by
:mod:`sink.trainer`; nothing is re-exported here.
"""

__all__ = ()
