"""Whether an edit leaves the BF16 megakernel's machine code as it was: renders each named spec's
default build at two git revisions (the working tree, and REV through a temporary worktree),
compiles both to sm_90a cubins with mokgen's flags, and compares `cuobjdump --dump-sass`, the
anonymous-namespace hashes (which follow the file path) taken out. Used before re-keying
mokgen/tuned/ to a new kernel digest (mokgen/tuned/README.md). CPU only.

Usage: python3 .ci/sass_same.py REV SPEC [SPEC ...]   (CUOBJDUMP=path if not on PATH)
  SPEC:mxfp8 compares the spec's MXFP8 build instead (its default plan)
Prints one line per spec, "same" or "DIFFERENT (n lines)"; exits 1 if any differs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: an anonymous namespace's mangled name: its hashes follow the compiled file's path
ANON = re.compile(r"_GLOBAL__N__[0-9a-f]+_(\d+_\w+?)_[0-9a-f]{8}")
#: the disassembler (CUOBJDUMP=path where it is not on PATH)
CUOBJDUMP = os.environ.get("CUOBJDUMP", "cuobjdump")


def _sass(tree: Path, spec: str, out: Path) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(tree), MOKGEN_GENERATED_DIR=str(out / "gen"))
    code = ("import sys; from mokgen import build as b, render as r; from mokgen.spec import load_spec; "
            "n, _, num = sys.argv[1].partition(':'); s = load_spec(n); "
            "s = s.with_target(numerics=num) if num else s; "
            "p, k, _ = b.plan_and_key(s); f = r.render(p, k); "
            "sys.stdout.write(f['moe_forward.cu'])")
    src = subprocess.run([sys.executable, "-c", code, spec], env=env, cwd=tree, check=True, capture_output=True,
                         text=True).stdout
    cu = out / f"{spec.replace(':', '-')}.cu"
    cu.write_text(src)
    import cutlass_library  # the headers the build uses

    cutlass_inc = Path(cutlass_library.__file__).parent / "source" / "include"
    cubin = out / f"{spec.replace(':', '-')}.cubin"
    subprocess.run(["nvcc", "-std=c++17", "-O3", "-cubin", "-gencode=arch=compute_90a,code=sm_90a",
                    "-Xcompiler", "-fno-gnu-unique", "-I", str(tree / "templates" / "include"), "-I",
                    str(cutlass_inc), str(cu), "-o", str(cubin)], check=True, capture_output=True)
    dump = subprocess.run([CUOBJDUMP, "--dump-sass", str(cubin)], check=True,
                          capture_output=True, text=True).stdout
    return [ANON.sub(r"ANON_\1", line) for line in dump.splitlines()]


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__.strip().splitlines()[-3], file=sys.stderr)
        return 2
    rev, specs = sys.argv[1], sys.argv[2:]
    if shutil.which(CUOBJDUMP) is None:  # before the worktree and the first build, not after them
        print(f"error: {CUOBJDUMP!r} not found; put cuobjdump on PATH or set CUOBJDUMP=path", file=sys.stderr)
        return 2
    differ = 0
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old), rev], cwd=ROOT, check=True)
        try:
            for spec in specs:
                a_dir, b_dir = Path(tmp) / "a" / spec, Path(tmp) / "b" / spec
                a_dir.mkdir(parents=True)
                b_dir.mkdir(parents=True)
                a, b = _sass(old, spec, a_dir), _sass(ROOT, spec, b_dir)
                n = sum(1 for x, y in zip(a, b) if x != y) + abs(len(a) - len(b))
                print(f"{spec}: {'same' if n == 0 else f'DIFFERENT ({n} lines)'} ({len(b)} lines of SASS)",
                      flush=True)
                differ += n != 0
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)
            shutil.rmtree(old, ignore_errors=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
