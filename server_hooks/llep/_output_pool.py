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
data address per set, not per tensor) and the counts are read natively (`_llep.pool_counts` / `pool_take`, the same
torch calls without the interpreter; the take also walks the key's sets in C). The addresses the pool returns with a
set are that data address plus each tensor's fixed offset, read on every take (a `resize_` may have moved the
storage).

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
from typing import Callable, Dict, Hashable, List, NamedTuple, Optional, Tuple

import torch

from llep import _llep

_counts = _llep.pool_counts
_take = _llep.pool_take
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


class _Set(NamedTuple):
    """One set of output tensors as the pool keeps it, a tuple _llep.pool_take reads (its fields in this order): the
    outputs (None where a mode has no such output), the live ones, their storages (usually one: `one_block`) with
    their StorageImpl addresses, the counts when only the pool held the set, each output's place in a storage, and
    each live tensor's layout (checked again when its version moved)."""
    tensors: Tensors
    live: Tuple[torch.Tensor, ...]
    storages: Tuple[object, ...]
    cdatas: Tuple[int, ...]
    baseline: Tuple[int, ...]
    places: Tuple[Optional[Place], ...]
    layouts: Tuple[Tuple, ...]


def _new_set(tensors: Tensors) -> _Set:
    """A set of fresh tensors, its baseline read now. No local may refer to a tensor or storage here (only the
    tuples that hold them): the baseline's refcounts would count it."""
    live = tuple(t for t in tensors if t is not None)
    storages, cdatas, places = _storages_and_places(tensors)
    return _Set(tensors, live, storages, cdatas, _counts(live, storages, cdatas, _storage_use_count), places,
                tuple(_layout(t) for t in live))


class OutputPool:
    """Sets of output tensors per key (the caller's: shape, mode and stream), at most `per_key` sets per key and
    `max_sets` in all; a call that finds every set of its key held gets fresh tensors, kept if there is room."""

    def __init__(self, per_key: int = 2, max_sets: int = 8) -> None:
        self._sets: Dict[Hashable, List[_Set]] = {}
        self._count = 0
        self._per_key = per_key
        self._max_sets = max_sets
        # Two threads may call one Buffer (vLLM's DBO): adopt, _settle and clear change the lists and the count under
        # it; a take needs none (_llep.pool_take reserves a set before it reads its counts).
        self._lock = threading.Lock()

    def take(self, key: Hashable) -> Optional[Tuple[List[Optional[torch.Tensor]], List[int]]]:
        """A free set's (tensors, their data addresses), or None. _llep.pool_take reads the counts of the key's sets in
        order (the refcount, use count and version of every tensor, the refcount and use count of every storage, then
        one data pointer per storage, which a resize_ may have moved) and moves the set it hands out last, so a caller
        holding the newest outputs (a handle until its combine) finds a free set at once; it needs no lock (its doc).
        A set free but for a tensor's version (every in-place torch op moves it) is settled and the take repeated."""
        sets = self._sets.get(key)
        while sets:
            got = _take(sets, _storage_use_count)
            if type(got) is not int:
                return got
            self._settle(sets, got)
        return None

    def _settle(self, sets: List[_Set], i: int) -> None:
        """Set i of `sets` was free but for a tensor's version: a write such as mul_ leaves the tensor's layout, and
        the version becomes the baseline's; unsqueeze_, transpose_, set_, ... change it, and the set is dropped (its
        room goes to a fresh set). Under the lock: another thread may be doing the same. No local names a tensor (a
        take's counts would count it)."""
        with self._lock:
            if i >= len(sets):
                return  # the list changed meanwhile: the next take finds the set again
            s = sets[i]
            for k in range(len(s.live)):
                if s.live[k]._version == s.baseline[3 * k + 2]:
                    continue
                if _layout(s.live[k]) != s.layouts[k]:
                    del sets[i]
                    self._count -= 1
                    return
                base = list(s.baseline)
                base[3 * k + 2] = s.live[k]._version
                sets[i] = s._replace(baseline=tuple(base))
                s = sets[i]

    def has_room(self, key: Hashable) -> bool:
        """Whether adopt(key, ...) would keep a set now (a caller makes a set the pool cannot keep the cheaper way)."""
        return len(self._sets.get(key, ())) < self._per_key and self._count < self._max_sets

    def adopt(self, key: Hashable, tensors: Tensors) -> None:
        """Keeps a fresh set if there is room. Call it before the tensors are bound anywhere but `tensors`: its
        counts now are the set's free state."""
        with self._lock:
            if self.has_room(key):
                self._sets.setdefault(key, []).append(_new_set(tensors))
                self._count += 1

    def clear(self) -> None:
        with self._lock:
            self._sets = {}
            self._count = 0

    def __len__(self) -> int:
        return self._count
