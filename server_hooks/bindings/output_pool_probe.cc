// llep._llep.pool_counts / pool_take: the output pool's count reads (llep/_output_pool.py), in C.
//
// Why native: a set is free when its tensors' and storages' counts equal their values right after it was made; the
// Python loop that read them (a refcount, two torch calls per tensor, two per storage, then the data pointer) cost a
// dispatch ~3.5 µs of host time on an H100 host (bench/RESULTS.md session 33), most of it interpreting the loop. The
// calls are the same here (the tensors' own `_use_count()`, `_version`, the storage's `data_ptr()` and torch's
// storage use-count function, looked up by name: the module still does not link torch), without the interpreter.
// Refcounts read here count no reference of a caller's local (a Python loop's variable would), so the baseline
// comes from this function too. pool_take also walks a key's sets, hands the free one out and moves it last, the
// walk and its lock that were Python frames around every pooled call (bench/RESULTS.md session 64).
#include <Python.h>
#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>

namespace llep::bindings {
namespace {

/// The most storages one set has (a set's tensors share one allocation, or each has its own: at most five).
constexpr Py_ssize_t kMaxStorages = 8;

/// A Python int as int64 (refcounts, use counts, versions, addresses); -1 with an error set if it is none.
int64_t AsI64(PyObject* o) {
  if (o == nullptr) return -1;
  const long long v = PyLong_AsLongLong(o);
  Py_DECREF(o);
  return v;
}

int64_t MethodI64(PyObject* obj, PyObject* name) { return AsI64(PyObject_CallMethodNoArgs(obj, name)); }

PyObject* UseCountName() {
  static PyObject* const name = PyUnicode_InternFromString("_use_count");
  return name;
}
PyObject* VersionName() {
  static PyObject* const name = PyUnicode_InternFromString("_version");
  return name;
}
PyObject* DataPtrName() {
  static PyObject* const name = PyUnicode_InternFromString("data_ptr");
  return name;
}

/// Whether storages and cdatas are tuples of one length of at most kMaxStorages.
bool StoragesOk(PyObject* storages, PyObject* cdatas) {
  return PyTuple_Check(storages) && PyTuple_Check(cdatas) && PyTuple_GET_SIZE(storages) == PyTuple_GET_SIZE(cdatas) &&
         PyTuple_GET_SIZE(storages) <= kMaxStorages;
}

/// pool_counts(tensors, storages, cdatas, storage_use_count): a set's baseline, the tuple (refcount, use count,
/// version) per tensor, then (refcount, use count) per storage. tensors: tuple of the set's tensors (no None);
/// storages: tuple of their distinct storages' Python objects, cdatas: the storages' StorageImpl addresses (ints),
/// storage_use_count: torch._C._storage_Use_Count.
PyObject* PoolCounts(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 4 || !PyTuple_Check(args[0]) || !StoragesOk(args[1], args[2])) {
    PyErr_SetString(PyExc_TypeError, "pool_counts(tensors: tuple, storages: tuple, cdatas: tuple, storage_use_count)");
    return nullptr;
  }
  PyObject* const tensors = args[0];
  PyObject* const storages = args[1];
  PyObject* const cdatas = args[2];
  const Py_ssize_t nt = PyTuple_GET_SIZE(tensors), ns = PyTuple_GET_SIZE(storages);
  PyObject* out = PyTuple_New(3 * nt + 2 * ns);
  if (out == nullptr) return nullptr;
  Py_ssize_t k = 0;
  const auto put = [&](int64_t v) {
    if (v == -1 && PyErr_Occurred()) return false;
    PyTuple_SET_ITEM(out, k++, PyLong_FromLongLong(v));
    return true;
  };
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < nt; ++i) {
    PyObject* t = PyTuple_GET_ITEM(tensors, i);
    ok = put(Py_REFCNT(t)) && put(MethodI64(t, UseCountName())) && put(AsI64(PyObject_GetAttr(t, VersionName())));
  }
  for (Py_ssize_t i = 0; ok && i < ns; ++i) {
    ok = put(Py_REFCNT(PyTuple_GET_ITEM(storages, i))) &&
         put(AsI64(PyObject_CallOneArg(args[3], PyTuple_GET_ITEM(cdatas, i))));
  }
  if (!ok) {
    Py_DECREF(out);  // its unset items are null, which a tuple's deallocation skips
    return nullptr;
  }
  return out;
}

/// The fields of one set as the pool keeps it (llep/_output_pool.py _Set, a tuple): the outputs (None where a mode
/// has none), the live tensors, storages, cdatas and baseline as above, and each output's place: None (address 0)
/// or (storage index, byte offset).
struct SetView {
  PyObject* outputs;
  PyObject* live;
  PyObject* storages;
  PyObject* cdatas;
  PyObject* baseline;
  PyObject* places;
};
constexpr Py_ssize_t kSetFields = 6;

