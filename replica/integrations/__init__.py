"""What replica plugs into: ``vllm`` (weights into vLLM engines). The Ray layer is
``replica.ray``, above the roles."""

__all__: list[str] = []
