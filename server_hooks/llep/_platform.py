"""Which native module this process loads: llep._llep (the CUDA or CPU-only build) or llep._llep_hip (the
LLEP_GPU=hip build, for a ROCm torch, whose GPUs torch also calls "cuda"). kernels/HIP_PORT.md has the port."""
import importlib
import sys


def native_module_name(torch_module) -> str:
    """'llep._llep_hip' when `torch_module` is a ROCm build (torch.version.hip set), else 'llep._llep'."""
    version = getattr(torch_module, 'version', None)
    return 'llep._llep_hip' if getattr(version, 'hip', None) else 'llep._llep'


def install_native_module(torch_module) -> None:
    """Makes `llep._llep` the native module that matches `torch_module`, so every `from llep import _llep` gets it.
    A ROCm torch with no HIP build of llep beside it is an ImportError that says how to build one."""
    name = native_module_name(torch_module)
    if name == 'llep._llep':
        return
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f'torch is a ROCm build (torch.version.hip = {torch_module.version.hip}) but this llep has no '
                          f'{name}: build it with cmake -DLLEP_GPU=hip -DCMAKE_CXX_COMPILER=clang++ '
                          f'(README, "AMD GPUs")') from e
    sys.modules['llep._llep'] = module
    setattr(sys.modules['llep'], '_llep', module)
