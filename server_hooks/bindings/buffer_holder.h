// What the CPU and the GPU buffer bindings share: the bootstrap that must outlive the buffer, collective
// creation through a Python allgather, the "destroyed" check, collective close without the GIL, and the
// layout queries. Layer: server_hooks/bindings.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "runtime/bootstrap.h"
#include "runtime/protocol/ll_shape.h"
#include "server_hooks/bindings/py_bootstrap.h"
#include "server_hooks/bindings/status_to_python.h"

namespace llep::bindings {

/// Buffer: CpuBuffer or GpuBuffer (static Create(shape, bootstrap, options), Close(), layout(),
/// combine_buffer_row_stride()).
template <typename Buffer>
class BufferHolder {
 public:
  /// Collective: every rank of the group must call it (and Close) in the same order.
  void Close() {
    if (!buffer_) return;
    absl::Status s;
    {
      pybind11::gil_scoped_release nogil;
      s = buffer_->Close();
    }
    buffer_.reset();
    ThrowIfError(s);
  }
  int64_t combine_row_stride() { return Live()->combine_buffer_row_stride(); }
  int64_t buffer_bytes() { return Live()->layout().total_bytes; }

 protected:
  /// Runs on the constructing thread, which holds the GIL: the allgather callback needs it.
  template <typename Options>
  void Create(const protocol::LlShape& shape, int rank, pybind11::function allgather, const Options& options) {
    bootstrap_ = MakePythonBootstrap(rank, shape.num_ranks, std::move(allgather));
    auto buf = Buffer::Create(shape, *bootstrap_, options);
    ThrowIfError(buf.status());
    buffer_ = *std::move(buf);
  }
  Buffer* Live() {
    if (!buffer_) ThrowIfError(absl::FailedPreconditionError("buffer was destroyed"));
    return buffer_.get();
  }

 private:
  std::unique_ptr<Bootstrap> bootstrap_;
  std::unique_ptr<Buffer> buffer_;  // declared last: destroyed before the bootstrap it uses
};

}  // namespace llep::bindings