/// rec's fields, or false with a ValueError set when rec is not a set as the pool makes them.
bool ViewSet(PyObject* rec, SetView* v) {
  if (!PyTuple_Check(rec) || PyTuple_GET_SIZE(rec) < kSetFields) {
    PyErr_SetString(PyExc_ValueError, "pool_take: a set is not the pool's tuple");
    return false;
  }
  *v = SetView{PyTuple_GET_ITEM(rec, 0), PyTuple_GET_ITEM(rec, 1), PyTuple_GET_ITEM(rec, 2),
               PyTuple_GET_ITEM(rec, 3), PyTuple_GET_ITEM(rec, 4), PyTuple_GET_ITEM(rec, 5)};
  bool ok = PyTuple_Check(v->outputs) && PyTuple_Check(v->live) && StoragesOk(v->storages, v->cdatas) &&
            PyTuple_Check(v->baseline) && PyTuple_Check(v->places) &&
            PyTuple_GET_SIZE(v->places) == PyTuple_GET_SIZE(v->outputs) &&
            PyTuple_GET_SIZE(v->baseline) == 3 * PyTuple_GET_SIZE(v->live) + 2 * PyTuple_GET_SIZE(v->storages);
  for (Py_ssize_t k = 0; ok && k < PyTuple_GET_SIZE(v->baseline); ++k) {
    ok = PyLong_Check(PyTuple_GET_ITEM(v->baseline, k));
  }
  if (!ok) {
    PyErr_SetString(PyExc_ValueError, "pool_take: a set's fields are not the pool's (or its baseline not its own)");
  }
  return ok;
}

enum class Probe { kHeld, kMoved, kFree, kError };

/// Compares a set's counts with its baseline, each tensor holding `extra` references more than it (the caller's
/// reservation). kFree fills at[] with each storage's data pointer (a resize_ may have moved it); kMoved: only a
/// tensor's version differs (the caller checks its layout).
Probe ProbeSet(const SetView& v, PyObject* storage_use_count, Py_ssize_t extra, std::array<int64_t, kMaxStorages>* at) {
  const Py_ssize_t nt = PyTuple_GET_SIZE(v.live), ns = PyTuple_GET_SIZE(v.storages);
  const auto base = [&](Py_ssize_t k) { return PyLong_AsLongLong(PyTuple_GET_ITEM(v.baseline, k)); };
  bool moved = false;
  for (Py_ssize_t i = 0; i < nt; ++i) {
    PyObject* t = PyTuple_GET_ITEM(v.live, i);
    if (Py_REFCNT(t) != base(3 * i) + extra) return Probe::kHeld;
    const int64_t use = MethodI64(t, UseCountName());
    if (use == -1 && PyErr_Occurred()) return Probe::kError;
    if (use != base(3 * i + 1)) return Probe::kHeld;
    const int64_t version = AsI64(PyObject_GetAttr(t, VersionName()));
    if (version == -1 && PyErr_Occurred()) return Probe::kError;
    moved |= version != base(3 * i + 2);
  }
  for (Py_ssize_t i = 0; i < ns; ++i) {
    if (Py_REFCNT(PyTuple_GET_ITEM(v.storages, i)) != base(3 * nt + 2 * i)) return Probe::kHeld;
    const int64_t use = AsI64(PyObject_CallOneArg(storage_use_count, PyTuple_GET_ITEM(v.cdatas, i)));
    if (use == -1 && PyErr_Occurred()) return Probe::kError;
    if (use != base(3 * nt + 2 * i + 1)) return Probe::kHeld;
  }
  if (moved) return Probe::kMoved;
  for (Py_ssize_t i = 0; i < ns; ++i) {
    (*at)[static_cast<size_t>(i)] = MethodI64(PyTuple_GET_ITEM(v.storages, i), DataPtrName());
    if ((*at)[static_cast<size_t>(i)] == -1 && PyErr_Occurred()) return Probe::kError;
  }
  return Probe::kFree;
}

