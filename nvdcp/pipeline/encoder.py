"""``ItemEncoder``: the one entry point that turns write items into container records.

Every caller that encodes (the writer, the async stager, ``nvdcp convert``, the codec benchmark)
goes through this class, so the rules live in one place:

- the layout: transform and per-plane codecs for the dtype (:func:`~nvdcp.pipeline.policy.choose_layout`,
  with ``"auto"`` resolving to the GPU or the CPU codec depending on where the item is encoded);
- where an item is encoded: on its GPU when it lives there (or when the codec only runs on a GPU),
  on the CPU thread pool otherwise;
- empty tensors under a GPU-only codec: stored raw (nothing to compress, nothing needs a GPU);
- flattening: only the view's elements, row-major, one copy at most (:func:`~nvdcp.pipeline.tensors.flat_bytes`).

It owns what encoding keeps between saves: the CPU codec threads, one GPU encoder per device and
concurrent user (nvCOMP codecs and CUDA streams are reused, not rebuilt per save), and the pinned
host pool those encoders copy through. :meth:`ItemEncoder.close` frees all of it. Writers created
per save share :func:`shared_encoder` for their settings; :func:`nvdcp.release_resources` closes those.
"""

from __future__ import annotations

import contextlib
import functools
import io
import threading
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, overload

import numpy as np
import torch

from nvdcp.errors import CodecUnavailableError
from nvdcp.format.dtypes import dtype_code
from nvdcp.format.header import KIND_BYTES, KIND_TENSOR
from nvdcp.gpu import gpu_available
from nvdcp.gpu.config import GpuConfig
from nvdcp.pipeline.config import EncodeConfig
from nvdcp.pipeline.cpu import EncodedItem, StreamedRecord, encode_item, stream_item
from nvdcp.pipeline.cpu_batch import encode_delta_batch, encode_tensor_batch, encode_tensor_batches
from nvdcp.pipeline.delta import DeltaInput, DeltaTensor
from nvdcp.pipeline.policy import GPU_AUTO_CODEC, choose_delta_layout, choose_layout
from nvdcp.pipeline.record_batch import RecordBatch
from nvdcp.pipeline.tensors import plain, tensor_to_host_bytes
from nvdcp.transform import delta as delta_transform

if TYPE_CHECKING:
    from nvdcp.gpu.encoder import EncodedBucket, GpuEncoder, GpuJob, HostSink
    from nvdcp.gpu.pinned import PinnedPool

#: What one item to encode is: a tensor (with its delta base: :class:`DeltaTensor`), or the
#: bytes of a BYTE_IO item.
ItemData = torch.Tensor | DeltaTensor | io.BytesIO | bytes | bytearray | memoryview | np.ndarray


