"""bench/ncu_source.py on a made-up Nsight Compute source page and nvdisasm listing (no GPU): the launch is mapped to
the function of its own cubin when two cubins hold a kernel of the same name (the receive-only kernels), executed
WARPSYNC.COLLECTIVE instructions are reported as divergent fallbacks with their source line, and the address runs of
code run by at least W warps end where more than the gap was skipped."""
import csv
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', '..', 'bench'))
import ncu_source  # noqa: E402

BENCH = os.path.join(os.path.dirname(__file__), '..', '..', 'bench', 'ncu_source.py')
NAME = 'llep::kernels::cuda::dispatch(llep::kernels::cuda::DispatchParams, int)'
MANGLED = '_ZN4llep7kernels4cuda8dispatchENS1_14DispatchParamsEi'
HEADER = ['Address', 'Source', 'Warp Stall Sampling (All Samples)', 'Instructions Executed', 'stall_no_inst']


def _page(path, instrs):
    """An ncu source page: one kernel, instructions [(sass, warps)] 16 bytes apart from 0x7f0000001000."""
    with open(path, 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(['Kernel Name', NAME, ''])
        w.writerow(HEADER)
        for i, (sass, ex) in enumerate(instrs):
            w.writerow([hex(0x7f0000001000 + 16 * i), '      ' + sass, '1' if ex else '0', str(ex), '0'])


def _listing(path, n, file_name, line):
    """An nvdisasm -g listing of `dispatch` with n instructions, all from file_name:line."""
    with open(path, 'w') as f:
        f.write(f'{MANGLED}:\n')
        f.write(f'        //## File "/src/kernels/cuda/{file_name}", line {line}\n')
        for i in range(n):
            f.write(f'        /*{16 * i:04x}*/                   NOP ;\n')


def _instrs():
    # 6 instructions run by 32 warps, 12 not run (192 bytes), 2 run, then a divergent fallback taken by 64 warp passes
    return [('S2R R0, SR_TID.X', 32)] * 6 + [('NOP', 0)] * 12 + [('IADD3 R1, R1, 1, RZ', 32)] * 2 + [
        ('WARPSYNC.COLLECTIVE R2, 0x7f0000001200', 64), ('VOTE.ANY P0, P0', 32)]


def test_functions_of_two_cubins_and_fallbacks(tmp_path):
    ins = _instrs()
    _page(tmp_path / 'src_T1_launch2.csv', ins)
    _listing(tmp_path / 'main.sass', 40, 'll_kernels.cu', 7)  # same name, another instruction count
    _listing(tmp_path / 'recv.sass', len(ins), 'll_dispatch_recv.cuh', 123)
    funcs = ncu_source.sass_lines([str(tmp_path / 'main.sass'), str(tmp_path / 'recv.sass')])
    assert set(funcs) == {('main.sass', MANGLED), ('recv.sass', MANGLED)}
    out = subprocess.run([sys.executable, BENCH, str(tmp_path), '--runs', '32'], capture_output=True, text=True,
                         check=True).stdout
    lines = out.splitlines()
    assert lines[0].startswith('dispatch recv') and f'static {len(ins):6d}' in lines[0]
    assert 'll_dispatch_recv.cuh:123' in lines[1] and 'll_kernels.cu' not in lines[1]  # the receive cubin's function
    assert 'divergent fallback at 0x00140 (ll_dispatch_recv.cuh:123): 64 warp passes' in out
    assert '2 runs of code run by >= 32 warps; skips over 128 B: 1, largest 192 B' in out


def test_address_runs_and_fallbacks():
    ran = [(16 * i, ex, sass) for i, (sass, ex) in enumerate(_instrs()) if ex]
    assert ncu_source.divergent_fallbacks(ran) == [(0x140, 64)]
    assert ncu_source.address_runs(ran, 32) == [(0x0, 0x50, 6), (0x120, 0x150, 4)]
    assert ncu_source.address_runs(ran, 32, gap=256) == [(0x0, 0x150, 10)]  # a 192-byte skip within the gap
    assert ncu_source.address_runs(ran, 64) == [(0x140, 0x140, 1)]
