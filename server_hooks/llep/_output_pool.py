"""Output tensors a Buffer hands out again once nothing refers to them (issue #19 item 2: host cost per call).

Why: making a tensor from Python costs ~5 µs (the dispatcher, the caching allocator, the Python object), and a
dispatch returns five. DeepEP makes them in C++ at ~1 µs each; llep's native module does not link torch (one build
serves any torch), so it cannot. Instead a Buffer keeps the sets it made and returns one again when its user has let
go of every tensor in it: the call then costs a few counter reads instead of five allocations.

When is a set free? Every way to keep a tensor's memory alive raises one of four counts, all read without
allocating: the Python object's reference count (a variable, a list, a hook that holds the call's tensors), the C++
TensorImpl's use count (C++ holding the same tensor: a DLPack capsule, an async collective's work, autograd), the
storage's use count (a view, a slice, a reshape) and the reference count of the storage's Python object
(`untyped_storage()`: torch 2.x keeps one Python object per storage, the pool's, so holding it moves no C++ count).
A set is free when all four equal what they were right after the set was made, when only this pool held it (measured
then, not assumed: the baseline depends on the torch build). Reading them from Python cost a dispatch ~3.5 µs on an
H100 host, so the tensors of a set a Buffer makes share one allocation (`one_block`: one storage's two counts and one
data address per set, not per tensor) and the counts are read natively (`_llep.pool_probe`, the same torch calls
without the interpreter). The addresses the pool returns with a set are that data address plus each tensor's fixed
offset, read on every take (a `resize_` may have moved the storage).

Same rules as torch's caching allocator, which also hands a block out again once its tensor is gone: the next call
on the same stream reuses it, in stream order. Differences, documented (README "Options"):
  - a set serves the stream it was made on only (its key holds the raw stream), and none is taken while the stream is
    being captured into a CUDA graph (those outputs come from the graph's private pool, as before);
  - `Tensor.record_stream(other)` is not seen: code that reads the outputs on another stream must keep a reference
    until that stream is done (or turn reuse off with LLEP_REUSE_OUTPUTS=0);
  - one tensor of a set kept alive keeps the whole set's memory (one allocation), and resizing one output's storage
    (`untyped_storage().resize_`) resizes the set's.
A tensor's layout changed in place and then dropped (unsqueeze_, transpose_, as_strided_, set_: each moves the
tensor's version) retires its set. Two in-place changes move no version and are not seen: `resize_` and
`requires_grad_` on an output that is then dropped come back with the next call.
Without the counters (torch builds before they existed) the pool is off and every call allocates, as before.
"""
import threading
from typing import Callable, Dict, Hashable, List, Optional, Tuple

import torch

from llep import _llep

_probe = _llep.pool_probe
_storage_use_count: Optional[Callable[[int], int]] = getattr(torch._C, '_storage_Use_Count', None)
AVAILABLE = _storage_use_count is not None and hasattr(torch.Tensor, '_use_count')

Tensors = Tuple[Optional[torch.Tensor], ...]
Spec = Optional[Tuple[Tuple[int, ...], Tuple[int, ...], torch.dtype]]  # (shape, stride, dtype), None: no tensor
Place = Tuple[int, int]  # a tensor's storage (an index into its set's storages) and byte offset in it


def _layout(t: torch.Tensor) -> Tuple:
    return t.dtype, t.shape, t.stride(), t.storage_offset(), t.requires_grad


def _itemsize(dtype: torch.dtype) -> int:
    size = getattr(dtype, 'itemsize', None)  # torch >= 2.1
    return size if size is not None else torch.empty((), dtype=dtype).element_size()


