"""Runs a Python module or script with extra nvcc flags on every mokgen build it makes
(build.BASE_FLAGS, part of the build cache key), e.g. a whole bench or test run on a measuring
macro's builds: the MXFP8 builds of MOKGEN_MX_EXPAND under `mokgen bench` or pytest.

Usage: python3 .ci/with_flags.py FLAG [FLAG ...] -- (-m MODULE | SCRIPT) [ARGS ...]
  e.g. python3 .ci/with_flags.py -DMOKGEN_MX_EXPAND -- -m pytest -q tests/test_gpu_mx_megakernel.py"""
import runpy
import sys

if "--" not in sys.argv[1:]:
    sys.exit(__doc__.splitlines()[-2].strip())
cut = sys.argv.index("--")
flags, rest = sys.argv[1:cut], sys.argv[cut + 1:]
if not flags or not rest or any(not f.startswith("-") for f in flags):
    sys.exit("with_flags: give nvcc flags (each starting with -) before --, and a module (-m NAME) or script after it")

from mokgen import build  # noqa: E402

build.BASE_FLAGS = [*build.BASE_FLAGS, *flags]
if rest[0] == "-m":
    if len(rest) < 2:
        sys.exit("with_flags: -m needs a module name")
    sys.argv = [rest[1], *rest[2:]]
    runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = rest
    runpy.run_path(rest[0], run_name="__main__")
