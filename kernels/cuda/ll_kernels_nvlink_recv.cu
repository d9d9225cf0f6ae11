// The receive-only kernels (a hook's receive) for a buffer of NVLink peers only that masks no rank and a top-k of at
// most 8: ll_kernels_recv.cu's two, compiled again as ll_kernels_nvlink.cu compiles the launches with a send phase
// (which says why), with HasProxy / HasMask false by construction and top-8 routing (kRouteK). One definition of the
// kernels: this unit is ll_kernels_recv.cu with the two options set, its getters named NvlinkOnlyReceive*.
#define LLEP_LL_NVLINK_ONLY 1
#define LLEP_LL_TOPK_8 1
#include "kernels/cuda/ll_kernels_recv.cu"
