// GPU vs reference codec, bit for bit: the hardware e4m3 conversion (cvt.rn.satfinite) against FloatToE4m3 on
// every e4m3 midpoint and millions of random floats, and the payload encoder kernel against
// EncodeDispatchPayload in FP8, FP8 round_scale and BF16 modes. Skips when no CUDA device is present.
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/codec/fp8.h"
#include "kernels/cuda/encode_payload.h"
#include "kernels/host/ll_host.h"

namespace llep::kernels::cuda {
namespace {

#define ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << cudaGetErrorString(expr)

bool HaveDevice() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

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
  cudaFree(d_in);
  cudaFree(d_out);
}

TEST(CudaCodecTest, EncoderKernelMatchesHostEncoder) {
  if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  const protocol::LlShape shape{64, 7168, 16, 4};
  const protocol::LlLayout layout = protocol::ComputeLlLayout(shape);
  const int T = shape.max_tokens_per_rank, H = shape.hidden;
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
  uint8_t* d_region = nullptr;
  ASSERT_CUDA(cudaMalloc(&d_x, x.size() * 2));
  ASSERT_CUDA(cudaMalloc(&d_region, layout.total_bytes));
  ASSERT_CUDA(cudaMemcpy(d_x, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  for (const protocol::DispatchMode mode :
       {protocol::DispatchMode{true, false, false}, protocol::DispatchMode{true, true, false},
        protocol::DispatchMode{false, false, false}}) {
    for (uint32_t seq : {1u, 2u}) {
      ASSERT_CUDA(cudaMemset(d_region, 0xCD, layout.total_bytes));  // poison: every byte must be written
      EncodePayloadArgs a;
      a.layout = layout;
      a.mode = mode;
      a.seq = seq;
      a.x = d_x;
      a.region = d_region;
      a.num_tokens = T;
      ASSERT_CUDA(LaunchEncodePayloads(a, nullptr));
      ASSERT_CUDA(cudaDeviceSynchronize());
      const int64_t bytes = protocol::DispatchPayloadBytes(H, mode.use_fp8);
      std::vector<uint8_t> got(bytes), want(bytes);
      for (int t = 0; t < T; ++t) {
        const int64_t off = layout.DispatchPayloadOffset(protocol::HalfOfSeq(seq), t, mode.use_fp8);
        ASSERT_CUDA(cudaMemcpy(got.data(), d_region + off, bytes, cudaMemcpyDeviceToHost));
        EncodeDispatchPayload(&x[static_cast<size_t>(t) * H], H, mode, want.data());
        ASSERT_EQ(std::memcmp(got.data(), want.data(), bytes), 0)
            << "token " << t << " fp8=" << mode.use_fp8 << " round=" << mode.round_scale;
      }
    }
  }
  cudaFree(d_x);
  cudaFree(d_region);
}

}  // namespace
}  // namespace llep::kernels::cuda
