"""Entry points that put llep under SGLang and vLLM without patching either (shared/spec/engines.md §2.7 path B,
§3.3): both engines import `deep_ep` for their DeepEP low-latency backend, and llep answers to that name.

- vLLM: `pip install --no-build-isolation .` registers `llep.integrations.vllm:register` in the entry-point group
  `vllm.general_plugins`, which vLLM runs in every process; `--all2all-backend deepep_low_latency` then runs on llep.
  `VLLM_PLUGINS` (vLLM's filter) or `LLEP_AS_DEEP_EP=0` turn it off.
- SGLang: `llep-sglang <sglang.launch_server arguments>` (console script of the same package) starts SGLang with a
  `deep_ep` package that is llep on every process's path (`deep_ep_shim/`), after checking the arguments select the
  low-latency DeepEP backend and no switch llep does not implement."""
import os
import sys


def shim_dir() -> str:
    """The folder holding the `deep_ep` package that re-exports llep.deep_ep (for PYTHONPATH)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'deep_ep_shim')


def install_as_deep_ep() -> bool:
    """`import deep_ep` resolves to llep in this process, unless LLEP_AS_DEEP_EP=0. True when installed."""
    from llep import _llep
    if not _llep.read_options()['as_deep_ep']:
        return False
    from llep.deep_ep import install_as_deep_ep as install
    install()
    return 'deep_ep' in sys.modules
