"""megatron-core ``torch_dist`` checkpoints written and read one tensor at a time.

The format is PyTorch Distributed Checkpoint (DCP) plus megatron-core's ``metadata.json`` (backend
names) and ``common.pt`` (non-tensor state). Writing goes through DCP's own ``save`` with a planner whose
``resolve_data`` produces each tensor on demand from the HF files, so a model never exists in memory
as a whole; reading goes through DCP's ``load`` with a planner that requests one region (one layer of
one key) at a time. Any chunking written here is resharded by DCP on load, at any layout.
"""

from __future__ import annotations

import contextlib
import io
import threading
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_recipes import checkpoint
from megatron_recipes.config.errors import RecipeError
from megatron_recipes.convert.target import Item

Produce = Callable[[Item], torch.Tensor]


@contextlib.contextmanager
def _unwrapped_errors() -> Iterator[None]:
    """DCP wraps every failure in CheckpointException; let a user-facing RecipeError through as itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, RecipeError):
                raise inner from None
        raise


def _chunk(item: Item) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(item.offset), sizes=torch.Size((1,) * item.prepend + item.shape))


class _LazySavePlanner(DefaultSavePlanner):
    """Plans the items without their data; ``resolve_data`` makes each tensor when the writer asks.

    The filesystem writer keeps references to written tensors until its file is closed, so the planner
    frees the storage of the tensor it handed out before (per writer thread: each thread writes its
    tensors strictly one after another) once the next is requested. Peak memory stays one item per
    writer thread, plus what ``produce`` needs for one item.
    """

    def __init__(
        self,
        items: Iterable[Item],
        produce: Produce,
        objects: Optional[Dict[str, object]] = None,
        on_item: Optional[Callable[[Item], None]] = None,
    ):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.items: Dict[MetadataIndex, Item] = {MetadataIndex(i.key, torch.Size(i.offset)): i for i in items}
        self.objects = dict(objects or {})
        self.produce = produce
        self.on_item = on_item
        self._handed_out: Dict[int, torch.Tensor] = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        write_items = [
            WriteItem(
                index=index,
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=_chunk(item),
                    properties=TensorProperties(dtype=item.dtype),
                    size=torch.Size(item.global_shape),
                ),
            )
            for index, item in self.items.items()
        ]
        # megatron-core stores each ShardedObject key as a torch.save'd list of its shards' data
        write_items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.objects]
        self.plan = SavePlan(write_items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save([self.objects[write_item.index.fqn]], buffer)
            return buffer
        self.release(threading.get_ident())
        item = self.items[write_item.index]
        tensor = self.produce(item).reshape((1,) * item.prepend + item.shape)
        self._handed_out[threading.get_ident()] = tensor
        if self.on_item:
            self.on_item(item)
        return tensor

    def release(self, thread: Optional[int] = None) -> None:
        threads = [thread] if thread is not None else list(self._handed_out)
        for t in threads:
            tensor = self._handed_out.pop(t, None)
            if tensor is not None:
                tensor.untyped_storage().resize_(0)


def write_items(
    directory: Path,
    items: Iterable[Item],
    produce: Produce,
    objects: Optional[Dict[str, object]] = None,
    on_item: Optional[Callable[[Item], None]] = None,
) -> None:
    """Write ``items`` (and ShardedObjects) as DCP data in ``directory``; see also ``write_megatron_files``."""
    from torch.distributed.checkpoint import FileSystemWriter

    directory.mkdir(parents=True, exist_ok=True)
    planner = _LazySavePlanner(items, produce, objects, on_item)
    # One writer thread and no copy-ahead: tensors are produced strictly one after another.
    writer = FileSystemWriter(str(directory), single_file_per_rank=True, thread_count=1, per_thread_copy_ahead=0)
    try:
        with _unwrapped_errors():
            dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
    finally:
        planner.release()


def write_megatron_files(directory: Path, common_state: dict) -> None:
    """megatron-core's ``common.pt`` and ``metadata.json`` (the latter last: it marks a dist checkpoint)."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    torch.save(common_state, directory / "common.pt")
    save_config(CheckpointingConfig(sharded_backend="torch_dist", sharded_backend_version=1), str(directory))


class _CachedReader(dcp.FileSystemReader):
    """A filesystem reader that parses ``.metadata`` once for many region reads."""

    def __init__(self, path: Path):
        super().__init__(str(path))
        self._metadata = None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            with checkpoint.restricted_loading():  # .metadata is a pickle: only the index record classes (SECURITY.md)
                self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class _RegionLoadPlanner(DefaultLoadPlanner):
    """Loads one region of one stored tensor (e.g. layer 7 of a stacked key) into a buffer."""

    def __init__(self, key: str, offset: Tuple[int, ...], out: torch.Tensor):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.key, self.offset, self.out = key, offset, out

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.state_dict = {}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata[self.key]
        chunk = ChunkStorageMetadata(offsets=torch.Size(self.offset), sizes=self.out.shape)
        return LoadPlan(create_read_items_for_chunk_list(self.key, md, [chunk]))

    def resolve_tensor(self, read_item):
        view = self.out
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item, tensor) -> None:
        pass


class CheckpointReader:
    """Reads items of a torch_dist checkpoint, whatever layout wrote it."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.reader = _CachedReader(self.directory)

    def tensors(self) -> Dict[str, TensorStorageMetadata]:
        md = self.reader.read_metadata()
        return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

    def read(self, item: Item, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The tensor of one item (index axes dropped), in ``dtype`` or as stored; a damaged file is a
        RecipeError naming the tensor and the cause (not torch's per-rank tracebacks)."""
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

        try:
            return self._read(item, dtype)
        except RecipeError:
            raise
        except (Exception, CheckpointException) as exc:
            raise RecipeError(
                f"checkpoint '{self.directory}' could not be read at tensor {item.key} ({checkpoint.root_cause(exc)})",
                fix="the checkpoint is damaged or was copied incompletely; use another one (or copy it again)",
            ) from None

    def _read(self, item: Item, dtype: Optional[torch.dtype]) -> torch.Tensor:
        stored = self.tensors()[item.key]
        whole = self._whole_chunk(item)
        if whole is not None:
            return whole.reshape(item.shape).to(dtype or whole.dtype)
        out = torch.empty((1,) * item.prepend + item.shape, dtype=dtype or stored.properties.dtype)
        planner = _RegionLoadPlanner(item.key, item.offset, out)
        with _unwrapped_errors():
            dcp.load({}, storage_reader=self.reader, planner=planner, no_dist=True)
        return out.reshape(item.shape)

    def _whole_chunk(self, item: Item) -> Optional[torch.Tensor]:
        """The item loaded straight from its file when it is exactly one stored chunk, else None.

        DCP's region load deserialises the stored chunk and copies it into the caller's buffer, so the
        largest tensor is briefly held twice; a checkpoint written at the layout being read (TP=1 for
        export) stores every item as one chunk, which can be handed over as loaded. Compressed chunks,
        or a reader without the file-view hook, take the region path.
        """
        index = MetadataIndex(item.key, item.offset)
        info = self.reader.read_metadata().storage_data.get(index)
        shape = torch.Size((1,) * item.prepend + item.shape)
        chunks = self.tensors()[item.key].chunks
        exact = any(tuple(c.offsets) == tuple(item.offset) and c.sizes == shape for c in chunks)
        if info is None or not exact or getattr(info, "transform_descriptors", None) or not hasattr(self.reader, "_slice_file"):
            return None
        with open(self.directory / info.relative_path, "rb") as stream:
            return torch.load(self.reader._slice_file(stream, info), map_location="cpu", weights_only=True)
