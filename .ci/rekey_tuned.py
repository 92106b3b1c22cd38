"""Re-key the shipped tuned files (mokgen/tuned/) to this tree's kernel digest, but only where an
edit left the megakernel's machine code as it was. CPU only; needs nvcc and cuobjdump.

A tuned file names the kernel digest it was measured with (`_metadata.templates`,
`mokgen.render.kernel_digest()`); any edit to the kernel's sources (a comment, a measuring
macro's #ifdef, trace-only code) changes the digest, and the files no longer fit
(`tests/test_tune.py::test_shipped_tuned_files_fit_this_tree`). Such an edit keeps the files'
measurements valid exactly when the default builds' SASS is unchanged. This script runs
`.ci/sass_same.py REV SPEC...` and, if every spec's SASS is the same, rewrites each file's
`templates` value to the new digest (the value only: the rest of each file stays byte for byte);
if any differs it re-keys nothing and exits 1 (re-tune instead; mokgen/tuned/README.md).

`--only`: re-key only the files of the named specs (mokgen/tuned/<spec>/), for an edit that
changes some specs' builds and not others' (those others are re-tuned, or re-keyed on their own
measured evidence, docs/perf-notes.md).

Usage: python3 .ci/rekey_tuned.py REV [--only] [SPEC ...]
  default specs: qwen3-30b-a3b kimi-k2.5 qwen3.5-35b-a3b glm-5.2 deepseek-v3 (the default builds:
  single CTAs and CTA pairs, with and without the fused shared expert), and each one's MXFP8 build
  where it has an MXFP8 tuned file (kimi-k2.5, deepseek-v3); CUOBJDUMP=path if cuobjdump is not
  on PATH
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TUNED = ROOT / "mokgen" / "tuned"
DEFAULT_SPECS = ("qwen3-30b-a3b", "kimi-k2.5", "qwen3.5-35b-a3b", "glm-5.2", "deepseek-v3")


def checked_builds(specs) -> list[str]:
    """The builds whose SASS must be unchanged to re-key ``specs``' files: each spec's default (BF16)
    build, and its MXFP8 build (SPEC:mxfp8) where mokgen/tuned/SPEC holds an MXFP8 file (v0.56:
    without it, an edit that changed only the MXFP8 build re-keyed the MXFP8 files)."""
    out = []
    for spec in specs:
        out.append(spec)
        if any(TUNED.glob(f"{spec}/*-mxfp8-*.json")):
            out.append(f"{spec}:mxfp8")
    return out


def rekey(tuned_dir: Path, digest: str, specs: list[str] | None = None) -> list[Path]:
    """Rewrite every ``*/*.json`` under ``tuned_dir`` (only ``<spec>/*.json`` of ``specs`` where
    given) whose ``_metadata.templates`` is not ``digest`` to name it; returns the files changed.
    Only the value's text is replaced (once, in its "templates" field), and the result is parsed
    again to check it."""
    changed = []
    paths = tuned_dir.glob("*/*.json") if specs is None else [p for s in specs for p in tuned_dir.glob(f"{s}/*.json")]
    for path in sorted(paths):
        text = path.read_text()
        before = json.loads(text)
        old = before["_metadata"]["templates"]
        if old == digest:
            continue
        field = f'"templates": "{old}"'
        if text.count(field) != 1:
            raise SystemExit(f"rekey_tuned: {path}: expected one {field!r}, found {text.count(field)}")
        new_text = text.replace(field, f'"templates": "{digest}"')
        after = json.loads(new_text)
        before["_metadata"]["templates"] = digest
        if after != before:
            raise SystemExit(f"rekey_tuned: {path}: the rewrite changed more than the digest")
        path.write_text(new_text)
        changed.append(path)
    return changed


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        print(__doc__[__doc__.index("Usage:"):].strip(), file=sys.stderr)
        return 2
    rev, rest = sys.argv[1], sys.argv[2:]
    only = "--only" in rest
    specs = [a for a in rest if a != "--only"]
    if only and not specs:
        print("rekey_tuned: --only needs the specs whose files to re-key", file=sys.stderr)
        return 2
    unknown = [s for s in specs if only and not (TUNED / s).is_dir()]
    if unknown:
        print(f"rekey_tuned: no tuned files for {', '.join(unknown)} under {TUNED}", file=sys.stderr)
        return 2
    specs = specs or list(DEFAULT_SPECS)
    same = subprocess.run([sys.executable, str(ROOT / ".ci" / "sass_same.py"), rev, *checked_builds(specs)], cwd=ROOT)
    if same.returncode != 0:
        print("rekey_tuned: the SASS differs from REV's (or the check failed): nothing re-keyed; re-tune",
              file=sys.stderr)
        return 1
    sys.path.insert(0, str(ROOT))
    from mokgen import render

    digest = render.kernel_digest()
    changed = rekey(TUNED, digest, specs if only else None)
    print(f"rekey_tuned: {len(changed)} file(s) re-keyed to {digest[:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
