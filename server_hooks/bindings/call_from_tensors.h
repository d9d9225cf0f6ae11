// A combine whose tensors cross into C themselves (combine_tensors): their per-call checks (type, dtype, contiguity,
// device, shape) and data addresses read here instead of in Python, then the same CombineCall as `combine`. The
// reads are torch's own attribute getters and methods, looked up by name (the module still links no torch, so one
// build serves any torch); what this saves is the interpretation around them: a combine's Python layer took ~1.7 µs on
// the development machine of which ~0.7 were those reads (bench/RESULTS.md session 34). A failed check returns
// NotImplemented, and llep/buffer.py then runs its detailed checks, which raise the error that names the argument.
// Layer: server_hooks/bindings.
#pragma once

#include <Python.h>

#include <cstdint>

#include "server_hooks/bindings/call_from_addresses.h"

namespace llep::bindings {

/// What the checks compare with, built once per buffer layout by llep/buffer.py (Buffer._tensor_spec):
/// (torch.Tensor, torch.bfloat16, torch.float32, torch.int64, device index (-1 = CPU), E_loc, rows, hidden, ranks).
struct TensorSpec {
  PyObject* tensor_type;
  PyObject* bf16;
  PyObject* f32;
  PyObject* i64;
  long dev_index;
  long long e_loc, rows, hidden, ranks;
};

inline bool ReadTensorSpec(PyObject* o, TensorSpec* s) {
  if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 9 || !PyType_Check(PyTuple_GET_ITEM(o, 0))) {
    PyErr_SetString(PyExc_TypeError, "combine_tensors: spec must be Buffer._tensor_spec's 9-tuple");
    return false;
  }
  s->tensor_type = PyTuple_GET_ITEM(o, 0);
  s->bf16 = PyTuple_GET_ITEM(o, 1);
  s->f32 = PyTuple_GET_ITEM(o, 2);
  s->i64 = PyTuple_GET_ITEM(o, 3);
  s->dev_index = PyLong_AsLong(PyTuple_GET_ITEM(o, 4));
  s->e_loc = PyLong_AsLongLong(PyTuple_GET_ITEM(o, 5));
  s->rows = PyLong_AsLongLong(PyTuple_GET_ITEM(o, 6));
  s->hidden = PyLong_AsLongLong(PyTuple_GET_ITEM(o, 7));
  s->ranks = PyLong_AsLongLong(PyTuple_GET_ITEM(o, 8));
  return !PyErr_Occurred();
}

/// The outcome of reading one tensor: its check passed (the address is set), failed (no Python error), or torch raised.
enum class TensorRead { kOk, kMismatch, kRaised };

/// `r`, an int-valued call or attribute result (a new reference or null), as long long; kRaised with the error set when
/// it is not one.
inline TensorRead AsLongLong(PyObject* r, long long* out) {
  if (r == nullptr) return TensorRead::kRaised;
  *out = PyLong_AsLongLong(r);
  Py_DECREF(r);
  return *out == -1 && PyErr_Occurred() ? TensorRead::kRaised : TensorRead::kOk;
}

/// The shape of `t` (torch.Size, a tuple) equal to `want` (ndim entries)?
inline TensorRead ShapeIs(PyObject* t, const long long* want, Py_ssize_t ndim) {
  static PyObject* const shape_name = PyUnicode_InternFromString("shape");
  PyObject* s = PyObject_GetAttr(t, shape_name);
  if (s == nullptr) return TensorRead::kRaised;
  TensorRead r = PyTuple_Check(s) && PyTuple_GET_SIZE(s) == ndim ? TensorRead::kOk : TensorRead::kMismatch;
  for (Py_ssize_t i = 0; r == TensorRead::kOk && i < ndim; ++i) {
    const long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(s, i));
    if (v == -1 && PyErr_Occurred()) {
      r = TensorRead::kRaised;
    } else if (v != want[i]) {
      r = TensorRead::kMismatch;
    }
  }
  Py_DECREF(s);
  return r;
}

/// The data address of `t`.
inline TensorRead DataPtr(PyObject* t, uintptr_t* addr) {
  static PyObject* const data_ptr_name = PyUnicode_InternFromString("data_ptr");
  long long v = 0;
  const TensorRead r = AsLongLong(PyObject_CallMethodNoArgs(t, data_ptr_name), &v);
  *addr = static_cast<uintptr_t>(v);
  return r;
}

/// llep/buffer.py's _fast_ok (a torch.Tensor of `dtype`, contiguous, on the spec's device) and the shape, then the
/// data address: the same reads in the same order.
inline TensorRead ReadTensor(PyObject* t, const TensorSpec& s, PyObject* dtype, const long long* shape, Py_ssize_t ndim,
                             uintptr_t* addr) {
  static PyObject* const dtype_name = PyUnicode_InternFromString("dtype");
  static PyObject* const contiguous_name = PyUnicode_InternFromString("is_contiguous");
  static PyObject* const get_device_name = PyUnicode_InternFromString("get_device");
  static PyObject* const is_cpu_name = PyUnicode_InternFromString("is_cpu");
  if (!PyObject_TypeCheck(t, reinterpret_cast<PyTypeObject*>(s.tensor_type))) return TensorRead::kMismatch;
  PyObject* d = PyObject_GetAttr(t, dtype_name);
  if (d == nullptr) return TensorRead::kRaised;
  Py_DECREF(d);  // dtypes are singletons: identity is the comparison
  if (d != dtype) return TensorRead::kMismatch;
  PyObject* c = PyObject_CallMethodNoArgs(t, contiguous_name);
  if (c == nullptr) return TensorRead::kRaised;
  Py_DECREF(c);
  if (c != Py_True) return TensorRead::kMismatch;
  long long dev = 0;
  if (AsLongLong(PyObject_CallMethodNoArgs(t, get_device_name), &dev) != TensorRead::kOk) return TensorRead::kRaised;
  if (dev != s.dev_index) return TensorRead::kMismatch;
  if (s.dev_index < 0) {  // get_device() is -1 for CPU and meta tensors alike
    PyObject* cpu = PyObject_GetAttr(t, is_cpu_name);
    if (cpu == nullptr) return TensorRead::kRaised;
    Py_DECREF(cpu);
    if (cpu != Py_True) return TensorRead::kMismatch;
  }
  const TensorRead r = ShapeIs(t, shape, ndim);
  return r == TensorRead::kOk ? DataPtr(t, addr) : r;
}