class ItemEncoder:
    """Encodes tensors and byte blobs into container records, on the GPU or the CPU.

    Args:
        config: codec, chunk size and CPU codec threads.
        gpu: bounds of the GPU path (scratch GPU memory, pinned host memory, GDeflate type).

    Thread-safe: several threads (a writer's data files, a converter's workers) may encode at
    once; each GPU encode checks out its own :class:`~nvdcp.gpu.encoder.GpuEncoder`.
    """

    def __init__(self, config: EncodeConfig | None = None, gpu: GpuConfig | None = None) -> None:
        self.config = config or EncodeConfig()
        self.gpu = gpu or GpuConfig()
        self._init_runtime()

    def _init_runtime(self) -> None:
        # Nothing here touches CUDA: an encoder may be built (and pickled) before any GPU work.
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        # Small items' batches run on the codec pool, at most SMALL_ITEM_THREADS at once (a
        # pool of their own would add a thread, and its stack and malloc arena, to every process).
        self._small_gate = threading.BoundedSemaphore(SMALL_ITEM_THREADS)
        self._pinned: PinnedPool | None = None
        self._idle: dict[tuple[torch.device, int], list[GpuEncoder]] = {}
        self._ahead_pool: ThreadPoolExecutor | None = None

    # -- pickling (async_save PROCESS mode): settings travel, threads and CUDA state do not ------
    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config, "gpu": self.gpu}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    # -- resources -----------------------------------------------------------------------------
    def codec_pool(self) -> ThreadPoolExecutor:
        """The CPU codec threads (created on first use)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.config.threads, thread_name_prefix="nvdcp-codec")
            return self._pool

    @property
    def pinned(self) -> PinnedPool:
        """The pinned host pool of this encoder's GPU encoders (bounded by ``gpu.pinned_bytes()``)."""
        from nvdcp.gpu.pinned import PinnedPool

        with self._lock:
            if self._pinned is None:
                self._pinned = PinnedPool(self.gpu.pinned_bytes())
            return self._pinned

    def ahead_pool(self) -> ThreadPoolExecutor:
        """The threads that compress a large item while its caller writes the record before it
        (:class:`_OneAhead`; created on first use, a thread per caller at most)."""
        with self._lock:
            if self._ahead_pool is None:
                self._ahead_pool = ThreadPoolExecutor(AHEAD_THREADS, thread_name_prefix="nvdcp-encode-ahead")
            return self._ahead_pool

    def close(self) -> None:
        """Stop the codec threads and free the GPU encoders and pinned buffers (reusable after)."""
        with self._lock:
            pool, self._pool = self._pool, None
            ahead, self._ahead_pool = self._ahead_pool, None
            pinned, self._pinned = self._pinned, None
            self._idle.clear()
        if ahead is not None:
            ahead.shutdown(wait=True)  # first: its tasks wait on the codec pool
        if pool is not None:
            pool.shutdown(wait=True)
        if pinned is not None:
            pinned.close()

    # -- routing -------------------------------------------------------------------------------
    def uses_gpu(self, data: torch.Tensor, gpu_ok: bool | None = None) -> bool:
        """Whether ``data`` is encoded on a GPU: it lives on one, or only a GPU runs the codec.

        ``gpu_ok`` is :func:`~nvdcp.gpu.gpu_available` when the caller already asked (once per save).
        """
        if not (gpu_available() if gpu_ok is None else gpu_ok):
            return False
        return data.is_cuda or (self.config.gpu_only and data.numel() > 0)

    # -- the CPU path --------------------------------------------------------------------------
    def encode_bytes(
        self, data: io.BytesIO | bytes | bytearray | memoryview | np.ndarray, pool: Executor | None | bool = True,
    ) -> EncodedItem:
        """Encode a BYTE_IO item (always with a CPU-decodable codec). ``pool``: where its chunk
        groups go (True: the codec threads; None: this thread)."""
        if isinstance(data, np.ndarray):
            raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)  # any dtype: its bytes
        else:
            raw = np.frombuffer(data.getbuffer() if isinstance(data, io.BytesIO) else data, dtype=np.uint8)
        return encode_item(
            raw, kind=KIND_BYTES, dtype_code=0, shape=(), element_size=1,
            layout=choose_layout(None, self.config.codec), pool=self._pool_arg(pool),
            chunk_bytes=self.config.chunk_bytes,
        )

    def _pool_arg(self, pool: Executor | None | bool) -> Executor | None:
        if pool is True:
            return self.codec_pool()
        return pool or None

    def encode_tensor(self, tensor: torch.Tensor, where: str, pool: Executor | None | bool = True,
                      delta: DeltaInput | None = None) -> EncodedItem:
        """Encode a tensor on the CPU (its bytes are copied to the host if it lives on a GPU).
        ``pool``: as :meth:`encode_bytes`. ``delta``: its base (stored as the XOR with it when
        that pays, else whole) and where to keep its bytes for the next save.

        Raises:
            ValueError: the dtype has no code in the format (``where`` names the item).
            CodecUnavailableError: the codec compresses only on a GPU and the tensor is not empty.
        """
        code = _dtype_code(tensor.dtype, where)
        codec = self.config.codec
        if self.config.gpu_only:
            if tensor.numel():
                raise CodecUnavailableError(
                    f"{where}: codec {codec!r} compresses only on an NVIDIA GPU with "
                    "nvidia-libnvcomp-cu12 installed; none is usable here"
                )
            codec = "none"  # nothing to compress, nothing needs a GPU
        raw = tensor_to_host_bytes(tensor)
        encode = functools.partial(
            encode_item, raw, kind=KIND_TENSOR, dtype_code=code, shape=tuple(tensor.shape),
            element_size=tensor.element_size(), pool=self._pool_arg(pool), chunk_bytes=self.config.chunk_bytes,
        )
        layout = choose_delta_layout(tensor.dtype, codec) if delta is not None and delta.base is not None else None
        kept = None  # where the difference's pass kept the bytes
        if layout is None:
            encoded = encode(layout=choose_layout(tensor.dtype, codec))
        else:
            assert delta is not None and delta.base is not None
            kept = delta.host_keep()
            encoded = encode(layout=layout, base=delta.host_base(), base_digest=delta.base_digest,
                             delta_kind=delta_transform.kind_for(tensor.dtype), keep=kept)
            if delta.wants_whole(encoded.nbytes):
                encoded = delta.choose(encoded, encode(layout=choose_layout(tensor.dtype, codec)))
        if delta is not None and delta.keep is not None and kept is None:
            delta.store_kept(raw)  # after the difference read the base there
        return encoded

    def _streams(self, data: ItemData) -> TypeGuard[torch.Tensor]:
        """Whether ``data`` may come as a :class:`~nvdcp.pipeline.cpu.StreamedRecord`: a plain
        host tensor stored whole (a delta's record is chosen after its difference is coded)."""
        return isinstance(data, torch.Tensor) and data.device.type == "cpu" and not self.config.gpu_only

    def stream_tensor(self, tensor: torch.Tensor, where: str, pool: Executor | None) -> StreamedRecord:
        """:meth:`encode_tensor` of a host tensor stored whole, as a record whose chunks come
        group by group (its groups queued on ``pool`` now)."""
        return stream_item(
            tensor_to_host_bytes(tensor), kind=KIND_TENSOR, dtype_code=_dtype_code(tensor.dtype, where),
            shape=tuple(tensor.shape), element_size=tensor.element_size(),
            layout=choose_layout(tensor.dtype, self.config.codec), pool=pool, chunk_bytes=self.config.chunk_bytes,
        )

    # -- the GPU path --------------------------------------------------------------------------
    def gpu_job(self, key: Any, tensor: torch.Tensor | DeltaTensor, where: str) -> GpuJob:
        """Describe ``tensor`` for a GPU encode (moved to the current GPU if it is on the host);
        a :class:`DeltaTensor` is XORed with its base on the GPU (and its bytes kept)."""
        from nvdcp.gpu.encoder import GpuJob

        delta = tensor.delta if isinstance(tensor, DeltaTensor) else None
        t = plain(tensor.tensor if isinstance(tensor, DeltaTensor) else tensor)
        if not t.is_cuda:
            t = t.to(torch.device("cuda", torch.cuda.current_device()))
        # the tensor itself, read by address (a flat byte view is made only where torch copies it)
        data = t if t.is_contiguous() else t.contiguous()
        layout = choose_layout(t.dtype, self.config.codec, auto_codec=GPU_AUTO_CODEC)
        job = GpuJob(key, data, layout, t.dtype, _dtype_code(t.dtype, where), tuple(t.shape), KIND_TENSOR)
        if delta is not None:
            job.keep = delta.keep
            delta_layout = (choose_delta_layout(t.dtype, self.config.codec, GPU_AUTO_CODEC, delta.plane_codecs)
                            if delta.base is not None else None)
            if delta_layout is not None:
                job.layout, job.delta = delta_layout, delta
        return job

    def whole_layout(self, dtype: torch.dtype) -> Any:
        """The layout of a GPU tensor of ``dtype`` stored whole."""
        return choose_layout(dtype, self.config.codec, auto_codec=GPU_AUTO_CODEC)

    def encode_gpu_jobs(self, jobs: list[GpuJob], shares: int = 1) -> Iterator[tuple[GpuJob, EncodedItem]]:
        """Encode ``jobs`` on their devices; yields ``(job, record)`` in order of completion.

        ``shares``: how many encodes may run at once (a writer's data files): each gets that
        share of the GPU scratch and pinned budgets. The yielded chunks view pinned memory that
        is reused once the next record is asked for: write or copy them before that.
        """
        from nvdcp.gpu.encoder import by_device, ready_event

        for device, device_jobs in by_device(jobs).items():
            with self._gpu_encoder(device, shares) as encoder:
                yield from encoder.encode(device_jobs, ready_event(device))

    def encode_gpu_buckets(self, jobs: list[GpuJob], depth: int = 2,
                           batches: bool = False) -> Generator[EncodedBucket, None, None]:
        """Encode ``jobs`` with one GPU encoder per device at the full GPU and pinned budgets;
        yields each bucket's records (:meth:`GpuEncoder.encode_buckets
        <nvdcp.gpu.encoder.GpuEncoder.encode_buckets>`; ``batches``: whole records of jobs
        without a base as a :class:`~nvdcp.pipeline.record_batch.RecordBatch`): up to ``depth``
        buckets are held in pinned memory at once, each until its
        :meth:`~nvdcp.gpu.encoder.EncodedBucket.release`. Close the iterator only once every
        yielded record is written."""
        from nvdcp.gpu.encoder import by_device, ready_event

        for device, device_jobs in by_device(jobs).items():
            with self._gpu_encoder(device, 1) as encoder:
                buckets = encoder.encode_buckets(device_jobs, ready_event(device), depth, batches)
                try:
                    yield from buckets
                finally:
                    buckets.close()

    def stage_gpu_jobs(self, jobs: list[GpuJob], sink: HostSink) -> Callable[[], Iterator[tuple[GpuJob, EncodedItem]]]:
        """Compress ``jobs`` into ``sink``'s host memory; returns once every copy is done (the
        tensors are no longer read). The returned function yields the records (checksums and
        headers: host work only, for a background thread)."""
        from nvdcp.gpu.encoder import by_device, ready_event

        staged = []
        for device, device_jobs in by_device(jobs).items():
            with self._gpu_encoder(device, 1) as encoder:
                staged.append((encoder, device_jobs, encoder.stage(device_jobs, sink, ready_event(device))))

        def records() -> Iterator[tuple[GpuJob, EncodedItem]]:
            for encoder, device_jobs, buckets in staged:
                yield from encoder.items(device_jobs, buckets)

        return records

    @contextlib.contextmanager
    def _gpu_encoder(self, device: torch.device, shares: int) -> Iterator[GpuEncoder]:
        """Check out an idle encoder for ``device`` (made on first need), back when done."""
        from nvdcp.gpu.bound import SaveBound
        from nvdcp.gpu.encoder import GpuEncoder

        key = (device, shares)
        with self._lock:
            idle = self._idle.setdefault(key, [])
            encoder = idle.pop() if idle else None
        if encoder is None:
            bound = self.gpu.gpu_memory_bytes
            encoder = GpuEncoder(
                device, chunk_bytes=self.config.chunk_bytes, budget_bytes=self.gpu.gpu_budget(device) // shares,
                gdeflate_type=self.gpu.gdeflate_algorithm_type,
                pinned_bytes=self.gpu.pinned_bytes() // shares, pinned=self.pinned,
                bound=None if bound is None else SaveBound(bound, shares, self.config.codec == "auto"),
            )
        try:
            yield encoder
        finally:
            with self._lock:
                self._idle.setdefault(key, []).append(encoder)

    # -- whole sets of items -------------------------------------------------------------------
    @overload
    def encode_items(
        self, items: Iterable[tuple[Any, ItemData]], describe: Callable[[Any], str], shares: int = 1,
        batches: Literal[False] = False, streams: Literal[False] = False,
    ) -> Iterator[tuple[Any, EncodedItem]]: ...

    @overload
    def encode_items(
        self, items: Iterable[tuple[Any, ItemData]], describe: Callable[[Any], str], shares: int = 1, *,
        batches: Literal[True], streams: Literal[False] = False,
    ) -> Iterator[tuple[Any, EncodedItem] | RecordBatch]: ...

    @overload
    def encode_items(
        self, items: Iterable[tuple[Any, ItemData]], describe: Callable[[Any], str], shares: int = 1, *,
        batches: Literal[True], streams: bool,
    ) -> Iterator[tuple[Any, EncodedItem | StreamedRecord] | RecordBatch]: ...

    def encode_items(
        self, items: Iterable[tuple[Any, ItemData]], describe: Callable[[Any], str], shares: int = 1,
        batches: bool = False, streams: bool = False,
    ) -> Iterator[tuple[Any, EncodedItem | StreamedRecord] | RecordBatch]:
        """Encode ``(key, data)`` pairs; yields ``(key, record)``; with ``batches``, a batch of
        small host tensors stored whole comes as :class:`RecordBatch` objects instead (one per dtype;
        ``batch.jobs[i].key`` is record ``i``'s key).

        CPU items are yielded in order (the records of a batch of small ones by dtype when they
        come as record batches). Small ones (under ``SMALL_ITEM_BYTES``) are encoded in
        batches, one task of the codec pool per batch, at most ``SMALL_ITEM_THREADS`` batches
        of this encoder running at once, while the caller writes the records of the batches
        before. Larger items split their own blocks over the codec pool. GPU items are
        collected and encoded in batched calls at the end (one nvCOMP call per codec and
        bucket, however many tensors).
        ``describe(key)`` names an item in errors. Chunks of GPU records view reused pinned
        memory: consume each record before asking for the next. With ``streams`` (a caller that
        writes a record's chunks before its header), large plain host tensors come as
        :class:`~nvdcp.pipeline.cpu.StreamedRecord` objects, whose chunks are yielded group by
        group as they are compressed; the caller takes all of them, then ``finish()``, before
        asking for the next item (on an error, ``close()``).
        """
        gpu_ok = gpu_available()
        jobs: list[GpuJob] = []
        encode_small = self._encode_small_batches if batches else self._encode_small
        small = _CpuBatches(self.codec_pool(), 2 * SMALL_ITEM_THREADS, self._small_gate,
                            functools.partial(encode_small, describe=describe), batches)
        ahead = _OneAhead(self.ahead_pool())
        try:
            for key, data in items:
                tensor = data.tensor if isinstance(data, DeltaTensor) else data
                if isinstance(tensor, torch.Tensor) and self.uses_gpu(tensor, gpu_ok):
                    jobs.append(self.gpu_job(key, data, describe(key)))  # type: ignore[arg-type]
                    continue
                nbytes = _nbytes(data)
                if nbytes < SMALL_ITEM_BYTES:
                    yield from ahead.drain()  # records come in the items' order
                    yield from small.add(key, data, nbytes)
                    continue
                yield from small.drain()
                if streams and self._streams(data):
                    record = functools.partial(self.stream_tensor, data, describe(key), self.codec_pool())
                    if _goes_ahead(data, nbytes):
                        yield from ahead.push_started(key, record())
                    else:
                        yield from ahead.drain()
                        yield key, record()
                    continue
                encode = functools.partial(self._encode_cpu, data, key, describe, self.codec_pool())
                if _goes_ahead(data, nbytes):
                    yield from ahead.push(key, encode)
                else:
                    yield from ahead.drain()
                    yield key, encode()
            yield from ahead.drain()
            yield from small.drain()
        finally:
            # on an error, no task may still read the items (staged buffers go back)
            ahead.close()
            small.close()
        if jobs:
            for job, encoded in self.encode_gpu_jobs(jobs, shares):
                yield job.key, encoded

    def _encode_small_batches(self, keys: list[Any], datas: list[ItemData], describe: Callable[[Any], str],
                              ) -> list[tuple[Any, EncodedItem] | RecordBatch]:
        """:meth:`_encode_small` for a caller that takes record batches: plain host tensors
        come as batches (:func:`~nvdcp.pipeline.cpu_batch.encode_tensor_batches`), the rest
        (byte blobs, deltas, GPU-only codecs) as ``(key, record)``."""
        plain = [] if self.config.gpu_only else [
            i for i, d in enumerate(datas) if isinstance(d, torch.Tensor) and d.device.type == "cpu"
        ]
        out: list[tuple[Any, EncodedItem] | RecordBatch] = []
        if plain:
            tensors: list[torch.Tensor] = [datas[i] for i in plain]  # type: ignore[misc]
            plain_keys = [keys[i] for i in plain]
            out += encode_tensor_batches(
                tensors, plain_keys, _dtype_codes(tensors, plain_keys, describe),
                functools.partial(choose_layout, codec=self.config.codec), self.config.chunk_bytes, self.config.threads,
            )
        if len(plain) < len(datas):
            taken = set(plain)
            rest = [i for i in range(len(datas)) if i not in taken]
            rest_keys = [keys[i] for i in rest]
            out += zip(rest_keys, self._encode_small(rest_keys, [datas[i] for i in rest], describe))
        return out

    def _encode_small(self, keys: list[Any], datas: list[ItemData], describe: Callable[[Any], str]) -> list[EncodedItem]:
        """One batch of small items (on a codec thread): host tensors are encoded together
        (:mod:`nvdcp.pipeline.cpu_batch`: per-item work in arrays), those saved against a base
        as deltas (:meth:`_encode_small_deltas`); the rest (byte blobs, GPU-only codecs) one by one."""
        out: list[EncodedItem | None] = [None] * len(datas)
        if not self.config.gpu_only:
            host = [i for i, d in enumerate(datas) if _host_tensor(d) is not None]
            deltas = [i for i in host if self._delta_layout_of(datas[i]) is not None]
            whole = sorted(set(host) - set(deltas))
            if whole:
                for i, record in zip(whole, self._encode_small_whole([_host_tensor(datas[i]) for i in whole],  # type: ignore[misc]
                                                                      [keys[i] for i in whole], describe)):
                    out[i] = record
            kept: set[int] = set()  # items whose bytes the delta pass kept
            if deltas:
                got, kept_here = self._encode_small_deltas([keys[i] for i in deltas], [datas[i] for i in deltas],  # type: ignore[misc]
                                                           describe)
                for i, record, k in zip(deltas, got, kept_here):
                    out[i] = record
                    if k:
                        kept.add(i)
            for i in host:  # every base is read by now: kept bytes may overwrite it
                data = datas[i]
                if isinstance(data, DeltaTensor) and data.delta.keep is not None and i not in kept:
                    data.delta.store_kept(tensor_to_host_bytes(data.tensor))
        for i, (key, data) in enumerate(zip(keys, datas)):
            if out[i] is None:
                out[i] = self._encode_cpu(data, key, describe)
        return out  # type: ignore[return-value]

    def _encode_small_whole(self, tensors: list[torch.Tensor], keys: list[Any], describe: Callable[[Any], str],
                            ) -> list[EncodedItem]:
        codes = _dtype_codes(tensors, keys, describe)
        return encode_tensor_batch(
            tensors, codes, functools.partial(choose_layout, codec=self.config.codec), self.config.chunk_bytes,
            self.config.threads,
        )

    def _delta_layout_of(self, data: ItemData) -> Any:
        """The delta layout of an item saved against a base, None when it is stored whole."""
        if not isinstance(data, DeltaTensor) or data.delta.base is None:
            return None
        return choose_delta_layout(data.tensor.dtype, self.config.codec)

    def _encode_small_deltas(self, keys: list[Any], datas: list[DeltaTensor], describe: Callable[[Any], str],
                             ) -> tuple[list[EncodedItem], list[bool]]:
        """Small host items saved against their bases, together: their deltas
        (:func:`~nvdcp.pipeline.cpu_batch.encode_delta_batch`, which also keeps the bytes of
        items kept in host memory), then, as :meth:`encode_tensor` decides one at a time, the
        items stored whole where a delta does not pay (or the item's whole size is unknown, as
        after a base read back from storage). Returns the records and which items were kept."""
        tensors = [d.tensor for d in datas]
        codes = _dtype_codes(tensors, keys, describe)
        keeps = [d.delta.host_keep() for d in datas]
        records = encode_delta_batch(
            tensors, [d.delta.host_base() for d in datas],
            [d.delta.base_digest for d in datas], codes,  # type: ignore[misc]
            functools.partial(choose_delta_layout, codec=self.config.codec), self.config.chunk_bytes, self.config.threads,
            keeps,
        )
        retry = [i for i, (d, r) in enumerate(zip(datas, records)) if d.delta.wants_whole(r.nbytes)]
        if retry:
            wholes = self._encode_small_whole([tensors[i] for i in retry], [keys[i] for i in retry], describe)
            for i, whole in zip(retry, wholes):
                records[i] = datas[i].delta.choose(records[i], whole)
        return records, [k is not None for k in keeps]

    def _encode_cpu(
        self, data: ItemData, key: Any, describe: Callable[[Any], str], pool: ThreadPoolExecutor | None = None,
    ) -> EncodedItem:
        if isinstance(data, DeltaTensor):
            return self.encode_tensor(data.tensor, describe(key), pool, data.delta)
        if isinstance(data, torch.Tensor):
            return self.encode_tensor(data, describe(key), pool)
        return self.encode_bytes(data, pool)

    def encode_owned(self, data: ItemData, where: str, shares: int = 1) -> EncodedItem:
        """Encode one item into a record whose chunks the caller may keep (GPU chunks are
        copied out of the reused pinned memory)."""
        for _, encoded in self.encode_items([(where, data)], lambda key: key, shares):
            if isinstance(data, torch.Tensor) and self.uses_gpu(data):
                encoded = EncodedItem(encoded.header, encoded.header_bytes, [bytes(c) for c in encoded.chunks])
            return encoded
        raise AssertionError("encode_items yields one record per item")


