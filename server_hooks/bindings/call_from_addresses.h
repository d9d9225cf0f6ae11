// The one native entry point of a call: DispatchCall / CombineCall (runtime/protocol/ll_call.h) built from the
// integer addresses llep/buffer.py passes (tensors never cross as torch objects), bound once for both backends
// (DefCallMethods), so their dispatch / combine methods take the same arguments (the CPU backend ignores the stream
// handle) and llep/buffer.py has one call path. Layer: server_hooks/bindings.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>

#include "runtime/protocol/ll_call.h"

namespace llep::bindings {

template <typename T>
T* Ptr(uintptr_t addr) {
  return reinterpret_cast<T*>(addr);
}

inline DispatchCall DispatchCallFromAddresses(uintptr_t x, uintptr_t topk, std::optional<uintptr_t> weights,
                                              int num_tokens, int num_topk, bool use_fp8, bool round_scale,
                                              bool use_ue8m0, uintptr_t recv_x, uintptr_t recv_scales,
                                              uintptr_t recv_count, uintptr_t src_info, uintptr_t layout_range,
                                              uintptr_t cumulative_stats, uintptr_t wait_stats, int layer,
                                              uint64_t plan_key) {
  DispatchCall c;
  c.layer = layer;
  c.plan_key = plan_key;
  c.x = Ptr<const uint16_t>(x);
  c.topk_idx = Ptr<const int64_t>(topk);
  // None: no combine_weights; an address (0 for an empty batch's tensor): the call carries them.
  c.topk_weights = Ptr<const float>(weights.value_or(0));
  c.carries_weights = weights.has_value();
  c.num_tokens = num_tokens;
  c.num_topk = num_topk;
  c.mode = {use_fp8, round_scale, use_ue8m0};
  c.recv_x = Ptr<void>(recv_x);
  c.recv_scales = Ptr<void>(recv_scales);
  c.recv_count = Ptr<int32_t>(recv_count);
  c.src_info = Ptr<int32_t>(src_info);
  c.layout_range = Ptr<int64_t>(layout_range);
  c.cumulative_local_expert_recv_stats = Ptr<int32_t>(cumulative_stats);
  c.wait_recv_cost_stats = Ptr<int64_t>(wait_stats);
  return c;
}

inline CombineCall CombineCallFromAddresses(uintptr_t x, bool zero_copy, uintptr_t topk, uintptr_t weights,
                                            int num_tokens, int num_topk, uintptr_t layout_range, uintptr_t out,
                                            uintptr_t wait_stats, uint64_t plan_key, bool expert_reduced) {
  CombineCall c;
  c.plan_key = plan_key;
  c.expert_reduced = expert_reduced;
  c.x = Ptr<const uint16_t>(x);
  c.zero_copy = zero_copy;
  c.topk_idx = Ptr<const int64_t>(topk);
  c.topk_weights = Ptr<const float>(weights);
  c.num_tokens = num_tokens;
  c.num_topk = num_topk;
  c.layout_range = Ptr<const int64_t>(layout_range);
  c.out = Ptr<uint16_t>(out);
  c.wait_recv_cost_stats = Ptr<int64_t>(wait_stats);
  return c;
}

/// The arguments of a native call, read straight from Python's vector of arguments (METH_FASTCALL | METH_KEYWORDS).
/// llep/buffer.py names every one (`runtime.combine(x=..., topk_idx=..., out=...)`) with the names of the fields they
/// fill (DispatchCall / CombineCall, runtime/protocol/ll_call.h), so a reader follows an argument from the Python call
/// to the kernel by its name; a positional prefix is accepted too (the benchmarks' direct calls). The order is fixed:
/// argument i is names[i], positional or keyword. A call site's keyword names are the interned strings of its code
/// object, so each is checked by one pointer compare against the interned name (a string compare only when not
/// interned). Named, a CPU-backend combine's native call took 0.00-0.06 µs more than positional (5.07-5.25 vs
/// 5.02-5.21 µs, bench/crossing_cost.py; the interpreter specializes only keyword-free calls of a method descriptor;
/// bench/RESULTS.md session 63).
/// pybind11's generic path (overload dispatch, an argument vector on the heap, a caster per argument) cost a dispatch's
/// 19 arguments ~0.25 µs more (session 32), on every decode step. Each
/// reader takes the next argument; on a wrong type or name it sets a TypeError that names the argument and returns
/// false.
class FastArgs {
 public:
  /// `interned`: the names as interned Python strings (InternNames), same length as `names`.
  FastArgs(const char* method, const char* const* names, PyObject* const* interned, PyObject* const* args, Py_ssize_t n,
           PyObject* kwnames)
      : method_(method), names_(names), interned_(interned), args_(args), n_(n), kwnames_(kwnames) {}

