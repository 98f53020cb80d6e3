"""vLLM: ``plugin`` (the ``vllm.general_plugins`` entry point), ``transfer`` (the
``replica`` backend of vLLM's weight-transfer API), ``worker`` (the worker extension that
holds a ``WeightReceiver``), ``staging`` (the engine's weights prepared for a reload),
``served`` (a `vllm serve` driven as the rollout role's engine).

Imported only where vLLM is: nothing here is loaded by ``import replica``.
"""

__all__: list[str] = []
