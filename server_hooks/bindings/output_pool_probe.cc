// llep._llep.pool_probe: the output pool's per-call read of a set's counts (llep/_output_pool.py _Set), in C.
//
// Why native: a set is free when its tensors' and storages' counts equal their values right after it was made; the
// Python loop that read them (a refcount, two torch calls per tensor, two per storage, then the data pointer) cost a
// dispatch ~3.5 µs of host time on an H100 host (bench/RESULTS.md session 33), most of it interpreting the loop. The
// calls are the same here (the tensors' own `_use_count()`, `_version`, the storage's `data_ptr()` and torch's
// storage use-count function, looked up by name: the module still does not link torch), without the interpreter.
// Refcounts read here count no reference of a caller's local (a Python loop's variable would), so the baseline
// comes from this function too.
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

/// pool_probe(tensors, storages, cdatas, storage_use_count, baseline, places):
///   tensors: tuple of the set's tensors (no None); storages: tuple of their distinct storages' Python objects,
///   cdatas: the storages' StorageImpl addresses (ints), storage_use_count: torch._C._storage_Use_Count.
///   baseline None: returns the counts, a tuple (refcount, use count, version) per tensor, then (refcount, use count)
///   per storage.
///   baseline a tuple as returned before, and places a tuple with per output slot None (address 0) or
///   (storage index, byte offset): returns None if a refcount or use count differs (something holds the set), the
///   index (int) of the first tensor whose version alone moved (the caller checks its layout), else the list of the
///   slots' data addresses (each storage's data pointer read once).
PyObject* PoolProbe(PyObject*, PyObject* const* args, Py_ssize_t n) {
  static PyObject* const use_count_name = PyUnicode_InternFromString("_use_count");
  static PyObject* const version_name = PyUnicode_InternFromString("_version");
  static PyObject* const data_ptr_name = PyUnicode_InternFromString("data_ptr");
  if (n != 6 || !PyTuple_Check(args[0]) || !PyTuple_Check(args[1]) || !PyTuple_Check(args[2]) ||
      PyTuple_GET_SIZE(args[1]) != PyTuple_GET_SIZE(args[2]) || PyTuple_GET_SIZE(args[1]) > kMaxStorages ||
      (args[4] != Py_None && !PyTuple_Check(args[4])) || (args[4] != Py_None && !PyTuple_Check(args[5]))) {
    PyErr_SetString(PyExc_TypeError,
                    "pool_probe(tensors: tuple, storages: tuple, cdatas: tuple, storage_use_count, baseline: tuple | "
                    "None, places: tuple)");
    return nullptr;
  }
  PyObject* const tensors = args[0];
  PyObject* const storages = args[1];
  PyObject* const cdatas = args[2];
  PyObject* const storage_use_count = args[3];
  const Py_ssize_t nt = PyTuple_GET_SIZE(tensors), ns = PyTuple_GET_SIZE(storages);
  const Py_ssize_t num_counts = 3 * nt + 2 * ns;
  if (args[4] == Py_None) {  // the baseline
    PyObject* out = PyTuple_New(num_counts);
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
      ok = put(Py_REFCNT(t)) && put(MethodI64(t, use_count_name)) && put(AsI64(PyObject_GetAttr(t, version_name)));
    }
    for (Py_ssize_t i = 0; ok && i < ns; ++i) {
      ok = put(Py_REFCNT(PyTuple_GET_ITEM(storages, i))) &&
           put(AsI64(PyObject_CallOneArg(storage_use_count, PyTuple_GET_ITEM(cdatas, i))));
    }
    if (!ok) {
      Py_DECREF(out);  // its unset items are null, which a tuple's deallocation skips
      return nullptr;
    }
    return out;
  }
  PyObject* const baseline = args[4];
  PyObject* const places = args[5];
  bool baseline_ok = PyTuple_GET_SIZE(baseline) == num_counts;
  for (Py_ssize_t k = 0; baseline_ok && k < num_counts; ++k) baseline_ok = PyLong_Check(PyTuple_GET_ITEM(baseline, k));
  if (!baseline_ok) {
    PyErr_SetString(PyExc_ValueError, "pool_probe: the baseline is not this set's");
    return nullptr;
  }
  const auto base = [&](Py_ssize_t k) { return PyLong_AsLongLong(PyTuple_GET_ITEM(baseline, k)); };
  Py_ssize_t moved = -1;  // the first tensor whose version alone differs
  for (Py_ssize_t i = 0; i < nt; ++i) {
    PyObject* t = PyTuple_GET_ITEM(tensors, i);
    if (Py_REFCNT(t) != base(3 * i)) Py_RETURN_NONE;
    const int64_t use = MethodI64(t, use_count_name);
    if (use == -1 && PyErr_Occurred()) return nullptr;
    if (use != base(3 * i + 1)) Py_RETURN_NONE;
    const int64_t version = AsI64(PyObject_GetAttr(t, version_name));
    if (version == -1 && PyErr_Occurred()) return nullptr;
    if (moved < 0 && version != base(3 * i + 2)) moved = i;
  }
  std::array<int64_t, kMaxStorages> at{};
  for (Py_ssize_t i = 0; i < ns; ++i) {
    PyObject* st = PyTuple_GET_ITEM(storages, i);
    if (Py_REFCNT(st) != base(3 * nt + 2 * i)) Py_RETURN_NONE;
    const int64_t use = AsI64(PyObject_CallOneArg(storage_use_count, PyTuple_GET_ITEM(cdatas, i)));
    if (use == -1 && PyErr_Occurred()) return nullptr;
    if (use != base(3 * nt + 2 * i + 1)) Py_RETURN_NONE;
  }
  if (moved >= 0) return PyLong_FromSsize_t(moved);
  for (Py_ssize_t i = 0; i < ns; ++i) {
    at[static_cast<size_t>(i)] = MethodI64(PyTuple_GET_ITEM(storages, i), data_ptr_name);
    if (at[static_cast<size_t>(i)] == -1 && PyErr_Occurred()) return nullptr;
  }
  const Py_ssize_t np = PyTuple_GET_SIZE(places);
  PyObject* out = PyList_New(np);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < np; ++i) {
    PyObject* p = PyTuple_GET_ITEM(places, i);
    int64_t address = 0;
    if (p != Py_None) {
      const Py_ssize_t si =
          PyTuple_Check(p) && PyTuple_GET_SIZE(p) == 2 ? PyLong_AsSsize_t(PyTuple_GET_ITEM(p, 0)) : Py_ssize_t{-1};
      if (si < 0 || si >= ns) {
        Py_DECREF(out);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "pool_probe: a place is not (storage, offset)");
        return nullptr;
      }
      address = at[static_cast<size_t>(si)] + PyLong_AsLongLong(PyTuple_GET_ITEM(p, 1));
    }
    PyList_SET_ITEM(out, i, PyLong_FromLongLong(address));
  }
  if (PyErr_Occurred()) {  // an offset that was not an int
    Py_DECREF(out);
    return nullptr;
  }
  return out;
}

PyMethodDef g_pool_probe = {"pool_probe", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&PoolProbe)),
                            METH_FASTCALL,
                            "The output pool's count read of one set (llep/_output_pool.py; see "
                            "server_hooks/bindings/output_pool_probe.cc)."};

}  // namespace

void BindOutputPoolProbe(pybind11::module_& m) {
  PyObject* f = PyCFunction_NewEx(&g_pool_probe, nullptr, m.attr("__name__").ptr());
  if (f == nullptr) throw pybind11::error_already_set();
  m.attr("pool_probe") = pybind11::reinterpret_steal<pybind11::object>(f);
}

}  // namespace llep::bindings
