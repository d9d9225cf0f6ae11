// LLEP_HD marks functions callable from host and device code. Protocol headers use it so the CUDA kernels,
// the CPU backend and the proxy compile the same definitions. This header depends on nothing.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define LLEP_HD __host__ __device__ __forceinline__
#else
#define LLEP_HD inline
#endif
