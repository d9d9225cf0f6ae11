#!/usr/bin/env python3
"""Output reuse (llep/_output_pool.py, LLEP_REUSE_OUTPUTS): a set of output tensors is handed out again only when
nothing refers to any tensor in it, and what a caller still holds is never written by a later call.

With a torch that has the counters (torch 2.x: torch._C._storage_Use_Count, Tensor._use_count) every way of holding
an output is tried: the tensor itself, a view, a DLPack capsule (C++ holding the TensorImpl), a receive hook that was
not run; each must make the next call use other memory and leave the held values as they were, and once everything
is dropped the next call must reuse the memory; a tensor written in place and dropped is reused, one whose layout was
changed in place (unsqueeze_) never. Without the counters (Debian's torch 1.13, CI) the pool must be off;
the held-values checks hold for any allocator and run there too. The Buffer cases run on one rank: CPU backend under pytest, `--device cuda` on a GPU
(there also a CUDA-graph capture, whose outputs must come from the graph's pool, not from the reuse pool, and which
empties the reuse pools).
Usage: test_output_pool.py [--device cpu|cuda]   (exit 0 = pass)"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.dlpack import to_dlpack

import llep
from llep import _output_pool
from llep.utils import free_port

T, H, E, K = 8, 512, 8, 3
FP8 = getattr(torch, 'float8_e4m3fn', None) is not None


# ------------------------------------------------------------------------------------------------- the pool alone

def _make():
    return (torch.empty(64), None, torch.empty(4, dtype=torch.int32))


def _addresses_ok(got):
    """The addresses take() returned with a set are its tensors' data addresses (0 for None)."""
    tensors, addresses = got
    return addresses == [0 if t is None else t.data_ptr() for t in tensors]


