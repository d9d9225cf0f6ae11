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
then, not assumed: the baseline depends on the torch build). Reading a count is ~0.1 µs.

Same rules as torch's caching allocator, which also hands a block out again once its tensor is gone: the next call
on the same stream reuses it, in stream order. Two differences, both documented (README "Options"):
  - a set serves the stream it was made on only (its key holds the raw stream), and none is taken while the stream is
    being captured into a CUDA graph (those outputs come from the graph's private pool, as before);
  - `Tensor.record_stream(other)` is not seen: code that reads the outputs on another stream must keep a reference
    until that stream is done (or turn reuse off with LLEP_REUSE_OUTPUTS=0).
A tensor's layout changed in place and then dropped (unsqueeze_, transpose_, as_strided_, set_: each moves the
tensor's version) retires its set. Two in-place changes move no version and are not seen: `resize_` and
`requires_grad_` on an output that is then dropped come back with the next call.
Without the counters (torch builds before they existed) the pool is off and every call allocates, as before.
"""
import sys
import threading
from typing import Callable, Dict, Hashable, List, Optional, Tuple

import torch

_storage_use_count: Optional[Callable[[int], int]] = getattr(torch._C, '_storage_Use_Count', None)
AVAILABLE = _storage_use_count is not None and hasattr(torch.Tensor, '_use_count')


def _layout(t: torch.Tensor) -> Tuple:
    return t.dtype, t.shape, t.stride(), t.storage_offset(), t.requires_grad


class _Set:
    """One set of output tensors (None where a mode has no such output) and its counts when only the pool held it.
    `dead`: a tensor's layout was changed in place (unsqueeze_, transpose_, set_, ...): the set is not handed out again."""

    __slots__ = ('tensors', '_items', '_layouts', '_baseline', 'dead')

    def __init__(self, tensors: Tuple[Optional[torch.Tensor], ...]) -> None:
        self.tensors = tensors
        # (tensor, its storage's Python object, which also keeps the storage's address valid for the count, address)
        self._items = tuple((t, st, st._cdata) for t, st in ((t, t.untyped_storage()) for t in tensors if t is not None))
        self._layouts = tuple(_layout(t) for t, _, _ in self._items)
        self.dead = False
        self._baseline: List[Tuple[int, ...]] = self._scan(None)

    def _scan(self, baseline):
        """The counts of every tensor (baseline None), or whether they equal baseline's, stopping at the first that
        does not. One code path for both, so the references the scan itself makes are the same in the baseline.
        The last count is the tensor's version, which every in-place torch op moves: the layout is checked again then
        (a write such as mul_ leaves it, and the version becomes the baseline's; unsqueeze_ does not: the set dies)."""
        rc = sys.getrefcount
        got = []
        for t, st, cdata in self._items:
            counts = (rc(t), rc(st), t._use_count(), _storage_use_count(cdata), t._version)
            if baseline is None:
                got.append(counts)
                continue
            i = len(got)
            if counts != baseline[i]:
                if counts[:4] != baseline[i][:4]:
                    return False  # held
                if _layout(t) != self._layouts[i]:
                    self.dead = True
                    return False
                baseline[i] = counts
            got.append(None)
        return got if baseline is None else True

    def free(self) -> bool:
        return self._scan(self._baseline)


class OutputPool:
    """Sets of output tensors per key (the caller's: shape, mode and stream), at most `per_key` sets per key and
    `max_sets` in all; a call that finds every set of its key held gets fresh tensors, kept if there is room."""

    def __init__(self, per_key: int = 2, max_sets: int = 8) -> None:
        self._sets: Dict[Hashable, List[_Set]] = {}
        self._count = 0
        self._per_key = per_key
        self._max_sets = max_sets
        self._lock = threading.Lock()  # two threads may call one Buffer (vLLM's DBO): one taker per set

    def take(self, key: Hashable) -> Optional[List[Optional[torch.Tensor]]]:
        """A free set's tensors, or None. The list is made under the lock, so the set reads as held before another
        thread can look at it."""
        sets = self._sets.get(key)
        if sets:
            with self._lock:
                for i, s in enumerate(sets):
                    if s.free():
                        if i + 1 < len(sets):  # the next call tries the others first: a caller holding the last
                            sets.append(sets.pop(i))  # outputs (a handle until its combine) finds a free set at once
                        return list(s.tensors)
                    if s.dead:  # its room goes to a fresh set (the caller's adopt)
                        del sets[i]
                        self._count -= 1
                        break
        return None

    def adopt(self, key: Hashable, tensors: Tuple[Optional[torch.Tensor], ...]) -> None:
        """Keeps a fresh set if there is room. Call it before the tensors are bound anywhere but `tensors`: its
        counts now are the set's free state."""
        with self._lock:
            sets = self._sets.setdefault(key, [])
            if len(sets) < self._per_key and self._count < self._max_sets:
                sets.append(_Set(tensors))
                self._count += 1

    def clear(self) -> None:
        with self._lock:
            self._sets = {}
            self._count = 0

    def __len__(self) -> int:
        return self._count