inline constexpr const char* kCombineTensorsArgNames[] = {
    "x",          "zero_copy", "topk_idx",       "topk_weights", "layout_range", "out",
    "wait_stats", "plan_key",  "expert_reduced", "split",        "stream",       "spec"};

/// combine_tensors(x, zero_copy, topk_idx, topk_weights, layout_range, out, wait_stats, plan_key, expert_reduced,
/// split, stream, spec): `combine` with the tensors themselves. topk_idx and layout_range must be the handle's
/// dispatch's own (llep/buffer.py checked them there and compares identities and topk_idx's version): only their shape
/// (topk_idx, 2-D) and addresses are read. x (unless zero_copy), topk_weights, out and wait_stats (or None) are
/// checked as the Python layer does. Returns the pending operation (or None) as `combine` does, NotImplemented when a
/// check failed (nothing queued).
template <typename Holder>
PyObject* FastCombineTensors(PyObject* self, PyObject* const* args, Py_ssize_t n) {
  return Guarded([&]() -> PyObject* {
    if (n != 12) {
      PyErr_Format(PyExc_TypeError, "combine_tensors() takes 12 positional arguments (%zd given)", n);
      return nullptr;
    }
    TensorSpec s{};
    if (!ReadTensorSpec(args[11], &s)) return nullptr;
    // The scalar arguments, with `combine`'s typed errors: zero_copy (argument 2), then arguments 8-11.
    uintptr_t plan_key = 0, stream = 0;
    bool zero_copy = false, expert_reduced = false, split = false;
    FastArgs flag("combine_tensors", kCombineTensorsArgNames + 1, args + 1, 1, 1);
    FastArgs rest("combine_tensors", kCombineTensorsArgNames + 7, args + 7, 4, 7);
    if (!(flag.Bool(&zero_copy) && rest.Address(&plan_key) && rest.Bool(&expert_reduced) && rest.Bool(&split) &&
          rest.Address(&stream))) {
      return nullptr;
    }
    PyObject* const x = args[0];
    PyObject* const topk = args[2];
    PyObject* const weights = args[3];
    PyObject* const layout_range = args[4];
    PyObject* const out = args[5];
    PyObject* const wait = args[6];
    uintptr_t x_addr = 0, topk_addr = 0, weights_addr = 0, range_addr = 0, out_addr = 0, wait_addr = 0;
    // topk_idx: the dispatch's (its dtype, contiguity and device checked there); its shape is read again here.
    static PyObject* const shape_name = PyUnicode_InternFromString("shape");
    long long topk_shape[2] = {0, 0};
    {
      PyObject* ts = PyObject_GetAttr(topk, shape_name);
      if (ts == nullptr) return nullptr;
      const bool two_d = PyTuple_Check(ts) && PyTuple_GET_SIZE(ts) == 2;
      if (two_d) {
        topk_shape[0] = PyLong_AsLongLong(PyTuple_GET_ITEM(ts, 0));
        topk_shape[1] = PyLong_AsLongLong(PyTuple_GET_ITEM(ts, 1));
      }
      Py_DECREF(ts);
      if (PyErr_Occurred()) return nullptr;
      if (!two_d) Py_RETURN_NOTIMPLEMENTED;
    }
    const long long x_shape[3] = {s.e_loc, s.rows, s.hidden};
    const long long out_shape[2] = {topk_shape[0], s.hidden};
    const long long wait_shape[1] = {s.ranks};
    TensorRead r = ReadTensor(weights, s, s.f32, topk_shape, 2, &weights_addr);
    if (r == TensorRead::kOk && !zero_copy) r = ReadTensor(x, s, s.bf16, x_shape, 3, &x_addr);
    if (r == TensorRead::kOk) r = ReadTensor(out, s, s.bf16, out_shape, 2, &out_addr);
    if (r == TensorRead::kOk && wait != Py_None) r = ReadTensor(wait, s, s.i64, wait_shape, 1, &wait_addr);
    if (r == TensorRead::kOk) r = DataPtr(topk, &topk_addr);
    if (r == TensorRead::kOk) r = DataPtr(layout_range, &range_addr);
    if (r == TensorRead::kRaised) return nullptr;
    if (r == TensorRead::kMismatch) Py_RETURN_NOTIMPLEMENTED;
    if (topk_shape[0] > INT32_MAX || topk_shape[1] > INT32_MAX) Py_RETURN_NOTIMPLEMENTED;
    Holder& h = pybind11::cast<Holder&>(pybind11::handle(self));
    return h
        .Combine(CombineCallFromAddresses(x_addr, zero_copy, topk_addr, weights_addr, static_cast<int>(topk_shape[0]),
                                          static_cast<int>(topk_shape[1]), range_addr, out_addr, wait_addr, plan_key,
                                          expert_reduced),
                 split, stream)
        .release()
        .ptr();
  });
}

}  // namespace llep::bindings
