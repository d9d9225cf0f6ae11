"""Builds llep's native module with CMake and packages the Python tree CMake assembles (build/python/llep: the
sources of server_hooks/llep, graph_capture.py and _llep*.so). Metadata and entry points are in pyproject.toml."""
import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.dist import Distribution

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeBuild(build_ext):
    """Runs as build_ext (setuptools runs it because the distribution declares compiled modules)."""

    def run(self) -> None:
        build_dir = os.environ.get('LLEP_BUILD_DIR') or os.path.join(ROOT, 'build-pip')
        if not os.path.exists(os.path.join(build_dir, 'CMakeCache.txt')):
            subprocess.check_call(['cmake', '-S', ROOT, '-B', build_dir, '-G', 'Ninja', '-DCMAKE_BUILD_TYPE=Release',
                                   f'-DLLEP_PYTHON={sys.executable}'])
        subprocess.check_call(['cmake', '--build', build_dir, '--target', '_llep', 'llep_py_package'])
        dst = os.path.join(self.build_lib, 'llep')
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(os.path.join(build_dir, 'python', 'llep'), dst,
                        ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))


class BinaryDistribution(Distribution):
    """The wheel holds a compiled module: platform-specific."""

    def has_ext_modules(self) -> bool:
        return True


# setuptools' own scratch goes under build-pip/ (git-ignored), never into a CMake build folder.
setup(cmdclass={'build_ext': CMakeBuild}, distclass=BinaryDistribution, packages=[],
      options={'build': {'build_base': os.path.join(ROOT, 'build-pip', 'setuptools')}})
