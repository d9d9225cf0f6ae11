#include "proxy/arrival_counter.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "runtime/protocol/signal.h"
#include "runtime/protocol/sys_order.h"

namespace llep::proxy {

using protocol::LlOp;

ArrivalCounter::ArrivalCounter(const protocol::LlLayout& layout, uint8_t* region)
    : layout_(layout),
      region_(region),
      keys_(static_cast<size_t>(protocol::kNumLlOps) * protocol::kNumHalves * layout.shape.num_ranks) {}

ArrivalCounter::Key& ArrivalCounter::At(LlOp op, int half, int src) {
  const size_t idx = (static_cast<size_t>(op) * protocol::kNumHalves + half) * layout_.shape.num_ranks + src;
  return keys_[idx];
}

int ArrivalCounter::NumPending() const {
  int n = 0;
  for (const Key& k : keys_) n += k.signal_seen ? 1 : 0;
  return n;
}

void ArrivalCounter::MaybePublish(Key& key, LlOp op, int half, int src) {
  if (!key.signal_seen || key.arrived != key.announced) return;
  // Pairs with the acquire load in the receive phase (runtime/cpu_buffer.cc WaitForSignals): all data whose
  // completions we counted is visible before the word is.
  protocol::StoreReleaseSys(reinterpret_cast<uint64_t*>(region_ + layout_.SignalOffset(half, op, src)),
                            key.signal_word);
  key = Key{};
}

absl::Status ArrivalCounter::OnImmediate(uint32_t imm) {
  protocol::ImmFields f{};
  if (!protocol::UnpackImm(imm, &f)) return absl::DataLossError(absl::StrCat("malformed immediate 0x", absl::Hex(imm)));
  if (f.src_rank >= layout_.shape.num_ranks) {
    return absl::DataLossError(absl::StrCat("immediate from unknown rank ", f.src_rank));
  }
  Key& key = At(f.op, f.half, f.src_rank);
  if (f.kind == protocol::ImmKind::kData) {
    ++key.arrived;
  } else {
    if (key.signal_seen) {
      return absl::InternalError(absl::StrCat("second signal from rank ", f.src_rank, " before the first completed"));
    }
    // The completion implies the slot's bytes are visible (libfabric/verbs semantics); the fence keeps the
    // compiler and CPU from hoisting the reads above the completion we just consumed.
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    protocol::InboxSlot slot;
    std::memcpy(&slot, region_ + layout_.InboxOffset(f.half, f.op, f.src_rank), sizeof(slot));
    if (slot.version != protocol::kSignalVersion) {
      return absl::DataLossError(absl::StrCat("inbox slot from rank ", f.src_rank, " has version ", slot.version));
    }
    key.signal_seen = true;
    key.announced = slot.num_data_writes;
    key.signal_word = slot.signal_word;
  }
  if (key.signal_seen && key.arrived > key.announced) {
    return absl::InternalError(
        absl::StrCat("rank ", f.src_rank, " delivered ", key.arrived, " data writes but announced ", key.announced));
  }
  MaybePublish(key, f.op, f.half, f.src_rank);
  return absl::OkStatus();
}

}  // namespace llep::proxy
