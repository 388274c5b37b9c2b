"""A KV connector for vLLM's ``extract_hidden_states`` method that writes synchronously (runs on CPU).

Runs inside the vLLM engine (its own venv), loaded with ``kv_transfer_config={"kv_connector":
"CpuHiddenStatesConnector", "kv_connector_module_path": "eagle_lib.hidden_states.vllm_connector", ...}``.

vLLM's ``ExampleHiddenStatesConnector`` copies the cached hidden states with a CUDA stream into pinned host
memory and writes from a thread pool, so on a CPU-only machine the first write fails ("pin_memory=True
requires a CUDA or other accelerator backend"). This subclass keeps its scheduler side (file names,
delayed block freeing, the per-file ``.lock`` pre-created in ``wait_for_save``) and replaces the worker-side
copy + write with a synchronous one: gather the request's slots from the hidden-state cache (shape
[num_blocks, n_layers, block_size, H]), write ``{hidden_states [T, n_layers, H], token_ids [T]}`` to a
``.part`` file, rename it and release the lock. A reader (``vllm_producer``) takes the shared lock, so it
never sees a partial file. Only this module imports vLLM; nothing of the main venv is needed.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)

MODULE = __name__
CLASS = "CpuHiddenStatesConnector"


def slot_mapping(block_ids: list[int], block_size: int) -> torch.Tensor:
    """Cache slots of a request's blocks, in token order: block b holds slots b*bs .. b*bs+bs-1."""
    blocks = torch.tensor(block_ids, dtype=torch.long)
    return (blocks[:, None] * block_size + torch.arange(block_size, dtype=torch.long)[None]).flatten()


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector with a synchronous, device-agnostic worker-side write."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._written: set[str] = set()  # req ids whose file is complete, not yet reported as sent

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None, "register_kv_caches was not called"
        n = pending.token_ids.shape[0]
        slots = slot_mapping(pending.block_ids, self._block_size).to(self._kv_cache.device)
        hs = extract_from_kv_cache(self._kv_cache, slots, n).to("cpu").contiguous()  # [T, n_layers, H]
        if hs.shape[0] != n:
            raise RuntimeError(f"{pending.req_id}: {hs.shape[0]} cached positions for {n} prompt tokens")
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        part = pending.filename + ".part"
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": hs, "token_ids": pending.token_ids.clone()}, part)
            os.replace(part, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers waiting on LOCK_SH proceed
        self._written.add(pending.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, ExampleHiddenStatesConnectorMetadata):
                for pending in meta.pending_saves:
                    self._submit_async_write(pending)
        self._accumulated_finished_req_ids.update(finished_req_ids)
        # A finished request is reported once its file is complete (its blocks are freed then); one that is
        # finished but not yet written waits here for the step that carries its pending save.
        done = self._accumulated_finished_req_ids & self._written
        self._accumulated_finished_req_ids -= done
        self._written -= done
        return done or None, None
