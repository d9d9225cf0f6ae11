// GPU vs reference codec, bit for bit: the hardware e4m3 conversion (cvt.rn.satfinite) against FloatToE4m3 on
// every e4m3 midpoint and millions of random floats, and the dispatch kernel's own FP8 encoder (EncodeFp8x16 of
// ll_routing.cuh, the function the dispatch send phase calls, lanes laid out as it lays them out) against the CPU
// backend's EncodeDispatchPayload, with and without round_scale. Skips when no CUDA device is present. On AMD
// (LLEP_GPU=hip) only the second test exists: there is no e4m3fn conversion instruction to check, the encoder computes
// codes with the codec's own arithmetic (kernels/HIP_PORT.md).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/codec/fp8.h"
#include "kernels/cuda/gpu_test_support.h"
#include "kernels/cuda/ll_routing.cuh"
#include "kernels/host/ll_host.h"
#include "runtime/protocol/gpu_api.h"
#include "runtime/protocol/gpu_port.h"

namespace llep::kernels::cuda {
namespace {

#if defined(LLEP_GPU_CUDA)
__global__ void ConvertKernel(const float* in, uint8_t* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (2 * i + 1 < n) {
    const __nv_fp8x2_storage_t v =
        __nv_cvt_float2_to_fp8x2(make_float2(in[2 * i], in[2 * i + 1]), __NV_SATFINITE, __NV_E4M3);
    out[2 * i] = static_cast<uint8_t>(v & 0xFF);
    out[2 * i + 1] = static_cast<uint8_t>(v >> 8);
  }
}

TEST(CudaCodecTest, HardwareE4m3MatchesReference) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  std::vector<float> in;
  for (int c = 0; c < 0x7E; ++c) {  // every midpoint between neighbouring codes, and one ulp either side
    const float mid = (E4m3ToFloat(static_cast<uint8_t>(c)) + E4m3ToFloat(static_cast<uint8_t>(c + 1))) / 2;
    for (float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      in.push_back(v);
      in.push_back(-v);
    }
  }
  for (float v : {448.0f, 464.0f, 1e30f, INFINITY, -INFINITY, 0.0f, -0.0f, 1e-30f}) in.push_back(v);
  for (uint32_t nan_bits : {0x7FC00000u, 0xFFC00000u, 0x7F810000u, 0xFF810000u, 0x7FFFFFFFu}) {
    in.push_back(BitsToFloat(nan_bits));  // quiet and signalling NaNs of both signs
  }
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-14, 10);
  while (in.size() < (1u << 22)) in.push_back((rng() & 1 ? -1.0f : 1.0f) * std::ldexp(mant(rng), expo(rng)));
  const int n = static_cast<int>(in.size());
  float* d_in = nullptr;
  uint8_t* d_out = nullptr;
  ASSERT_CUDA(cudaMalloc(&d_in, n * sizeof(float)));
  ASSERT_CUDA(cudaMalloc(&d_out, n));
  ASSERT_CUDA(cudaMemcpy(d_in, in.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  ConvertKernel<<<(n / 2 + 255) / 256, 256>>>(d_in, d_out, n);
  ASSERT_CUDA(cudaGetLastError());
  std::vector<uint8_t> out(n);
  ASSERT_CUDA(cudaMemcpy(out.data(), d_out, n, cudaMemcpyDeviceToHost));
  int mismatches = 0;
  for (int i = 0; i < n && mismatches < 10; ++i) {
    if (out[i] != FloatToE4m3(in[i])) {
      ++mismatches;
      ADD_FAILURE() << "x = " << in[i] << ": gpu 0x" << std::hex << int(out[i]) << ", reference 0x"
                    << int(FloatToE4m3(in[i]));
    }
  }
  (void)cudaFree(d_in);
  (void)cudaFree(d_out);
}
#endif  // LLEP_GPU_CUDA

// The dispatch send phase's lane layout: a warp encodes one kChunk of a token, lane l channels [16 l, 16 l + 16)
// of it, 8 lanes per 128-channel group. Codes go where the payload has them; lane 0 of each group writes its scale.
__global__ void EncodeChunksKernel(const uint16_t* x, int H, bool round_scale, uint8_t* codes, float* scales) {
  const int t = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const uint16_t* xr = x + static_cast<int64_t>(t) * H;
  for (int ch = warp; ch * kChunk < H; ch += warps) {
    const int c0 = ch * kChunk + lane * 16;
    uint4 a{}, b{};
    if (c0 < H) a = Ld16(xr + c0), b = Ld16(xr + c0 + 8);
    float scale_inv = 0.0f;
    const uint4 code = EncodeFp8x16(a, b, round_scale, &scale_inv);  // whole warp: its shuffles need every lane
    if (c0 >= H) continue;
    *reinterpret_cast<uint4*>(codes + static_cast<int64_t>(t) * H + c0) = code;
    if (lane % 8 == 0) scales[static_cast<int64_t>(t) * (H / 128) + c0 / 128] = scale_inv;
  }
}

TEST(CudaCodecTest, DispatchEncoderMatchesHostEncoder) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  for (const int H : {7168, 2048 + 128}) {  // 2176: the last chunk is partly past H
    const int T = 64;
    std::mt19937 rng(4);
    static constexpr float kAmp[] = {0.0f, 1e-6f, 3e-3f, 0.1f, 1.0f, 7.5f, 300.0f, 2e4f};
    std::vector<uint16_t> x(static_cast<size_t>(T) * H);
    for (int t = 0; t < T; ++t) {
      for (int g = 0; g < H / 128; ++g) {
        const float amp = kAmp[rng() % 8];
        for (int c = 0; c < 128; ++c) {
          x[t * H + g * 128 + c] = FloatToBf16(std::uniform_real_distribution<float>(-amp, amp)(rng));
        }
      }
    }
    // Special values in a few tokens: signalling/quiet NaNs of both signs, infinities, subnormals. The amax must
    // ignore every NaN on both sides (GPU max.f32, host MaxIgnoringNan).
    const uint16_t specials[] = {0x7F81, 0xFF81, 0x7FC1, 0xFFC1, 0x7F80, 0xFF80, 0x0001, 0x8001, 0x0080};
    for (int t = 0; t < 4; ++t) {
      for (int i = 0; i < 9; ++i) x[static_cast<size_t>(t) * H + (t * 131 + i * 37) % H] = specials[(i + t) % 9];
    }
    uint16_t* d_x = nullptr;
    uint8_t* d_codes = nullptr;
    float* d_scales = nullptr;
    ASSERT_CUDA(cudaMalloc(&d_x, x.size() * 2));
    ASSERT_CUDA(cudaMalloc(&d_codes, x.size()));
    ASSERT_CUDA(cudaMalloc(&d_scales, x.size() / 128 * sizeof(float)));
    ASSERT_CUDA(cudaMemcpy(d_x, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
    for (const bool round_scale : {false, true}) {
      ASSERT_CUDA(cudaMemset(d_codes, 0xCD, x.size()));  // poison: every byte must be written
      ASSERT_CUDA(cudaMemset(d_scales, 0xCD, x.size() / 128 * sizeof(float)));
      EncodeChunksKernel<<<T, 4 * 32>>>(d_x, H, round_scale, d_codes, d_scales);
      ASSERT_CUDA(cudaGetLastError());
      ASSERT_CUDA(cudaDeviceSynchronize());
      std::vector<uint8_t> codes(x.size());
      std::vector<float> scales(x.size() / 128);
      ASSERT_CUDA(cudaMemcpy(codes.data(), d_codes, codes.size(), cudaMemcpyDeviceToHost));
      ASSERT_CUDA(cudaMemcpy(scales.data(), d_scales, scales.size() * sizeof(float), cudaMemcpyDeviceToHost));
      const protocol::DispatchMode mode{true, round_scale, false};
      std::vector<uint8_t> want(protocol::DispatchPayloadBytes(H, true));
      for (int t = 0; t < T; ++t) {
        EncodeDispatchPayload(&x[static_cast<size_t>(t) * H], H, mode, want.data());
        ASSERT_EQ(std::memcmp(codes.data() + static_cast<size_t>(t) * H, want.data(), H), 0)
            << "codes of token " << t << " H=" << H << " round_scale=" << round_scale;
        ASSERT_EQ(std::memcmp(scales.data() + static_cast<size_t>(t) * (H / 128),
                              want.data() + protocol::Fp8ScalesOffset(H), H / 128 * sizeof(float)),
                  0)
            << "scales of token " << t << " H=" << H << " round_scale=" << round_scale;
      }
    }
    (void)cudaFree(d_x);
    (void)cudaFree(d_codes);
    (void)cudaFree(d_scales);
  }
}

}  // namespace
}  // namespace llep::kernels::cuda
