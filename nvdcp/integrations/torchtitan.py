"""torchtitan checkpoints through nvdcp: a ``CheckpointManager`` whose saves compress.

torchtitan (0.3.0) saves with ``dcp.save`` / ``dcp.async_save(checkpoint_id=...)`` and no
writer hook, so torch picks its stock writer by path. :class:`NvdcpCheckpointManager` is
torchtitan's ``CheckpointManager`` with only its two storage calls replaced: ``dcp_save`` writes
through :class:`~nvdcp.NvcompWriter`, ``dcp_load`` reads through :class:`~nvdcp.NvcompReader`.
Everything else is torchtitan's own: when to save, ``step-N`` folders, purging, last-step
exports, the three ``async_mode`` values, and the Hugging Face safetensors paths
(``last_save_in_hf``, ``initial_load_in_hf``), which are handed to torchtitan unchanged.

Switching a run (docs/INTEGRATIONS.md), with torchtitan's own extension mechanisms:

* one flag (or ``override=OverrideConfig(imports=[...])`` in a config function)::

      --override.imports nvdcp.integrations.torchtitan.nvdcp_checkpoint
      --override.imports 'nvdcp.integrations.torchtitan.nvdcp_checkpoint={"codec": "zstd"}'

* or ``checkpoint=NvdcpCheckpointManager.Config(...)`` in a ``config_registry`` function, which
  also makes the nvdcp fields ``--checkpoint.codec`` etc. command-line flags.

Modes: ``disabled`` saves with ``dcp.save``; ``async`` stages through an
:class:`~nvdcp.NvcompStager` and writes in a thread; ``async_with_pinned_mem`` stages through an
``NvcompStager(async_staging=True)`` (GPU compression into reused pinned buffers) and writes in
torch's checkpoint process, as torchtitan does with ``DefaultStager``.

Loading: through ``NvcompReader``, which reads nvdcp and stock DCP checkpoints alike (written by
torchtitan's own manager, seed checkpoints, an ``initial_load_path``). torchtitan's own manager
cannot load an nvdcp checkpoint (torch's reader: ``ValueError: Unknown extension
name='nvdcp.zstd'``); ``nvdcp convert SRC DST --to stock`` makes a stock copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

try:
    import torchtitan  # noqa: F401
    from torchtitan.components.checkpointer import MODEL, AsyncMode, CheckpointManager
    from torchtitan.config.override import derive, override
    from torchtitan.tools.utils import GarbageCollection
except ImportError as exc:  # pragma: no cover - exercised only without torchtitan
    raise ImportError(
        f"nvdcp.integrations.torchtitan needs torchtitan ({exc}); install it with: "
        "pip install 'nvdcp[torchtitan]'"
    ) from exc

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from nvdcp.dcp.reader import NvcompReader
from nvdcp.dcp.stager import GiB, NvcompStager
from nvdcp.dcp.writer import NvcompWriter
from nvdcp.format.header import DEFAULT_CHUNK_BYTES
from nvdcp.pipeline.config import EncodeConfig

logger = logging.getLogger(__name__)


class NvdcpCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager``, saving and loading through nvdcp.

    Built by torchtitan's trainer from its config (``config.checkpoint.build(...)``) with the
    same arguments as the stock manager; see the module docstring for how to select it.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        codec: str = "auto"
        """nvdcp codec: auto (per dtype, loads without a GPU), zstd, gdeflate, none; ans and bitcomp need a GPU."""

        thread_count: int | None = None
        """Data files written in parallel per rank; None: chosen from the state's size and the cores
        (local storage), 1 on S3 and fsspec."""

        chunk_bytes: int = DEFAULT_CHUNK_BYTES
        """Uncompressed bytes per independently compressed chunk (1 KiB..64 KiB)."""

        codec_threads: int | None = None
        """CPU threads compressing and decompressing; None: every core."""

        sync_files: bool = True
        """fsync data files, .metadata and the directory before a save counts as done."""

        load_thread_count: int | None = None
        """Threads reading a checkpoint per rank; None: up to 8."""

        staging_buffer_bytes: int = GiB
        """Host memory the async stager keeps across saves (pinned when CUDA is present)."""

        staging_cpu_mode: Literal["copy", "compress"] = "copy"
        """Async staging of tensors not on a GPU: copy now and compress in the background, or compress now."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            EncodeConfig(self.codec, self.chunk_bytes, self.codec_threads)  # raises on a bad choice
            if self.thread_count is not None and self.thread_count < 1:
                raise ValueError(f"checkpoint.thread_count must be >= 1, got {self.thread_count}")
            if self.load_thread_count is not None and self.load_thread_count < 1:
                raise ValueError(f"checkpoint.load_thread_count must be >= 1, got {self.load_thread_count}")
            if self.staging_buffer_bytes < 0:
                raise ValueError(f"checkpoint.staging_buffer_bytes must be >= 0, got {self.staging_buffer_bytes}")

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self.nvdcp_config = config
        if self.async_mode in (AsyncMode.ASYNC, AsyncMode.ASYNC_WITH_PINNED_MEM):
            # torchtitan builds a DefaultStager only while self.stager is None, and closes
            # self.stager in close(). async_staging: torch then answers AsyncSaveResponse, which
            # the pinned mode asserts, and torchtitan waits for staging_completion before the next
            # step while compression overlaps it (docs/TRAINING.md).
            self.stager = NvcompStager(
                codec=config.codec, chunk_bytes=config.chunk_bytes, codec_threads=config.codec_threads,
                cpu_mode=config.staging_cpu_mode, buffer_bytes=config.staging_buffer_bytes,
                async_staging=self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM,
            )
        logger.info("nvdcp: torchtitan checkpoints in %s use codec %s (%s)", self.folder, config.codec,
                    self.async_mode.value)

    # -- the two storage calls torchtitan makes --------------------------------------------------
    def writer(self, checkpoint_id: str) -> NvcompWriter:
        c = self.nvdcp_config
        return NvcompWriter(checkpoint_id, codec=c.codec, thread_count=c.thread_count, sync_files=c.sync_files,
                            chunk_bytes=c.chunk_bytes, codec_threads=c.codec_threads)

    def reader(self, checkpoint_id: str) -> NvcompReader:
        c = self.nvdcp_config
        return NvcompReader(checkpoint_id, thread_count=c.load_thread_count, codec_threads=c.codec_threads)

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        if to_hf:  # Hugging Face safetensors export: torchtitan's own writer and consolidation
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        writer = self.writer(checkpoint_id)
        ret: Any
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg,
                                 async_stager=self.stager)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            ret = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg,
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)
        else:
            ret = dcp.save(state_dict, storage_writer=writer)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        if from_hf:  # Hugging Face safetensors: torchtitan's adapter and reader
            super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            return
        # NvcompReader reads nvdcp and stock DCP checkpoints alike (torchtitan's own, seed
        # checkpoints, an initial_load_path written elsewhere).
        dcp.load(state_dict, storage_reader=self.reader(checkpoint_id))
        # As torchtitan: model states are flattened into state_dict, so load them explicitly.
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)


@override(
    target=CheckpointManager.Config,
    exact=True,  # a subclass (e.g. a fault-tolerance manager) keeps its own behaviour
    description="nvdcp: compressed DCP checkpoints (nvdcp.integrations.torchtitan)",
)
def nvdcp_checkpoint(cfg: CheckpointManager.Config, **fields: Any) -> NvdcpCheckpointManager.Config:
    """torchtitan override: the checkpoint config becomes :class:`NvdcpCheckpointManager.Config`,
    keeping every field it had; ``fields`` (the JSON after ``=`` in ``--override.imports``) set
    the nvdcp ones, e.g. ``{"codec": "zstd", "thread_count": 4}``."""
    return derive(cfg, NvdcpCheckpointManager.Config, **fields)


__all__ = ["NvdcpCheckpointManager", "nvdcp_checkpoint"]
