// DefCallMethods: the per-call methods of a bound buffer class (dispatch, combine, combine_tensors: METH_FASTCALL
// descriptors) and its other calls (rank masking, recovery) through pybind11. Layer: server_hooks/bindings.
#pragma once

#include <pybind11/pybind11.h>

#include "server_hooks/bindings/call_from_addresses.h"
#include "server_hooks/bindings/call_from_tensors.h"

namespace llep::bindings {

/// Defines `dispatch`, `combine` and `combine_tensors` on a buffer binding whose Holder has
///   pybind11::object Dispatch(const DispatchCall&, bool split, uintptr_t stream)
///   pybind11::object Combine(const CombineCall&, bool split, uintptr_t stream)
/// (the pending operation when split, the hook's; else None), as METH_FASTCALL method descriptors (FastArgs: the
/// per-decode-step crossing), and the buffer's other calls through pybind11. The positional order is llep/buffer.py's.
template <typename Holder, typename Class>
void DefCallMethods(Class& cls) {
  static PyMethodDef dispatch_def = {"dispatch",
                                     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&FastDispatch<Holder>)),
                                     METH_FASTCALL, "Queues a dispatch (positional, see FastDispatch)."};
  static PyMethodDef combine_def = {"combine",
                                    reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&FastCombine<Holder>)),
                                    METH_FASTCALL, "Queues a combine (positional, see FastCombine)."};
  static PyMethodDef combine_tensors_def = {
      "combine_tensors", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&FastCombineTensors<Holder>)),
      METH_FASTCALL, "Queues a combine given its tensors (positional, see FastCombineTensors)."};
  auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
  for (PyMethodDef* def : {&dispatch_def, &combine_def, &combine_tensors_def}) {
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
