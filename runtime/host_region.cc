#include "runtime/host_region.h"

#include <sys/mman.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "runtime/base/status_macros.h"

namespace llep {

absl::StatusOr<HostRegion> HostRegion::Allocate(size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("empty region");
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return base::Annotate(base::ErrnoToStatus(errno, "mmap"), absl::StrCat(bytes, " bytes"));
  return HostRegion(static_cast<uint8_t*>(p), bytes);
}

HostRegion& HostRegion::operator=(HostRegion&& o) noexcept {
  if (this != &o) {
    if (data_ != nullptr) munmap(data_, bytes_);
    data_ = o.data_, bytes_ = o.bytes_;
    o.data_ = nullptr, o.bytes_ = 0;
  }
  return *this;
}

HostRegion::~HostRegion() {
  if (data_ != nullptr) munmap(data_, bytes_);
}

}  // namespace llep