def test_one_block():
    specs = (((2, 3, 4), (12, 4, 1), torch.bfloat16), None, ((2, 3, 5), (15, 1, 3), torch.float32),
             ((3,), (1,), torch.int64), ((0, 4), (4, 1), torch.int32))
    got = _output_pool.one_block(torch.empty(1), specs)
    assert got[1] is None
    block = got[0].untyped_storage() if hasattr(got[0], 'untyped_storage') else None
    spans = []
    for t, spec in zip(got, specs):
        if spec is None:
            continue
        assert (tuple(t.shape), t.stride(), t.dtype) == spec, f'{spec}: got {tuple(t.shape), t.stride(), t.dtype}'
        assert t._base is None, 'a view of the block: shares its version counter, has a base'
        if t.numel() == 0:
            continue  # torch reports address 0 for an empty tensor
        assert (t.data_ptr() - got[0].data_ptr()) % 256 == 0, 'each tensor starts 256 bytes apart from the block'
        if block is not None:
            assert t.untyped_storage().data_ptr() == block.data_ptr(), 'one allocation'
        spans.append((t.data_ptr(), t.data_ptr() + max(t.numel(), 1) * t.element_size()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), 'the tensors overlap'


class _FakeTensor:
    """What pool_counts / pool_take read of a tensor: _use_count(), _version; and its layout (_output_pool._layout)."""

    def __init__(self):
        self.use, self._version = 1, 0
        self.dtype, self.shape, self.requires_grad = 'f32', (4,), False

    def _use_count(self):
        return self.use

    def stride(self):
        return (1,)

    def storage_offset(self):
        return 0


class _FakeStorage:
    """What pool_counts / pool_take read of a storage: data_ptr() (its use count comes from the function it is
    given)."""

    def __init__(self, address):
        self.address, self.use = address, 1

    def data_ptr(self):
        return self.address


def test_pool_native():
    """_llep.pool_counts and pool_take on stand-in objects (any torch, CI's included): the baseline's layout, each
    count that holds a set, the walk over a key's sets and the free one moved last, a version that alone moved, the
    addresses, and bad arguments as errors."""
    from llep import _llep
    tensors = (_FakeTensor(), _FakeTensor())
    outputs = (tensors[0], None, tensors[1])
    storages = (_FakeStorage(4096), _FakeStorage(8192))
    cdatas = (11, 22)
    by_cdata = dict(zip(cdatas, storages))

    def storage_use_count(cdata):
        return by_cdata[cdata].use

    places = ((0, 256), None, (1, 0))
    base = _llep.pool_counts(tensors, storages, cdatas, storage_use_count)
    assert len(base) == 3 * 2 + 2 * 2 and base[1] == 1 and base[2] == 0 and base[7] == 1, base
    one = _output_pool._Set(outputs, tensors, storages, cdatas, base, places, ())
    sets = [one]

    def take():
        got = _llep.pool_take(sets, storage_use_count)
        assert got is None or type(got) is int or got[0] == list(outputs), got
        return got if got is None or type(got) is int else got[1]

    assert take() == [4352, 0, 8192]
    got = _llep.pool_take(sets, storage_use_count)  # the caller holds the outputs now
    assert take() is None, 'held by the list a take returned'
    del got
    assert take() == [4352, 0, 8192], 'free again'
    held = [tensors[1]]  # a reference: the tensor's refcount
    assert take() is None
    del held
    tensors[0].use = 2  # C++ holding the tensor
    assert take() is None
    tensors[0].use = 1
    storages[1].use = 3  # a view: the storage's use count
    assert take() is None
    storages[1].use = 1
    held = [storages[0]]  # the storage's Python object
    assert take() is None
    del held
    tensors[1]._version = 5  # written in place: the set's index, for the caller's layout check
    assert take() == 0
    tensors[1]._version = 0
    storages[0].address = 65536  # the storage moved (resize_): the addresses follow
    assert take() == [65792, 0, 8192]
    storages[0].address = 4096
    # A key's sets in order, the one handed out moved last; a held one skipped.
    t2 = (_FakeTensor(),)
    s2 = (_FakeStorage(1 << 20),)
    by_cdata[33] = s2[0]
    two = _output_pool._Set(t2, t2, s2, (33,), _llep.pool_counts(t2, s2, (33,), storage_use_count), ((0, 0),), ())
    sets.append(two)
    got = _llep.pool_take(sets, storage_use_count)
    assert got[1] == [4352, 0, 8192] and sets == [two, one], 'the first free set, then moved last'
    got2 = _llep.pool_take(sets, storage_use_count)
    assert got2[1] == [1 << 20] and sets == [one, two]
    assert _llep.pool_take(sets, storage_use_count) is None, 'both held'
    del got2
    assert _llep.pool_take(sets, storage_use_count)[1] == [1 << 20] and sets == [one, two], 'the held one skipped'
    del got
    assert _llep.pool_take([], storage_use_count) is None
    for bad in ((tuple(sets), storage_use_count),  # not a list
                ([one[:5]], storage_use_count),  # a field short
                ([list(one)], storage_use_count),  # not a tuple
                ([one._replace(baseline=base[:-1])], storage_use_count),  # not this set's baseline
                ([one._replace(baseline=('1',) * len(base))], storage_use_count),
                ([one._replace(places=((0, 'x'), None, (1, 0)))], storage_use_count),  # an offset not an int
                ([one._replace(places=((2, 0), None, (1, 0)))], storage_use_count),  # no storage 2
                ([one._replace(places=((0,), None, (1, 0)))], storage_use_count),  # not (storage, offset)
                ([one._replace(places=places[:2])], storage_use_count),  # a place per output
                ([one._replace(cdatas=cdatas[:1])], storage_use_count),  # a cdata per storage
                ([one], )):
        try:
            _llep.pool_take(*bad)
        except (TypeError, ValueError):
            continue
        raise AssertionError(f'pool_take{bad!r}: no error')
    for bad in ((None, storages, cdatas, storage_use_count), (tensors, storages, cdatas[:1], storage_use_count),
                (tensors, storages, cdatas)):
        try:
            _llep.pool_counts(*bad)
        except TypeError:
            continue
        raise AssertionError(f'pool_counts{bad!r}: no error')
    def fails(cdata):
        return 1 / 0

    for call in (lambda: _llep.pool_counts(tensors, storages, cdatas, fails), lambda: _llep.pool_take(sets, fails)):
        try:
            call()
        except ZeroDivisionError:
            pass
        else:
            raise AssertionError('an error of a count read was not raised')
    assert take() == [4352, 0, 8192], 'no reference left behind by the failed reads'
    # OutputPool.take settling a moved version: written in place (layout kept) -> the baseline follows and the set is
    # handed out; its layout changed in place -> the set is dropped and its room freed.
    layouts = tuple(_output_pool._layout(t) for t in tensors)
    pool = _output_pool.OutputPool(per_key=2, max_sets=3)
    pool._sets['k'], pool._count = [one._replace(layouts=layouts)], 1
    saved = _output_pool._storage_use_count
    _output_pool._storage_use_count = storage_use_count
    try:
        tensors[1]._version = 3
        got = pool.take('k')
        assert got is not None and got[1] == [4352, 0, 8192] and pool._sets['k'][0].baseline[5] == 3, 'mul_ settled'
        del got
        tensors[0]._version, tensors[0].shape = 1, (1, 4)
        assert pool.take('k') is None and len(pool) == 0 and pool._sets['k'] == [], 'unsqueeze_ settled: dropped'
    finally:
        _output_pool._storage_use_count = saved


def test_pool_alone():
    pool = _output_pool.OutputPool(per_key=2, max_sets=3)
    if not _output_pool.AVAILABLE:
        assert not (hasattr(torch._C, '_storage_Use_Count') and hasattr(torch.Tensor, '_use_count'))
        return  # nothing to pool with: the Buffer cases check that calls allocate
    assert pool.take('a') is None
    outs = _make()
    pool.adopt('a', outs)
    a, none, b = outs
    assert none is None and len(pool) == 1
    assert pool.take('a') is None, 'held by a and b'
    del a
    assert pool.take('a') is None, 'b still held'
    del b, outs
    got = pool.take('a')
    assert got is not None and got[0][1] is None and _addresses_ok(got)
    got = got[0]
    ptr = got[0].data_ptr()
    holders = {'tensor': lambda t: t, 'view': lambda t: t[1:], 'reshape': lambda t: t.view(8, 8),
               'storage': lambda t: t.untyped_storage(), 'dlpack': to_dlpack, 'list': lambda t: [t]}
    for name, hold in holders.items():
        x = got[0]
        del got
        held = hold(x)
        del x
        assert pool.take('a') is None, f'a {name} of the tensor is held'
        del held
        got = pool.take('a')
        assert got is not None and got[0][0].data_ptr() == ptr and _addresses_ok(got), \
            f'free again after the {name} went'
        got = got[0]
    # written in place and dropped: free again (the version moved, the layout did not)
    x = got[0]
    del got
    x.mul_(2)
    del x
    got = pool.take('a')
    assert got is not None and got[0][0].data_ptr() == ptr, 'a tensor written in place and dropped was not reused'
    got = got[0]
    # its layout changed in place and dropped: never handed out again, its room freed
    x = got[0]
    del got
    x.unsqueeze_(0)
    del x
    assert pool.take('a') is None and len(pool) == 0, 'a tensor reshaped in place came back'
    pool.adopt('a', _make())
    assert len(pool) == 1
    pool.clear()
    assert pool.take('b') is None, 'another key'
    # capacity: per key and in all
    pool.adopt('a', _make())
    pool.adopt('a', _make())
    assert not pool.has_room('a') and pool.has_room('b'), 'room: 2 sets per key, 3 in all'
    pool.adopt('a', _make())
    assert len(pool) == 2
    pool.adopt('b', _make())
    pool.adopt('c', _make())
    assert len(pool) == 3 and not pool.has_room('d')
    pool.clear()
    assert len(pool) == 0 and pool.take('a') is None
    # its storage grown (resize_ moves no version: the set may come back): never a stale address
    pool.adopt('a', _make())
    got = pool.take('a')
    x = got[0][0]
    del got
    x.resize_(1 << 16)
    grown = x.data_ptr()
    del x
    got = pool.take('a')
    assert got is None or (_addresses_ok(got) and got[1][0] == grown), 'a stale address after resize_'
    del got
    # one allocation for a set: a view of either tensor holds both
    blk = _output_pool.one_block(torch.empty(1), (((8,), (1,), torch.float32), ((4,), (1,), torch.int64)))
    pool.adopt('blk', blk)
    first, second = blk
    del blk
    view = second[1:]
    del first, second
    assert pool.take('blk') is None, 'a view of one tensor of the block is held'
    del view
    got = pool.take('blk')
    assert got is not None and _addresses_ok(got) and got[1][1] - got[1][0] == 256


# ------------------------------------------------------------------------------------------------- through a Buffer

def _inputs(seed, dev):
    g = torch.Generator().manual_seed(seed)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int64)
    x = torch.randn((T, H), generator=g).to(torch.bfloat16)
    w = torch.rand((T, K), generator=g).to(torch.float32)
    return x.to(dev), topk.to(dev), w.to(dev)


