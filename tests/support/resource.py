"""The base of the tests' resources that own processes or namespaces (``NetnsCluster``,
``EtcdCluster``): built on entering a ``with`` and always torn down."""

from __future__ import annotations

__all__ = ["TornDown"]


class TornDown:
    """A test resource built on ``__enter__`` (``_build``) and always torn down
    (``close``), also when building it failed half-way."""

    def _build(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()