#: Items under this many bytes are encoded in batches (see encode_items); larger ones split their
#: own blocks over the codec pool.
SMALL_ITEM_BYTES = 4 << 20
#: Small items' batches an encoder runs at once (writers of one setting share an encoder). Until
#: small items were encoded in arrays (nvdcp/pipeline/cpu_batch.py) a batch was mostly Python and
#: one at a time was fastest (small_item_threads_2026-12-01_{cpu,h200host}.json). A batch now spends
#: most of its time in native calls without the GIL. ``python -m benchmarks.small_item_threads``,
#: 20,000 small tensors, median write_data: CPU machine (2 cores) 2.51 s with two, 2.78 s with one;
#: H200 host (16 cores) 1.73 s with two, 2.03 / 1.84 / 2.17 s with 1 / 4 / 8
#: (benchmarks/results/small_item_threads_2026-12-01_{cpu,h200host}_session7.json).
SMALL_ITEM_THREADS = 2


#: A batch of small items: one pool task of about this many bytes, or this many items. A batch's
#: Python (a few dozen array calls, header fields per item) holds the GIL, which a save of many
#: small tensors is bound by; larger batches pay it less often, and hold more memory (the window's
#: batches: a save's extra RSS was 43-84 MiB at 16 MiB batches against about 0 at 4 MiB). CPU
#: machine, 20,000 small host tensors on /dev/shm, nine rounds alternating: 16 MiB / 1,024 items
#: 3.03 s, 8 MiB / 512 3.05 s, 4 MiB / 256 3.28 s (medians); ``code_ab``, 8 MiB / 512 against
#: 4 MiB / 256: save 0.888x (forty-first session, docs/BENCHMARKS.md).
SMALL_BATCH_BYTES = 8 << 20
SMALL_BATCH_ITEMS = 512