  /// Whether there are exactly `want` arguments, each keyword one in its place (else the TypeError).
  bool Count(Py_ssize_t want) {
    const Py_ssize_t nk = kwnames_ != nullptr ? PyTuple_GET_SIZE(kwnames_) : 0;
    if (n_ + nk != want) {
      PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", method_, want, n_ + nk);
      return false;
    }
    for (Py_ssize_t k = 0; k < nk; ++k) {
      PyObject* got = PyTuple_GET_ITEM(kwnames_, k);
      PyObject* expected = interned_[n_ + k];
      if (got != expected && PyUnicode_Compare(got, expected) != 0) {
        if (PyErr_Occurred()) return false;
        PyErr_Format(PyExc_TypeError, "%s() argument %zd must be '%s', got keyword '%U'", method_, n_ + k + 1,
                     names_[n_ + k], got);
        return false;
      }
    }
    return true;
  }
  /// An int in [0, 2^64): an address, a stream handle, a plan key.
  bool Address(uintptr_t* out) {
    PyObject* o = Next();
    const unsigned long long v = PyLong_Check(o) ? PyLong_AsUnsignedLongLong(o) : 0;
    if (!PyLong_Check(o) || (v == static_cast<unsigned long long>(-1) && PyErr_Occurred())) return Fail("an int >= 0");
    *out = static_cast<uintptr_t>(v);
    return true;
  }
  bool OptionalAddress(std::optional<uintptr_t>* out) {
    if (args_[i_] == Py_None) {
      ++i_;
      out->reset();
      return true;
    }
    uintptr_t v = 0;
    if (!Address(&v)) return false;
    *out = v;
    return true;
  }
  bool Int(int* out) {
    PyObject* o = Next();
    long v = 0;
    int overflow = 0;
    if (PyLong_Check(o)) {
      v = PyLong_AsLongAndOverflow(o, &overflow);
    } else {  // an integer type of another library (numpy.int64): its __index__, as Python's range() takes it
      PyObject* i = PyNumber_Index(o);
      if (i == nullptr) return Fail("an int");
      v = PyLong_AsLongAndOverflow(i, &overflow);
      Py_DECREF(i);
    }
    if (overflow != 0 || v < INT32_MIN || v > INT32_MAX || (v == -1 && PyErr_Occurred())) {
      return Fail("an int in the int32 range");
    }
    *out = static_cast<int>(v);
    return true;
  }
  bool Bool(bool* out) {
    PyObject* o = Next();
    if (o == Py_True || o == Py_False) {
      *out = o == Py_True;
      return true;
    }
    const int t = PyObject_IsTrue(o);  // numpy.bool_, 0 / 1: truth as the Python layer's `if` reads it
    if (t < 0) return Fail("a bool");
    *out = t != 0;
    return true;
  }

 private:
  PyObject* Next() { return args_[i_++]; }
  bool Fail(const char* what) {
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "%s() argument %zd (%s) must be %s, got %s", method_, i_, names_[i_ - 1], what,
                 Py_TYPE(args_[i_ - 1])->tp_name);
    return false;
  }

  const char* method_;
  const char* const* names_;
  PyObject* const* interned_;
  PyObject* const* args_;
  Py_ssize_t n_;  ///< positional arguments; the keyword ones follow them in args_
  PyObject* kwnames_;
  Py_ssize_t i_ = 0;
};

