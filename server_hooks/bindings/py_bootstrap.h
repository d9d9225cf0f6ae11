// A Bootstrap whose allgather is a Python callable (torch.distributed.all_gather_object from llep/buffer.py).
// Layer: server_hooks/bindings. Shared by the CPU and GPU buffer bindings.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "runtime/bootstrap.h"

namespace llep::bindings {

/// The callback runs on the calling thread, which must hold the GIL while the buffer is created.
std::unique_ptr<Bootstrap> MakePythonBootstrap(int rank, int size, pybind11::function allgather);

}  // namespace llep::bindings