def one_block(like: torch.Tensor, specs: Tuple[Spec, ...]) -> Tensors:
    """Tensors of one allocation on `like`'s device, one per spec (None for a None spec), each 256-byte aligned:
    the set the pool keeps for a call with several outputs (the module doc: one storage to check per set). Each is
    set_ onto the block's storage, not a view of the block: like a tensor of its own, it has no base and its own
    version counter."""
    offsets, end = [], 0
    for spec in specs:
        offsets.append(end)
        if spec is not None:
            shape, stride, dtype = spec
            span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
            end += (span * _itemsize(dtype) + 255) // 256 * 256
    block = like.new_empty((max(end, 256),), dtype=torch.uint8)
    storage = block.untyped_storage() if hasattr(block, 'untyped_storage') else block.storage().untyped()  # torch 1.x
    return tuple(None if spec is None else
                 like.new_empty((0,), dtype=spec[2]).set_(storage, off // _itemsize(spec[2]), spec[0], spec[1])
                 for spec, off in zip(specs, offsets))


def _storages_and_places(tensors: Tensors) -> Tuple[Tuple[object, ...], Tuple[int, ...], Tuple[Optional[Place], ...]]:
    """The distinct storages of `tensors` (by StorageImpl address): their Python objects (which also keep the addresses
    valid for the use count) and addresses; and each tensor's place: (index of its storage, byte offset) or None."""
    storages: List[object] = []
    cdatas: List[int] = []
    places: List[Optional[Place]] = []
    for t in tensors:
        if t is None:
            places.append(None)
            continue
        st = t.untyped_storage()
        if st._cdata not in cdatas:
            storages.append(st)
            cdatas.append(st._cdata)
        places.append((cdatas.index(st._cdata), t.storage_offset() * t.element_size()))
    return tuple(storages), tuple(cdatas), tuple(places)


class _Set:
    """One set of output tensors (None where a mode has no such output), its storages (usually one: `one_block`) and
    its counts when only the pool held it. `dead`: a tensor's layout was changed in place (unsqueeze_, transpose_,
    set_, ...): the set is not handed out again."""

    __slots__ = ('tensors', '_live', '_storages', '_cdatas', '_places', '_layouts', '_baseline', 'dead')

    def __init__(self, tensors: Tensors) -> None:
        self.tensors = tensors
        self._live = tuple(t for t in tensors if t is not None)
        self._storages, self._cdatas, self._places = _storages_and_places(tensors)
        self._layouts = tuple(_layout(t) for t in self._live)
        self.dead = False
        # No local may refer to a tensor or storage here: the baseline's refcounts would count it.
        self._baseline = _probe(self._live, self._storages, self._cdatas, _storage_use_count, None, None)

    def claim(self) -> Optional[List[int]]:
        """Each tensor's data address (0 for None) if only the pool holds the set, else None. The counts are read
        natively (_llep.pool_probe: the refcount, use count and version of every tensor, the refcount and use count of
        every storage, then one data pointer per storage, which a resize_ may have moved). A tensor's version that
        moved (every in-place torch op moves it) has its layout checked again: a write such as mul_ leaves it and the
        version becomes the baseline's; unsqueeze_ does not, and the set dies."""
        while True:
            got = _probe(self._live, self._storages, self._cdatas, _storage_use_count, self._baseline, self._places)
            if got is None or type(got) is list:
                return got
            # Only this tensor's version moved. (No local names it: the probe again would count that reference.)
            if _layout(self._live[got]) != self._layouts[got]:
                self.dead = True
                return None
            base = list(self._baseline)
            base[3 * got + 2] = self._live[got]._version
            self._baseline = tuple(base)


class OutputPool:
    """Sets of output tensors per key (the caller's: shape, mode and stream), at most `per_key` sets per key and
    `max_sets` in all; a call that finds every set of its key held gets fresh tensors, kept if there is room."""

    def __init__(self, per_key: int = 2, max_sets: int = 8) -> None:
        self._sets: Dict[Hashable, List[_Set]] = {}
        self._count = 0
        self._per_key = per_key
        self._max_sets = max_sets
        self._lock = threading.Lock()  # two threads may call one Buffer (vLLM's DBO): one taker per set

    def take(self, key: Hashable) -> Optional[Tuple[List[Optional[torch.Tensor]], List[int]]]:
        """A free set's (tensors, their data addresses), or None. The list is made under the lock, so the set reads as
        held before another thread can look at it."""
        sets = self._sets.get(key)
        if sets:
            with self._lock:
                for i, s in enumerate(sets):
                    addresses = s.claim()
                    if addresses is not None:
                        if i + 1 < len(sets):  # the next call tries the others first: a caller holding the last
                            sets.append(sets.pop(i))  # outputs (a handle until its combine) finds a free set at once
                        return list(s.tensors), addresses
                    if s.dead:  # its room goes to a fresh set (the caller's adopt)
                        del sets[i]
                        self._count -= 1
                        break
        return None

    def has_room(self, key: Hashable) -> bool:
        """Whether adopt(key, ...) would keep a set now (a caller makes a set the pool cannot keep the cheaper way)."""
        return len(self._sets.get(key, ())) < self._per_key and self._count < self._max_sets

    def adopt(self, key: Hashable, tensors: Tensors) -> None:
        """Keeps a fresh set if there is room. Call it before the tensors are bound anywhere but `tensors`: its
        counts now are the set's free state."""
        with self._lock:
            if self.has_room(key):
                self._sets.setdefault(key, []).append(_Set(tensors))
                self._count += 1

    def clear(self) -> None:
        with self._lock:
            self._sets = {}
            self._count = 0

    def __len__(self) -> int:
        return self._count