/// Runs a fast method's body, turning a C++ exception into the Python one (the status errors of ThrowIfError arrive
/// as error_already_set); nullptr = raised.
template <typename Body>
PyObject* Guarded(Body&& body) {
  try {
    return body();
  } catch (pybind11::error_already_set& e) {
    e.restore();
  } catch (const pybind11::builtin_exception& e) {
    e.set_error();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

/// The arguments' names, in order: DispatchCall's / CombineCall's fields they fill (combine_weights: the Python
/// keyword of DispatchCall::topk_weights; use_fp8, round_scale, use_ue8m0: DispatchMode), then the launch's split
/// (a hook: send and receive apart) and stream.
inline constexpr const char* kDispatchArgNames[] = {"x",
                                                    "topk_idx",
                                                    "combine_weights",
                                                    "num_tokens",
                                                    "num_topk",
                                                    "use_fp8",
                                                    "round_scale",
                                                    "use_ue8m0",
                                                    "recv_x",
                                                    "recv_scales",
                                                    "recv_count",
                                                    "src_info",
                                                    "layout_range",
                                                    "cumulative_local_expert_recv_stats",
                                                    "wait_recv_cost_stats",
                                                    "layer",
                                                    "plan_key",
                                                    "split",
                                                    "stream"};
inline constexpr const char* kCombineArgNames[] = {"x",
                                                   "zero_copy",
                                                   "topk_idx",
                                                   "topk_weights",
                                                   "num_tokens",
                                                   "num_topk",
                                                   "layout_range",
                                                   "out",
                                                   "wait_recv_cost_stats",
                                                   "plan_key",
                                                   "expert_reduced",
                                                   "split",
                                                   "stream"};

/// The names as interned Python strings, made once for the process (FastArgs compares a call's keyword names with
/// them by pointer). Needs the GIL.
template <size_t N>
PyObject* const* InternNames(const char* const (&names)[N]) {
  auto* out = new PyObject*[N];  // lives as long as the module's methods
  for (size_t i = 0; i < N; ++i) {
    out[i] = PyUnicode_InternFromString(names[i]);
    if (out[i] == nullptr) throw pybind11::error_already_set();
  }
  return out;
}

/// dispatch(x, topk_idx, combine_weights (address or None), num_tokens, num_topk, use_fp8, round_scale, use_ue8m0,
/// recv_x, recv_scales, recv_count, src_info, layout_range, cumulative_local_expert_recv_stats, wait_recv_cost_stats,
/// layer, plan_key, split, stream), by keyword (FastArgs): addresses are ints (0 = none), the stream a raw handle.
template <typename Holder>
PyObject* FastDispatch(PyObject* self, PyObject* const* args, Py_ssize_t n, PyObject* kwnames) {
  return Guarded([&]() -> PyObject* {
    static PyObject* const* const interned = InternNames(kDispatchArgNames);
    FastArgs a("dispatch", kDispatchArgNames, interned, args, n, kwnames);
    uintptr_t x, topk, recv_x, recv_scales, recv_count, src_info, layout_range, cumulative, wait, stream, plan_key;
    std::optional<uintptr_t> weights;
    int num_tokens, num_topk, layer;
    bool use_fp8, round_scale, use_ue8m0, split;
    if (!(a.Count(19) && a.Address(&x) && a.Address(&topk) && a.OptionalAddress(&weights) && a.Int(&num_tokens) &&
          a.Int(&num_topk) && a.Bool(&use_fp8) && a.Bool(&round_scale) && a.Bool(&use_ue8m0) && a.Address(&recv_x) &&
          a.Address(&recv_scales) && a.Address(&recv_count) && a.Address(&src_info) && a.Address(&layout_range) &&
          a.Address(&cumulative) && a.Address(&wait) && a.Int(&layer) && a.Address(&plan_key) && a.Bool(&split) &&
          a.Address(&stream))) {
      return nullptr;
    }
    Holder& h = pybind11::cast<Holder&>(pybind11::handle(self));
    return h
        .Dispatch(DispatchCallFromAddresses(x, topk, weights, num_tokens, num_topk, use_fp8, round_scale, use_ue8m0,
                                            recv_x, recv_scales, recv_count, src_info, layout_range, cumulative, wait,
                                            layer, plan_key),
                  split, stream)
        .release()
        .ptr();
  });
}

/// combine(x, zero_copy, topk_idx, topk_weights, num_tokens, num_topk, layout_range, out, wait_recv_cost_stats,
/// plan_key, expert_reduced, split, stream), by keyword (FastArgs).
template <typename Holder>
PyObject* FastCombine(PyObject* self, PyObject* const* args, Py_ssize_t n, PyObject* kwnames) {
  return Guarded([&]() -> PyObject* {
    static PyObject* const* const interned = InternNames(kCombineArgNames);
    FastArgs a("combine", kCombineArgNames, interned, args, n, kwnames);
    uintptr_t x, topk, weights, layout_range, out, wait, stream, plan_key;
    int num_tokens, num_topk;
    bool zero_copy, expert_reduced, split;
    if (!(a.Count(13) && a.Address(&x) && a.Bool(&zero_copy) && a.Address(&topk) && a.Address(&weights) &&
          a.Int(&num_tokens) && a.Int(&num_topk) && a.Address(&layout_range) && a.Address(&out) && a.Address(&wait) &&
          a.Address(&plan_key) && a.Bool(&expert_reduced) && a.Bool(&split) && a.Address(&stream))) {
      return nullptr;
    }
    Holder& h = pybind11::cast<Holder&>(pybind11::handle(self));
    return h
        .Combine(CombineCallFromAddresses(x, zero_copy, topk, weights, num_tokens, num_topk, layout_range, out, wait,
                                          plan_key, expert_reduced),
                 split, stream)
        .release()
        .ptr();
  });
}

/// Defines `dispatch` and `combine` on a buffer binding whose Holder has
///   pybind11::object Dispatch(const DispatchCall&, bool split, uintptr_t stream)
///   pybind11::object Combine(const CombineCall&, bool split, uintptr_t stream)
/// (the pending operation when split, the hook's; else None), as METH_FASTCALL | METH_KEYWORDS method descriptors
/// (FastArgs: the per-decode-step crossing), and the buffer's other calls through pybind11.
template <typename Holder, typename Class>
void DefCallMethods(Class& cls) {
  static PyMethodDef dispatch_def = {
      "dispatch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&FastDispatch<Holder>)),
      METH_FASTCALL | METH_KEYWORDS, "Queues a dispatch (arguments named as DispatchCall's fields, see FastDispatch)."};
  static PyMethodDef combine_def = {
      "combine", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&FastCombine<Holder>)),
      METH_FASTCALL | METH_KEYWORDS, "Queues a combine (arguments named as CombineCall's fields, see FastCombine)."};
  auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
  for (PyMethodDef* def : {&dispatch_def, &combine_def}) {
    PyObject* descr = PyDescr_NewMethod(type, def);
    if (descr == nullptr) throw pybind11::error_already_set();
    cls.attr(def->ml_name) = pybind11::reinterpret_steal<pybind11::object>(descr);
  }
  // Rank masking and recovery (DeepEP's enable_shrink API and clean_low_latency_buffer); `mask_out` is the address
  // of an int32 [num_ranks] tensor on the backend's device.
  cls.def("clean", [](Holder& h, uintptr_t stream) { h.Clean(stream); });
  cls.def("set_masked", [](Holder& h, int rank, bool masked, uintptr_t stream) { h.SetMasked(rank, masked, stream); });
  cls.def("query_masks", [](Holder& h, uintptr_t mask_out, uintptr_t stream) { h.QueryMasks(mask_out, stream); });
  cls.def("clear_masks", [](Holder& h, uintptr_t stream) { h.ClearMasks(stream); });
}

}  // namespace llep::bindings
