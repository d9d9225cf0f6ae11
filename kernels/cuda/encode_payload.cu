// GPU payload encoder. Warp roles: every warp encodes 128-channel groups of one token (one lane per 4
// channels, a warp-wide max for the group's amax); the scale arithmetic is kernels/codec/fp8.h's, and the
// e4m3 conversion is the hardware's cvt.rn.satfinite, which tests compare bit for bit with FloatToE4m3().
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/codec/fp8.h"
#include "kernels/cuda/encode_payload.h"
#include "runtime/protocol/dispatch_msg.h"
#include "runtime/protocol/signal.h"

namespace llep::kernels::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kChannelsPerLane = protocol::kChannelsPerScale / 32;
static_assert(kChannelsPerLane == 4, "one 8-byte load of four bf16 per lane covers a 128-channel group");

__global__ void __launch_bounds__(kWarpsPerBlock * 32) EncodePayloadsKernel(EncodePayloadArgs a) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int t = blockIdx.x;
  const int H = a.layout.shape.hidden, num_groups = H / protocol::kChannelsPerScale;
  const int half = protocol::HalfOfSeq(a.seq);
  uint8_t* payload = a.region + a.layout.DispatchPayloadOffset(half, t, a.mode.use_fp8);
  const uint16_t* x = a.x + static_cast<int64_t>(t) * H;

  for (int g = warp; g < num_groups; g += kWarpsPerBlock) {
    const int c0 = g * protocol::kChannelsPerScale + lane * kChannelsPerLane;
    const uint2 raw = *reinterpret_cast<const uint2*>(x + c0);
    if (!a.mode.use_fp8) {
      *reinterpret_cast<uint2*>(payload + static_cast<int64_t>(c0) * 2) = raw;
      continue;
    }
    float v[kChannelsPerLane];
    v[0] = Bf16ToFloat(static_cast<uint16_t>(raw.x & 0xFFFF));
    v[1] = Bf16ToFloat(static_cast<uint16_t>(raw.x >> 16));
    v[2] = Bf16ToFloat(static_cast<uint16_t>(raw.y & 0xFFFF));
    v[3] = Bf16ToFloat(static_cast<uint16_t>(raw.y >> 16));
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    for (int m = 16; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, m));
    const Fp8Scale s = ComputeFp8Scale(amax, a.mode.round_scale);
    const __nv_fp8x2_storage_t lo =
        __nv_cvt_float2_to_fp8x2(make_float2(v[0] * s.scale, v[1] * s.scale), __NV_SATFINITE, __NV_E4M3);
    const __nv_fp8x2_storage_t hi =
        __nv_cvt_float2_to_fp8x2(make_float2(v[2] * s.scale, v[3] * s.scale), __NV_SATFINITE, __NV_E4M3);
    *reinterpret_cast<uint32_t*>(payload + c0) = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    if (lane == 0) reinterpret_cast<float*>(payload + protocol::Fp8ScalesOffset(H))[g] = s.scale_inv;
  }
}

}  // namespace

cudaError_t LaunchEncodePayloads(const EncodePayloadArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  EncodePayloadsKernel<<<args.num_tokens, kWarpsPerBlock * 32, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace llep::kernels::cuda