def _flat(res):
    """The dispatch's output tensors, in pool order."""
    recv, count, handle = res[0], res[1], res[2]
    recv_x, scales = recv if isinstance(recv, tuple) else (recv, None)
    return [t for t in (recv_x, scales, count, handle[0], handle[1]) if t is not None]


def _pooled_ptrs(buf):
    """The data addresses of each set the buffer's dispatch pool keeps."""
    return {tuple(t.data_ptr() for t in s.tensors if t is not None)
            for sets in buf._dispatch_pool._sets.values() for s in sets}


def _bits(t):
    """The tensor's bits as integers: rows past a count are never written and may hold NaN patterns (NaN != NaN), and
    torch.equal has no float8 kernel."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _sync(dev):
    if dev.type == 'cuda':
        torch.cuda.synchronize()


def _check_buffer(dev):
    pooled = _output_pool.AVAILABLE
    buf = llep.Buffer(dist.group.WORLD, num_rdma_bytes=llep.Buffer.get_low_latency_rdma_size_hint(T, H, 1, E),
                      low_latency_mode=True, explicitly_destroy=True)
    buf.backend = dev.type
    modes = [False] + ([True] if FP8 else [])
    for use_fp8 in modes:
        seed = 100 * use_fp8

        def dispatch(hook=False):
            nonlocal seed
            seed += 1
            x, topk, w = _inputs(seed, dev)
            return buf.low_latency_dispatch(x, topk, T, E, use_fp8=use_fp8, return_recv_hook=hook), (x, topk, w)

        dispatch()
        # (what is held, how, the tensors whose memory that keeps: with the pool the whole set stays out of use)
        for name, hold, kept in (('recv_x', lambda r: r[0][0] if use_fp8 else r[0], lambda r: [_flat(r)[0]]),
                                 ('recv_count', lambda r: r[1], lambda r: [r[1]]),
                                 ('handle', lambda r: r[2], lambda r: list(r[2][:2])),
                                 ('a view of layout_range', lambda r: r[2][1][1:], lambda r: [r[2][1]]),
                                 ('a DLPack capsule of src_info', lambda r: to_dlpack(r[2][0]), lambda r: [r[2][0]])):
            res, _ = dispatch()
            ptrs = [t.data_ptr() for t in (_flat(res) if pooled else kept(res))]
            assert not pooled or tuple(ptrs) in _pooled_ptrs(buf), f'{name}: every set free, yet none reused'
            assert not pooled or len({t.untyped_storage().data_ptr() for t in _flat(res)}) == 1, \
                'a pooled dispatch set is not one allocation'
            held = hold(res)
            del res
            # Later calls whose outputs are all kept: every other set is held too, so the pool's only choices are the
            # held set (wrong) and fresh memory.
            later = [dispatch()[0] for _ in range(3)]
            for r in later:
                assert not {t.data_ptr() for t in _flat(r)} & set(ptrs), f'{name} held: its set was handed out again'
            del later, held
        # what a caller holds keeps its values across later calls (other inputs each call)
        res, _ = dispatch()
        _sync(dev)
        keep = [t.clone() for t in _flat(res)]
        for _ in range(3):
            last, (x, topk, w) = dispatch()
        y = torch.randn((E, T, H)).to(torch.bfloat16).to(dev)
        buf.low_latency_combine(y, topk, w, last[2])  # the call order a pending hook below needs: ops alternate
        del last
        _sync(dev)
        for a, b in zip(_flat(res), keep):
            assert torch.equal(_bits(a), _bits(b)), 'a held output changed'
        del res, keep
        # a receive hook not run yet holds its set
        hooked, _ = dispatch(hook=True)
        hook, hooked_ptrs = hooked[4], [t.data_ptr() for t in _flat(hooked)]
        del hooked
        res, (x, topk, w) = dispatch()
        assert not {t.data_ptr() for t in _flat(res)} & set(hooked_ptrs), 'the set of an unrun hook was reused'
        hook()
        del hook
        # combine's out (an operation between the hook's receive and the next dispatch, as the call order needs):
        # reused once dropped, never while held
        out1 = buf.low_latency_combine(y, topk, w, res[2])[0]
        _sync(dev)
        p1, v1 = out1.data_ptr(), out1.clone()
        out2 = buf.low_latency_combine(y, topk, w, res[2])[0]
        _sync(dev)
        assert out2.data_ptr() != p1 and torch.equal(_bits(out1), _bits(v1)), 'a held combine output was reused'
        p2 = out2.data_ptr()
        del out1, out2
        out3 = buf.low_latency_combine(y, topk, w, res[2])[0]
        assert out3.data_ptr() in (p1, p2) or not pooled, 'combine out: not reused'
        del out3, res
    if dev.type == 'cuda' and pooled:  # a capture takes no free set, adopts nothing and lets go of the pools' sets
        x, topk, w = _inputs(7, dev)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            warm = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False)  # on the capture's stream: adopted
            free_ptrs = {t.data_ptr() for t in _flat(warm)}
            del warm
            torch.cuda.synchronize()
            assert len(buf._dispatch_pool) > 0 and len(buf._combine_pool) > 0
            with torch.cuda.graph(g, stream=s):
                captured = buf.low_latency_dispatch(x, topk, T, E, use_fp8=False)
        assert len(buf._dispatch_pool) == 0 and len(buf._combine_pool) == 0, \
            'a capture kept the eager outputs in the reuse pools, or adopted its own'
        assert not {t.data_ptr() for t in _flat(captured)} & free_ptrs, 'a capture took a set of the reuse pool'
        g.replay()
        torch.cuda.synchronize()
        del captured, g
    assert (buf._dispatch_pool is not None) == pooled
    buf.destroy()
    os.environ['LLEP_REUSE_OUTPUTS'] = '0'
    off = llep.Buffer(dist.group.WORLD, low_latency_mode=True, explicitly_destroy=True)
    assert off._dispatch_pool is None and off._combine_pool is None
    del os.environ['LLEP_REUSE_OUTPUTS']
    off.destroy()


def _worker(rank, port, device):
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1)
    try:
        _check_buffer(torch.device(device))
    finally:
        dist.destroy_process_group()


def _run(device):
    mp.spawn(_worker, args=(free_port(), device), nprocs=1, join=True)


def test_buffer_cpu():
    _run('cpu')


if __name__ == '__main__':
    ap = argparse.ArgumentParser()
    ap.add_argument('--device', default='cpu', choices=('cpu', 'cuda'))
    args = ap.parse_args()
    test_one_block()
    test_pool_native()
    test_pool_alone()
    _run(args.device)
    print(f'test_output_pool: PASS ({args.device}, pool {"on" if _output_pool.AVAILABLE else "off: torch lacks the counters"})')
    sys.exit(0)
