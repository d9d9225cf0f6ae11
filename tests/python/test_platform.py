"""llep picks its native module by torch build (llep/_platform.py): llep._llep for CUDA and CPU torch builds,
llep._llep_hip for a ROCm torch; a ROCm torch without a HIP build of llep is an ImportError that says how to build one.
(The HIP module itself is checked by tests/python/hip_module_check.py on the LLEP_GPU=hip build.)"""
import os
import subprocess
import sys
import types

from llep._platform import native_module_name


def _torch(hip):
    return types.SimpleNamespace(version=types.SimpleNamespace(hip=hip, cuda=None))


def test_module_name_follows_the_torch_build():
    assert native_module_name(_torch(None)) == 'llep._llep'
    assert native_module_name(_torch('')) == 'llep._llep'
    assert native_module_name(_torch('6.2.41133')) == 'llep._llep_hip'
    assert native_module_name(types.SimpleNamespace()) == 'llep._llep'  # no torch.version at all


def test_rocm_torch_without_a_hip_build_is_a_clear_import_error():
    # This build has no _llep_hip (the CUDA/CPU configuration): a fresh interpreter with a ROCm-looking torch.
    code = ("import torch; torch.version.hip = '6.2.0'\n"
            "try:\n    import llep\nexcept ImportError as e:\n    print('IMPORTERROR', e)\n")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120, env=os.environ)
    assert 'IMPORTERROR' in out.stdout, out.stdout + out.stderr
    assert 'ROCm build' in out.stdout and '-DLLEP_GPU=hip' in out.stdout
