"""Weight sync (``replica.weights``): after a global commit, the trainers push the full parameters
into every rollout engine, in place, over ``replica.transport``.

Sender (``WeightSync``, every trainer rank): the parameters are gathered bucket
by bucket (FSDP2 ``full_tensor()``, a collective every rank joins; never the
whole model at once), and the leader rank packs each bucket with ``ops.pack``
into its retained copy of the packed weights (host memory) and sends it to
every engine while the next bucket is gathered. CUDA weights are packed on
their device and copied straight into the (then pinned) retained copy, one
event per bucket, so bucket k+1 is gathered, packed and copied while bucket k
is sent.
The retained copy lets the leader resend a bucket that failed its digest and
bring an engine that joins late up to date without waiting for the trainers.

Receiver (``WeightReceiver``, in the engine's process): receives a version into
a staging buffer, verifies every bucket, and only when all are good makes it
the *ready* version; ``apply(load)`` hands the engine an iterator over views of
the ready version's tensors (``reload_weights`` in vLLM) between generations.
A sync cut short (the sender dies, the link breaks) never reaches the engine:
it stays on its previous complete version, never a mix of two.

The bucket stream is the mirror's (``replica.session.bucketstream``): per connection the
sender sends its epoch and the weight layout; per sync ``BEGIN`` (step, buckets,
epoch), the buckets under ``BUCKET_BASE + i``, and the receiver answers
``REPLY``: ACKED, RESEND naming bad buckets, or FENCED. A receiver accepts only
the current epoch of the trainers' ``leader`` rank (any, without a coordinator):
a leader declared dead while still running (a zombie) cannot push weights. An
engine that could not be reached is tried again on later pushes, with backoff.
Keys in the store:
``{prefix}/engine/{i}`` (the receiver's registration) and
``{prefix}/engine/{i}/version`` (the version it serves).

Modules: ``layout`` (what is pushed, in which buckets), ``sender`` (``WeightSync``),
``receiver`` (``WeightReceiver``), ``pagebuffer`` (the receiver's page-returning buffer).
Layer: above ``replica.session``, ``replica.state`` and ``replica.jobstore``.
"""

from replica.weights.layout import ModelSource, ParamInfo, WeightBucket, WeightSource, tensor_buckets, weight_layout
from replica.weights.receiver import ReceiverStats, WeightReceiver
from replica.weights.sender import SyncStats, WeightSync

__all__ = [
    "ModelSource",
    "ParamInfo",
    "ReceiverStats",
    "SyncStats",
    "WeightBucket",
    "WeightReceiver",
    "WeightSource",
    "WeightSync",
    "tensor_buckets",
    "weight_layout",
]
