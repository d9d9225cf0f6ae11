#!/usr/bin/env python3
"""Batched 16-byte loads must stay in flight together (kernels/SMALL_T_CODE.md rule 13). A kernel that loads several
rows before it uses them (the combine's reductions, the copies' passes) is only as fast as its loads overlap. If ptxas
puts two of those loads into one destination register, the second waits for the first to arrive and be copied out:
the batch becomes a chain of round trips, and nothing but time shows it (the results stay exact). In session 62 the
expert-side combine's send was such a chain — `v[i] = test ? Ld16(..) : zero` compiled to one scratch register for
eight loads — and the fix took its send to 0.59-0.78x (bench/RESULTS.md session 62).

Reads `cuobjdump -sass` output and fails where a 128-bit load (LDG / LD .E.128) is followed, within WINDOW
instructions, by another 128-bit load into the same register. A load whose own address register it overwrites
(`LDG.E.128 R8, [R8.64]`) counts like any other. Run on the GPU machine (no disassembler on the development machine),
one object per cuobjdump (given several, it printed no machine code; 0 functions fails):
    for o in OBJ...; do cuobjdump -sass "$o"; done | tests/lint/check_sass_load_batches.py -
    tests/lint/check_sass_load_batches.py --self-test      (the checker itself, on embedded samples; ctest runs it)
"""
import re
import sys

WINDOW = 14  # a batch of 8 loads with their address arithmetic fits; a loop's next iteration usually does not
INSN = re.compile(r'/\*([0-9a-f]{4,6})\*/\s+(?:@!?U?P[0-7T]\s+)?([A-Z0-9_.]+)\s+([^;]*);')
FUNCTION = re.compile(r'Function\s*:\s*(\S+)')


def wide_load_dst(op, args):
    """The destination register of a 128-bit global or generic load, else None."""
    if not (op.startswith('LDG.') or op.startswith('LD.')) or '.128' not in op:
        return None
    return args.split(',', 1)[0].strip()


def chains(sass_text):
    """[(function, first address, second address, register)] for every pair of 128-bit loads into one register within
    WINDOW instructions of each other."""
    found = []
    function, insns = '?', []

    def scan():
        for i, (addr, op, args) in enumerate(insns):
            dst = wide_load_dst(op, args)
            if dst is None:
                continue
            for addr2, op2, args2 in insns[i + 1:i + 1 + WINDOW]:
                if wide_load_dst(op2, args2) == dst:
                    found.append((function, addr, addr2, dst))
                    break

    for line in sass_text.splitlines():
        m = FUNCTION.search(line)
        if m:
            scan()
            function, insns = m.group(1), []
            continue
        m = INSN.search(line)
        if m:
            insns.append(m.groups())
    scan()
    return found


SERIAL_SAMPLE = """
        Function : serial
        /*0100*/                   @!P2 LDG.E.128 R32, desc[UR12][R42.64] ;
        /*0110*/                   @!P2 IMAD.MOV.U32 R93, RZ, RZ, R32 ;
        /*0120*/                   @!P3 IMAD.MOV.U32 R42, RZ, RZ, R95 ;
        /*0130*/                   @!P3 LDG.E.128 R32, desc[UR12][R42.64] ;
"""
BATCHED_SAMPLE = """
        Function : batched
        /*0100*/                   @P3 LDG.E.128 R40, desc[UR12][R40.64] ;
        /*0110*/                   @P4 LDG.E.128 R44, desc[UR12][R44.64] ;
        /*0120*/                   @P5 LD.E.128 R48, desc[UR12][R48.64] ;
        /*0130*/                   FFMA R1, R40, R2, R1 ;
        /*0140*/                   LDG.E.64 R40, desc[UR12][R6.64] ;
"""


def self_test():
    serial, batched = chains(SERIAL_SAMPLE), chains(BATCHED_SAMPLE)
    ok = serial == [('serial', '0100', '0130', 'R32')] and batched == []
    print('self-test', 'passed' if ok else f'FAILED: serial {serial}, batched {batched}')
    return 0 if ok else 1


def main(argv):
    if argv[1:] == ['--self-test']:
        return self_test()
    if len(argv) != 2:
        print(__doc__)
        return 2
    text = sys.stdin.read() if argv[1] == '-' else open(argv[1]).read()
    functions = len(FUNCTION.findall(text))
    found = chains(text)
    for function, a, b, reg in found:
        print(f'ERROR: {function}: 128-bit loads at /*{a}*/ and /*{b}*/ both into {reg} (serialized)')
    print(f'{functions} functions checked, {len(found)} serialized 128-bit load pairs')
    return 1 if found or functions == 0 else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv))
