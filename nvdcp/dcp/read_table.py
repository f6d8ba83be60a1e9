"""A load plan's items by position: one ``.metadata`` lookup per item, the rest in lists.

``NvcompReader.read_data`` handles every distinct storage item of a rank's plan, and MoE states
under FSDP hold 100,000 of them per rank. A ``MetadataIndex`` hashes in Python (the dataclass's
generated ``__hash__``), so each dictionary keyed by it costs a Python call per item and step:
the reader's main thread hashed every item 13 times (cProfile, 20,000 items). Here an item is
looked up once; its kind, checks, file order, places and batch follow by position, mostly in
C-level passes (``map``, ``sorted`` with a list's ``__getitem__`` as key).
"""

from __future__ import annotations

import dataclasses
from operator import attrgetter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import ReadItem

#: A record's file, offset and length.
Place = tuple[str, int, int]

_place_of = attrgetter("relative_path", "offset", "length")
_file_position = attrgetter("relative_path", "offset")
#: What a ``MetadataIndex`` hashes and compares by, as a plain tuple (hashed in C).
index_key = attrgetter("fqn", "offset")
_request_key = attrgetter("storage_index.fqn", "storage_index.offset")


def group_requests(items: list[ReadItem]) -> tuple[list[MetadataIndex], list[list[ReadItem]]]:
    """A plan's distinct storage items, in plan order, and each one's requests (several when a
    resharded load reads parts of one stored chunk into several tensors)."""
    try:
        keys: list[object] = list(map(_request_key, items))
    except AttributeError:  # a custom planner's index that is no MetadataIndex: grouped as it is
        keys = [req.storage_index for req in items]
    first = dict(zip(keys, range(len(keys))))
    if len(first) == len(items):  # one request per item (a load on the saving world size)
        return [req.storage_index for req in items], [[req] for req in items]
    groups: dict[object, list[ReadItem]] = {}
    for key, req in zip(keys, items):
        groups.setdefault(key, []).append(req)
    reqs = list(groups.values())
    return [group[0].storage_index for group in reqs], reqs


@dataclasses.dataclass
class ReadTable:
    """The distinct items of a load plan, position ``p`` in every list: ``keys[p]`` its index,
    ``reqs[p]`` the plan's requests of it, ``infos[p]`` its ``.metadata`` record (checked by the
    reader), ``stock[p]`` whether stock DCP stored it, ``delta[p]`` whether it is an nvdcp delta
    record (rebuilt from its base chain)."""

    keys: list[MetadataIndex]
    reqs: list[list[ReadItem]]
    infos: list[_StorageInfo]
    stock: list[bool]
    delta: list[bool]
    _by_id: dict[int, list[ReadItem]] = dataclasses.field(init=False, repr=False)
    _by_value: dict[MetadataIndex, list[ReadItem]] | None = dataclasses.field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        self._by_id = dict(zip(map(id, self.keys), self.reqs))

    def __len__(self) -> int:
        return len(self.keys)

    def requests_of(self, index: MetadataIndex) -> list[ReadItem]:
        """The plan's requests of ``index``. Found by identity (``keys`` are alive, so no other
        object has one's ``id``): every load path hands back the table's own key objects, and
        that needs no Python-level hash; by value otherwise."""
        found = self._by_id.get(id(index))
        if found is not None:
            return found
        if self._by_value is None:
            self._by_value = dict(zip(self.keys, self.reqs))
        return self._by_value[index]

    def positions(self, *, delta: bool) -> list[int]:
        """Positions of the delta items (``delta=True``) or of all the others."""
        return [p for p, is_delta in enumerate(self.delta) if is_delta is delta]

    def in_file_order(self, positions: list[int]) -> list[int]:
        """``positions`` sorted by file, then offset: a local disk sees sequential-ish reads."""
        where = list(map(_file_position, self.infos))
        return sorted(positions, key=where.__getitem__)

    def places(self, positions: list[int]) -> list[Place]:
        """Each position's record: ``(file, offset, length)``."""
        infos = self.infos
        return list(map(_place_of, map(infos.__getitem__, positions)))

    def lengths_are_sane(self) -> bool:
        """Whether every record's offset and length is a non-negative int, checked in C passes
        (False: the reader checks record by record and names the first bad one)."""
        for values in (list(map(attrgetter("offset"), self.infos)), list(map(attrgetter("length"), self.infos))):
            if values and (set(map(type, values)) != {int} or min(values) < 0):
                return False
        return True