def _nbytes(data: ItemData) -> int:
    if isinstance(data, DeltaTensor):
        data = data.tensor
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    if isinstance(data, io.BytesIO):
        return data.getbuffer().nbytes
    return memoryview(data).nbytes  # type: ignore[arg-type]  # numpy arrays are buffers


#: A large host tensor of at most this many bytes is compressed while the caller writes the
#: record before it (:class:`_OneAhead`). Each caller then holds two items' plane buffers instead
#: of one; larger items are compressed in turn, so that memory stays bounded.
AHEAD_MAX_BYTES = 256 << 20
#: Threads compressing ahead: one per caller (a writer's data file) at most; more callers wait.
AHEAD_THREADS = 8


def _goes_ahead(data: ItemData, nbytes: int) -> bool:
    """Whether a large item may be compressed ahead of its turn: a plain host tensor (an item
    saved against a base keeps its bytes in the base cache in the order items come) of at most
    ``AHEAD_MAX_BYTES``."""
    return isinstance(data, torch.Tensor) and data.device.type == "cpu" and nbytes <= AHEAD_MAX_BYTES


class _OneAhead:
    """Large items compressed one ahead of the caller: item N+1 is compressed (on a thread of
    the encoder's ahead pool, which spreads its blocks over the codec pool) while the caller
    writes item N's record. Before, the file thread compressed an item, then wrote it, and the
    codec threads idled through every write (a 268 MB CPU save to /dev/shm: about 40 ms of
    260)."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        self.pending: tuple[Any, Future[EncodedItem | StreamedRecord]] | None = None

    def push(self, key: Any, encode: Callable[[], EncodedItem]) -> Iterator[tuple[Any, EncodedItem | StreamedRecord]]:
        """Start ``encode`` (``key``'s record); yields the record of the item pushed before it."""
        before, self.pending = self.pending, (key, self.pool.submit(encode))  # tracked before any yield
        if before is not None:
            yield before[0], before[1].result()

    def push_started(self, key: Any, record: StreamedRecord) -> Iterator[tuple[Any, EncodedItem | StreamedRecord]]:
        """Hold ``record`` (its groups already queued on the codec pool, behind the record
        before it); yields the record of the item pushed before it."""
        started: Future[EncodedItem | StreamedRecord] = Future()
        started.set_result(record)
        before, self.pending = self.pending, (key, started)
        if before is not None:
            yield before[0], before[1].result()

    def drain(self) -> Iterator[tuple[Any, EncodedItem | StreamedRecord]]:
        """Yield the pending item's record, if any."""
        if self.pending is not None:
            (key, future), self.pending = self.pending, None
            yield key, future.result()

    def close(self) -> None:
        """Wait for the pending item's compression; its record and error are dropped."""
        if self.pending is not None:
            _, future = self.pending
            self.pending = None
            with contextlib.suppress(BaseException):
                record = future.result()
                if isinstance(record, StreamedRecord):
                    record.close()


#: Encodes one batch of small items: ``(keys, datas) -> records``, in order; or, for a caller
#: that takes record batches, ``(key, record)`` pairs and batches.
BatchEncode = Callable[[list[Any], list[ItemData]], list[Any]]


def _run_batch(encode: BatchEncode, keys: list[Any], datas: list[ItemData],
               gate: threading.BoundedSemaphore) -> list[Any]:
    with gate:  # a pool thread waiting here holds no GIL; the batch holding the gate needs nothing else
        return encode(keys, datas)


class _CpuBatches:
    """Small items grouped into pool tasks (``encode`` runs one batch), ``window`` tasks in
    flight at most, their records handed back in the order the items came."""

    def __init__(self, pool: ThreadPoolExecutor, window: int, gate: threading.BoundedSemaphore,
                 encode: BatchEncode, entries: bool = False) -> None:
        self.pool = pool
        self.entries = entries  # encode returns entries (pairs and batches), not records
        self.window = max(1, window)
        self.gate = gate
        self.encode = encode
        self.keys: list[Any] = []
        self.datas: list[ItemData] = []
        self.nbytes = 0
        self.pending: list[tuple[list[Any], Future[list[Any]]]] = []

    def add(self, key: Any, data: ItemData, nbytes: int) -> Iterator[tuple[Any, EncodedItem] | RecordBatch]:
        """Queue one item; yields the records of batches done while the window is full."""
        self.keys.append(key)
        self.datas.append(data)
        self.nbytes += nbytes
        if self.nbytes >= SMALL_BATCH_BYTES or len(self.keys) >= SMALL_BATCH_ITEMS:
            self._submit()
            while len(self.pending) > self.window:
                yield from self._pop()

    def drain(self) -> Iterator[tuple[Any, EncodedItem] | RecordBatch]:
        """Yield every queued item's record, in order."""
        self._submit()
        while self.pending:
            yield from self._pop()

    def close(self) -> None:
        """Wait for the tasks still running; their results and errors are dropped."""
        for _, future in self.pending:
            future.cancel()
            with contextlib.suppress(BaseException):
                future.result()
        self.pending = []

    def _submit(self) -> None:
        if self.keys:
            self.pending.append((self.keys, self.pool.submit(_run_batch, self.encode, self.keys, self.datas, self.gate)))
            self.keys, self.datas, self.nbytes = [], [], 0

    def _pop(self) -> Iterator[tuple[Any, EncodedItem] | RecordBatch]:
        keys, future = self.pending.pop(0)
        if self.entries:
            yield from future.result()
        else:
            yield from zip(keys, future.result())


def descriptor_codec(encoded: EncodedItem) -> str:
    """The codec named in an item's ``.metadata`` descriptor: the first one doing work."""
    from nvdcp.codecs import codec_name

    ids = [c for c in encoded.header.plane_codecs if c != 0]
    return codec_name(ids[0]) if ids else "none"


def _host_tensor(data: ItemData) -> torch.Tensor | None:
    """The host tensor of a small item (a plain one, or one saved against a base), else None."""
    tensor = data.tensor if isinstance(data, DeltaTensor) else data
    return tensor if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" else None


def _dtype_codes(tensors: list[torch.Tensor], keys: list[Any], describe: Callable[[Any], str]) -> list[int]:
    """Each tensor's dtype code, looked up once per dtype (the item is named only on an error)."""
    codes: dict[torch.dtype, int] = {}
    out = []
    for t, key in zip(tensors, keys):
        code = codes.get(t.dtype)
        if code is None:
            code = codes[t.dtype] = _dtype_code(t.dtype, describe(key))
        out.append(code)
    return out


def _dtype_code(dtype: torch.dtype, where: str) -> int:
    try:
        return dtype_code(dtype)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


# -- the documented, closable default ----------------------------------------------------------
_SHARED: dict[tuple[EncodeConfig, GpuConfig], ItemEncoder] = {}
_SHARED_LOCK = threading.Lock()


def shared_encoder(config: EncodeConfig, gpu: GpuConfig) -> ItemEncoder:
    """The process-wide encoder for these settings: writers made per save share its GPU
    encoders and pinned pool. :func:`close_shared_encoders` (and :func:`nvdcp.release_resources`)
    frees them; the next save builds them again."""
    with _SHARED_LOCK:
        if (config, gpu) not in _SHARED:
            _SHARED[(config, gpu)] = ItemEncoder(config, gpu)
        return _SHARED[(config, gpu)]


def close_shared_encoders() -> None:
    """Close and forget every shared encoder."""
    with _SHARED_LOCK:
        encoders = list(_SHARED.values())
        _SHARED.clear()
    for encoder in encoders:
        encoder.close()


__all__ = ["ItemData", "ItemEncoder", "close_shared_encoders", "descriptor_codec", "shared_encoder"]
