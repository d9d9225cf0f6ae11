// The GPU runtime API for host code (runtime/gpu_buffer*, the FIFO allocation, the kernels' launchers and the Python
// binding): the CUDA runtime, or on AMD (the LLEP_GPU=hip build, where hip::host defines __HIP_PLATFORM_AMD__) the
// HIP runtime under the CUDA names llep uses. Layer: runtime. Design: kernels/HIP_PORT.md.
//
// The names are mapped, not wrapped: HIP's runtime API has the CUDA one's shape call for call for everything here
// (same arguments, same error-code convention), so host code stays one source that reads as the CUDA it is on
// NVIDIA. The list is exactly what llep calls; a CUDA name missing from it fails the HIP build (CI builds it), which
// is where a new call gets its HIP counterpart. Launches differ and live in kernels/cuda/ll_kernels.cu.
#pragma once

#if defined(__HIP__) || defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime_api.h>

// clang-format off
#define cudaDevAttrMaxSharedMemoryPerBlockOptin hipDeviceAttributeSharedMemPerBlockOptin
#define cudaDevAttrMultiProcessorCount          hipDeviceAttributeMultiprocessorCount
#define cudaDeviceCanAccessPeer                 hipDeviceCanAccessPeer
#define cudaDeviceGetAttribute                  hipDeviceGetAttribute
#define cudaDeviceGetByPCIBusId                 hipDeviceGetByPCIBusId
#define cudaDeviceGetPCIBusId                   hipDeviceGetPCIBusId
#define cudaDeviceSynchronize                   hipDeviceSynchronize
#define cudaErrorCooperativeLaunchTooLarge      hipErrorCooperativeLaunchTooLarge
#define cudaErrorInvalidValue                   hipErrorInvalidValue
#define cudaErrorNotReady                       hipErrorNotReady
#define cudaError_t                             hipError_t
#define cudaFree                                hipFree
#define cudaFreeHost                            hipHostFree
#define cudaFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define cudaFuncGetAttributes                   hipFuncGetAttributes
#define cudaFuncSetAttribute                    hipFuncSetAttribute
#define cudaFuncAttributes                      hipFuncAttributes
#define cudaGetDevice                           hipGetDevice
#define cudaGetDeviceCount                      hipGetDeviceCount
#define cudaGetErrorName                        hipGetErrorName
#define cudaGetErrorString                      hipGetErrorString
#define cudaGetLastError                        hipGetLastError
#define cudaHostAlloc                           hipHostMalloc
#define cudaHostAllocDefault                    hipHostMallocDefault
#define cudaHostAllocMapped                     hipHostMallocMapped
#define cudaHostAllocPortable                   hipHostMallocPortable
#define cudaHostGetDevicePointer                hipHostGetDevicePointer
#define cudaIpcCloseMemHandle                   hipIpcCloseMemHandle
#define cudaIpcGetMemHandle                     hipIpcGetMemHandle
#define cudaIpcMemHandle_t                      hipIpcMemHandle_t
#define cudaIpcMemLazyEnablePeerAccess          hipIpcMemLazyEnablePeerAccess
#define cudaIpcOpenMemHandle                    hipIpcOpenMemHandle
#define cudaMalloc                              hipMalloc
#define cudaMemcpy                              hipMemcpy
#define cudaMemcpyAsync                         hipMemcpyAsync
#define cudaMemcpyDeviceToDevice                hipMemcpyDeviceToDevice
#define cudaMemcpyDeviceToHost                  hipMemcpyDeviceToHost
#define cudaMemcpyHostToDevice                  hipMemcpyHostToDevice
#define cudaMemset                              hipMemset
#define cudaMemsetAsync                         hipMemsetAsync
#define cudaSetDevice                           hipSetDevice
#define cudaStreamCaptureMode                   hipStreamCaptureMode
#define cudaStreamCaptureModeRelaxed            hipStreamCaptureModeRelaxed
#define cudaStreamCaptureStatus                 hipStreamCaptureStatus
#define cudaStreamCaptureStatusNone             hipStreamCaptureStatusNone
#define cudaStreamCreateWithFlags               hipStreamCreateWithFlags
#define cudaStreamDestroy                       hipStreamDestroy
#define cudaStreamIsCapturing                   hipStreamIsCapturing
#define cudaStreamQuery                         hipStreamQuery
#define cudaStreamNonBlocking                   hipStreamNonBlocking
#define cudaStreamSynchronize                   hipStreamSynchronize
#define cudaStream_t                            hipStream_t
#define cudaSuccess                             hipSuccess
#define cudaThreadExchangeStreamCaptureMode     hipThreadExchangeStreamCaptureMode
// clang-format on

#else
#include <cuda_runtime.h>  // (not _api.h: its C++ overloads, e.g. cudaMalloc(T**), are used)
#endif
