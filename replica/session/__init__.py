"""The bucket protocol both streams speak (the mirror's and weight sync's), and the
choice of backend under it.

``protocol`` (the messages: begin, buckets, replies, layouts, epochs), ``bucketstream``
(a sender's outgoing version and a receiver's loop over versions), ``listener`` (where a
receiver accepts its senders), ``backends`` (which ``replica.transport`` backend, by
capability).

Layer: above ``replica.state``, ``replica.jobstore`` (epochs) and ``replica.transport``.
"""

__all__: list[str] = []
