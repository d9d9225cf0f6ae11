// absl::Status -> typed Python exceptions (llep.LlepError and subclasses, all RuntimeError; invalid arguments
// are also ValueError, timeouts also TimeoutError, so DeepEP-era callers catching RuntimeError still work).
// Layer: server_hooks/bindings (the only pybind11 code).
#pragma once

#include <pybind11/pybind11.h>

#include "absl/status/status.h"

namespace llep::bindings {

/// Creates the exception classes on `m` (LlepError, LlepInvalidArgumentError, LlepTimeoutError, ...).
void RegisterExceptions(pybind11::module_& m);

/// Throws the Python exception for a non-OK status (sets .code to the absl code name).
void ThrowIfError(const absl::Status& s);

}  // namespace llep::bindings
