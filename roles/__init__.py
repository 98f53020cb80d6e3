"""replica.roles: the control plane (coordinator, trainer/standby/rollout roles, launcher).

Installed as ``replica.roles``; the top of the layer stack, nothing below imports it.
The roles arrive with the coordinator issue.
"""

__all__: list[str] = []
