"""`llep-sglang`: runs `python3 -m sglang.launch_server ARGS` with llep as `deep_ep` in every SGLang process.

SGLang starts its scheduler and worker processes fresh (multiprocessing spawn), so a module swapped in this process
would not reach them: the launcher puts a `deep_ep` package that re-exports llep first on PYTHONPATH, which they all
inherit. It checks the arguments first: the DeepEP all-to-all backend in low-latency mode is required
(`--moe-a2a-backend deepep --deepep-mode low_latency`; llep has no normal mode), and single-batch overlap (fork-only
combine arguments) must be off."""
import os
import subprocess
import sys
from typing import List, Optional

from llep.integrations import shim_dir


def _value(args: List[str], flag: str) -> Optional[str]:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + '='):
            return a.split('=', 1)[1]
    return None


def check_args(args: List[str]) -> List[str]:
    """What must change in SGLang's arguments for llep to serve them (empty: nothing)."""
    problems = []
    if _value(args, '--moe-a2a-backend') != 'deepep':
        problems.append('pass --moe-a2a-backend deepep (llep stands in for DeepEP)')
    if _value(args, '--deepep-mode') != 'low_latency':
        problems.append('pass --deepep-mode low_latency (llep implements DeepEP\'s low-latency mode only)')
    if '--enable-single-batch-overlap' in args:
        problems.append('remove --enable-single-batch-overlap (its combine arguments exist only in DeepEP forks)')
    if _value(args, '--deepep-dispatcher-output-dtype') == 'nvfp4':
        problems.append('use --deepep-dispatcher-output-dtype fp8 or bf16 (NVFP4 dispatch is not implemented)')
    return problems


def environment(base: Optional[dict] = None) -> dict:
    env = dict(os.environ if base is None else base)
    env['PYTHONPATH'] = os.pathsep.join(p for p in (shim_dir(), env.get('PYTHONPATH', '')) if p)
    return env


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    problems = check_args(args)
    if problems:
        print('llep-sglang: ' + '; '.join(problems), file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, '-m', 'sglang.launch_server', *args], env=environment())


if __name__ == '__main__':
    sys.exit(main())