/// (list of the outputs, list of their data addresses) of a free set; null with an error set.
PyObject* HandOut(const SetView& v, const std::array<int64_t, kMaxStorages>& at) {
  const Py_ssize_t np = PyTuple_GET_SIZE(v.places), ns = PyTuple_GET_SIZE(v.storages);
  PyObject* outputs = PyList_New(np);
  PyObject* addresses = outputs != nullptr ? PyList_New(np) : nullptr;
  if (addresses == nullptr) {
    Py_XDECREF(outputs);
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < np; ++i) {
    PyObject* p = PyTuple_GET_ITEM(v.places, i);
    int64_t address = 0;
    if (p != Py_None) {
      const Py_ssize_t si =
          PyTuple_Check(p) && PyTuple_GET_SIZE(p) == 2 ? PyLong_AsSsize_t(PyTuple_GET_ITEM(p, 0)) : Py_ssize_t{-1};
      if (si < 0 || si >= ns) {
        Py_DECREF(outputs);
        Py_DECREF(addresses);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "pool_take: a place is not (storage, offset)");
        return nullptr;
      }
      address = at[static_cast<size_t>(si)] + PyLong_AsLongLong(PyTuple_GET_ITEM(p, 1));
    }
    PyObject* o = PyTuple_GET_ITEM(v.outputs, i);
    Py_INCREF(o);
    PyList_SET_ITEM(outputs, i, o);
    PyList_SET_ITEM(addresses, i, PyLong_FromLongLong(address));
  }
  if (PyErr_Occurred()) {  // an offset that was not an int
    Py_DECREF(outputs);
    Py_DECREF(addresses);
    return nullptr;
  }
  PyObject* pair = PyTuple_New(2);
  if (pair == nullptr) {
    Py_DECREF(outputs);
    Py_DECREF(addresses);
    return nullptr;
  }
  PyTuple_SET_ITEM(pair, 0, outputs);
  PyTuple_SET_ITEM(pair, 1, addresses);
  return pair;
}

/// Moves rec to the end of the list sets, where the next take tries it last (a caller holding the newest outputs,
/// a handle until its combine, finds a free set first). Found by identity: a call during the probe may have let
/// another thread change the list. Nothing here can run Python code.
void MoveLast(PyObject* sets, PyObject* rec) {
  const Py_ssize_t n = PyList_GET_SIZE(sets);
  PyObject** items = PySequence_Fast_ITEMS(sets);
  for (Py_ssize_t j = 0; j + 1 < n; ++j) {
    if (items[j] != rec) continue;
    for (Py_ssize_t k = j; k + 1 < n; ++k) items[k] = items[k + 1];
    items[n - 1] = rec;
    return;
  }
}

/// pool_take(sets: list, storage_use_count): the first set of `sets` (the pool's sets of one key) that only the pool
/// holds: (list of its outputs, list of their data addresses), the set moved to the end of `sets`; None when every
/// set is held; or the index (int) of the first set free but for a tensor's version (every in-place op moves it): the
/// caller checks that tensor's layout, then takes again.
/// No lock: before reading a set's counts this reserves it, one reference more on each of its tensors, so a take
/// by another thread meanwhile (a torch call below may let one run) sees it held; two such takes at once both see
/// it held and make fresh sets. The reservation then passes to the caller or is dropped.
PyObject* PoolTake(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 2 || !PyList_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "pool_take(sets: list, storage_use_count)");
    return nullptr;
  }
  PyObject* const sets = args[0];
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(sets); ++i) {
    PyObject* const rec = PyList_GET_ITEM(sets, i);
    SetView v;
    if (!ViewSet(rec, &v)) return nullptr;
    Py_INCREF(rec);  // its fields stay valid whatever the list becomes
    const Py_ssize_t nt = PyTuple_GET_SIZE(v.live);
    for (Py_ssize_t k = 0; k < nt; ++k) Py_INCREF(PyTuple_GET_ITEM(v.live, k));
    std::array<int64_t, kMaxStorages> at{};
    const Probe got = ProbeSet(v, args[1], 1, &at);
    PyObject* result = nullptr;
    if (got == Probe::kFree) {
      result = HandOut(v, at);
      if (result != nullptr) MoveLast(sets, rec);
    } else if (got == Probe::kMoved) {
      result = PyLong_FromSsize_t(i);
    }
    for (Py_ssize_t k = 0; k < nt; ++k) Py_DECREF(PyTuple_GET_ITEM(v.live, k));
    Py_DECREF(rec);
    if (got == Probe::kHeld) continue;
    return result;  // null for kError (and for a hand-out that failed): the error is set
  }
  Py_RETURN_NONE;
}

PyMethodDef g_pool_counts = {"pool_counts", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&PoolCounts)),
                             METH_FASTCALL,
                             "The output pool's baseline counts of one set (llep/_output_pool.py; see "
                             "server_hooks/bindings/output_pool_probe.cc)."};
PyMethodDef g_pool_take = {"pool_take", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&PoolTake)),
                           METH_FASTCALL,
                           "The output pool's take of a free set of one key (llep/_output_pool.py; see "
                           "server_hooks/bindings/output_pool_probe.cc)."};

void AddFunction(pybind11::module_& m, PyMethodDef* def) {
  PyObject* f = PyCFunction_NewEx(def, nullptr, m.attr("__name__").ptr());
  if (f == nullptr) throw pybind11::error_already_set();
  m.attr(def->ml_name) = pybind11::reinterpret_steal<pybind11::object>(f);
}

}  // namespace

void BindOutputPoolProbe(pybind11::module_& m) {
  AddFunction(m, &g_pool_counts);
  AddFunction(m, &g_pool_take);
}

}  // namespace llep::bindings
