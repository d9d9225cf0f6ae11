// Page-aligned, zero-filled host memory for a rank's LL region (mmap: lazily committed, so the large combine
// staging costs only what a run touches). Zero fill matters: a zero signal word means "no call yet".
// Layer: runtime. Move-only owner.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"

namespace llep {

class HostRegion {
 public:
  static absl::StatusOr<HostRegion> Allocate(size_t bytes);
  HostRegion() = default;
  HostRegion(HostRegion&& o) noexcept : data_(o.data_), bytes_(o.bytes_) { o.data_ = nullptr, o.bytes_ = 0; }
  HostRegion& operator=(HostRegion&& o) noexcept;
  ~HostRegion();

  uint8_t* data() const { return data_; }
  size_t size() const { return bytes_; }
  /// Forgets the mapping without unmapping it, for memory a wedged proxy thread may still touch (proxy.h Stop).
  void Abandon() { data_ = nullptr, bytes_ = 0; }

 private:
  HostRegion(uint8_t* data, size_t bytes) : data_(data), bytes_(bytes) {}
  uint8_t* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace llep
