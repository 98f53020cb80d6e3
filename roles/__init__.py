"""replica.roles: the control plane. A coordinator (inside ``replica launch``)
hosts the job store and decides failovers; every role process runs the user's
script, which joins through ``replica.roles.init()``.

Installed as ``replica.roles``; it may import anything below it.
"""

from replica.roles.runtime import Job, init

__all__ = ["Job", "init"]
