"""A `vllm serve` (vLLM's OpenAI-compatible server) as the rollout role's engine.

The user starts the server beside the rollout role, with the replica backend and worker
extension and vLLM's development routes (``SERVE_ARGS``; ``VLLM_SERVER_DEV_MODE=1``; the job's
token in its environment as ``REPLICA_TOKEN``: it never crosses HTTP), and the role's
``make_engine`` returns ``ServedLLM(url)``. ``ServedLLM`` is the part of ``vllm.LLM`` that
``EngineWeights`` uses, over the server's routes (the weight-transfer routes, ``/collective_rpc``
for the worker extension's queries, ``/reset_prefix_cache``), and generates a shard's
completions through ``/v1/completions`` (token ids in and out, one request per prompt with its
own seed, sent together: the server batches them). Weights reach the server's workers over
replica's transports, never over HTTP; only version numbers and completions cross it.
"""

from __future__ import annotations

import ast
import json
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from replica.errors import ReplicaError

__all__ = ["SERVE_ARGS", "ServedLLM"]

#: What ``vllm serve MODEL`` takes for a server the rollout role drives (with ``VLLM_SERVER_DEV_MODE=1``).
SERVE_ARGS = (
    "--worker-extension-cls",
    "replica.integrations.vllm.worker.ReplicaWorkerExtension",
    "--weight-transfer-config",
    json.dumps({"backend": "replica"}),
)


class ServedLLM:
    """A `vllm serve` at ``url`` (``http://HOST:PORT``), as ``EngineWeights`` and the rollout role
    drive an in-process ``vllm.LLM``. ``timeout``: every HTTP call's deadline (a generation's
    too); ``in_flight``: the completion requests sent at once."""

    def __init__(
        self, url: str, *, model: str | None = None, timeout: timedelta = timedelta(minutes=5), in_flight: int = 64
    ):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"a server's URL is http://HOST:PORT, got {url!r}")
        if in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {in_flight}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._local = threading.local()  # a session (its kept connections) per thread
        self._pool = ThreadPoolExecutor(in_flight, thread_name_prefix="replica-served")
        self.model = model if model is not None else self._get("v1/models")["data"][0]["id"]

    def __repr__(self) -> str:
        return f"ServedLLM({self.url!r}, model={self.model!r})"

    # --- what EngineWeights calls (vllm.LLM's names) ---

    def init_weight_transfer_engine(self, request: dict[str, Any]) -> None:
        if "token_hex" in request["init_info"]:
            raise ReplicaError(
                "the job's token never crosses HTTP: give the server REPLICA_TOKEN in its "
                "environment and leave it out of the ReceiverSpec"
            )
        self._post("init_weight_transfer_engine", request)

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._post("start_weight_update")

    def update_weights(self, request: dict[str, Any]) -> None:
        self._post("update_weights", request)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("finish_weight_update", None if weight_version is None else {"weight_version": weight_version})

    def reset_prefix_cache(self) -> None:
        self._post("reset_prefix_cache")

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """The workers' answers to ``method(*args)``: the route takes strings and answers with
        ``str()`` of what is not a list or dict, read back here as a Python literal (no code runs)."""
        answer = self._post(
            "collective_rpc",
            {"method": method, "args": [str(a) for a in args], "timeout": self.timeout.total_seconds()},
        )
        return [_literal(r) for r in answer["results"]]

    # --- generation ---

    def complete(
        self, prompts: Sequence[Sequence[int]], *, temperature: float, max_tokens: int, seeds: Sequence[int]
    ) -> list[list[int]]:
        """Each prompt's completion (token ids), each prompt a request with its own seed."""

        def one(prompt: Sequence[int], seed: int) -> list[int]:
            answer = self._post(
                "v1/completions",
                {
                    "model": self.model,
                    "prompt": list(prompt),
                    "max_tokens": max_tokens,
                    "temperature": temperature,
                    "seed": seed,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            (choice,) = answer["choices"]
            return list(choice["token_ids"])

        return list(self._pool.map(one, prompts, seeds))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --- HTTP ---

    def _session(self):
        if (session := getattr(self._local, "session", None)) is None:
            import requests

            session = self._local.session = requests.Session()
        return session

    def _get(self, path: str) -> Any:
        response = self._session().get(f"{self.url}/{path}", timeout=self.timeout.total_seconds())
        return self._answer(response, path)

    def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self._session().post(f"{self.url}/{path}", json=body, timeout=self.timeout.total_seconds())
        return self._answer(response, path)

    def _answer(self, response, path: str) -> Any:
        if response.status_code == 404 and path not in ("v1/models", "v1/completions"):
            raise ReplicaError(
                f"{self.url} has no /{path}: start `vllm serve` with VLLM_SERVER_DEV_MODE=1 and "
                f"{' '.join(SERVE_ARGS[:2])} --weight-transfer-config '{SERVE_ARGS[3]}'"
            )
        if response.status_code != 200:
            raise ReplicaError(f"{self.url}/{path} answered {response.status_code}: {response.text[:500]}")
        return response.json() if response.content else None


def _literal(result: Any) -> Any:
    if not isinstance(result, str):
        return result
    try:
        return ast.literal_eval(result)
    except (ValueError, SyntaxError):
        return result  # a string the worker returned
