"""The LLEP_GPU=hip build's Python module (ctest hip_python_module, run by scripts/run_tests.sh on the HIP build; no AMD
GPU needed): under a ROCm torch, `import llep` loads llep._llep_hip, whose GPU backend is compiled for AMD, and every
module that imports llep._llep gets it."""
import sys

import torch

if not getattr(torch.version, 'hip', None):
    torch.version.hip = '5.2.3'  # what a ROCm torch reports; Debian's torch is a CPU build

import llep  # noqa: E402  (after the ROCm torch is in place)
import llep.buffer  # noqa: E402
import llep.deep_ep  # noqa: E402

native = llep._llep
checks = {
    'module name': native.__name__ == 'llep._llep_hip',
    'GPU platform': native.GPU_PLATFORM == 'hip',
    'GPU backend bound': native.HAVE_CUDA and hasattr(native, 'GpuBuffer'),
    'CPU backend bound': hasattr(native, 'CpuBuffer'),
    'buffer uses it': llep.buffer._llep is native,
    'sys.modules alias': sys.modules['llep._llep'] is native,
    'layout query': native.ll_buffer_bytes(128, 7168, 2, 256) > 0,
}
failed = [name for name, ok in checks.items() if not ok]
for name, ok in checks.items():
    print(f'{"PASS" if ok else "FAIL"} {name}')
sys.exit(1 if failed else 0)
