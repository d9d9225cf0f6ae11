#include "server_hooks/bindings/py_bootstrap.h"

#include <string>
#include <vector>

namespace llep::bindings {
namespace py = pybind11;

std::unique_ptr<Bootstrap> MakePythonBootstrap(int rank, int size, py::function allgather) {
  return MakeCallbackBootstrap(rank, size,
                               [allgather](const std::string& blob) -> absl::StatusOr<std::vector<std::string>> {
                                 py::gil_scoped_acquire gil;
                                 try {
                                   py::list out = allgather(py::bytes(blob));
                                   std::vector<std::string> all;
                                   for (py::handle h : out) all.push_back(h.cast<std::string>());
                                   return all;
                                 } catch (const std::exception& e) {
                                   return absl::UnavailableError(std::string("allgather callback raised: ") + e.what());
                                 }
                               });
}

}  // namespace llep::bindings
