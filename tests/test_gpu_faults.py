"""Every wait stage's timeout on one GPU, through fault-injection builds (docs/architecture.md).

Stage 1 (a peer's routing tables) has a run-time switch, ``simulate_missing_rank``
(tests/test_gpu_ep.py, test_missing_peer_times_out_then_recovers). For stages 2 to 6 a build
compiled with ``-DMOKGEN_FAULT_STAGE=N`` (mokgen.build.fault_flags; sync.cuh) leaves out the one
signal whose absence makes the waits of stage N time out:
  2 rank barrier   the first CTA of rank 0 never arrives at its rank's barriers
  3 ring free      no ring slot is ever freed (bites once there are more chunks than slots)
  4 chunk landed   no chunk is ever marked landed
  5 combine done   rank 0 never tells its peers that its pushes are done
  6 block ready    no up tile is ever counted, so no down tile may start
Each test launches that build through virtual_ep_forward with a 200 ms timeout on inputs that
reach the stage, expects the KernelError that names the waiting rank and the stage (abi.STAGES),
then checks that the default build still gives, on fresh buffers, the bits it gave before.

The first timeout is the one recorded, and waits on peers (stages 1 and 5) time out after
timeout_ms, waits on one's own CTAs (2, 3, 4, 6) after twice that. So the stage 2, 3, 4 and 6 cases
run one virtual rank: a peer of the stalled rank would report first, waiting for its routing
tables or its combine pushes (the stage 2 case checks that too). Their rings leave no other wait
pending: one slot, and (stages 4, 6) one chunk, so the dispatch never waits for a free slot;
(stage 3) two chunks, so the dispatch waits for slot 0 right after chunk 0 landed, long before
the compute, done with chunk 0, waits for chunk 1. Enough rows that the compute CTAs, each
claiming at most 3 tiles past the one it is stuck on (ep_forward.cuh, kClaimAhead), never claim
the last tile (the end of the tile order would send a CTA to the compute barrier, a stage 2
wait that could start first). The plan is pinned to
what this reasoning assumes: the Hopper core's flow schedule, single CTAs, dispatch CTAs joining
the compute after their last pull (a dispatch CTA that does not join waits in the combine, on
the peers' timeout).
"""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from mokgen import abi, reference  # noqa: E402
from mokgen import build as build_mod  # noqa: E402
from mokgen.bench import expert_weights  # noqa: E402
from mokgen.ep import release_buffers, virtual_ep_forward  # noqa: E402
from mokgen.errors import KernelError  # noqa: E402
from mokgen.load import load  # noqa: E402
from mokgen.spec import load_spec  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc, pytest.mark.usefixtures("gpu_memory", "gpu_module_memory")]

SPEC = "qwen3-30b-a3b"
TIMEOUT_MS = 200
REL_TOL = 2e-2
#: the plan the cases are reasoned for (see the module's docstring)
PLAN_ENV = {"MOKGEN_GEMM_CORE": "wgmma", "MOKGEN_SCHEDULE": "flow", "MOKGEN_CLUSTER": "1", "MOKGEN_DISPATCH_JOIN": "1"}

#: stage -> (tokens per virtual rank, chunk_rows, ring_chunks, the rank that reports, the peer it names)
CASES = {
    2: ([2048], None, None, 0, -1),
    3: ([4096], 16384, 1, 0, -1),     # 32768 rows: two chunks of one slot
    4: ([2048], 16384, 1, 0, -1),     # 16384 rows: one chunk
    5: ([1500, 700], None, None, 1, 0),
    6: ([2048], 16384, 1, 0, -1),
}

_weights_cache: dict = {}


def _weights(spec):
    if spec.name not in _weights_cache:
        _weights_cache[spec.name] = expert_weights(spec, range(spec.num_experts), seed=7)
    return _weights_cache[spec.name]


def _inputs(spec, tokens, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    xs, ids, ws = [], [], []
    for T in tokens:
        xs.append(torch.randn(T, spec.hidden_size, generator=gen, device="cuda").to(torch.bfloat16))
        ids.append(torch.rand(T, spec.num_experts, generator=gen, device="cuda").topk(spec.top_k, dim=-1).indices)
        w = torch.rand(T, spec.top_k, generator=gen, device="cuda") + 0.05
        ws.append(w / w.sum(-1, keepdim=True))
    return xs, ids, ws


def _message(stage: int, rank: int, peer: int) -> str:
    """The pattern of describe_error's line for a timeout of ``rank`` at ``stage`` (abi.STAGES)."""
    what = abi.STAGES[stage].format(peer=peer)
    return re.escape(f"rank {rank} waited more than {TIMEOUT_MS} ms for {what} (launch epoch ")


@pytest.fixture
def plan_env(monkeypatch):
    for k, v in PLAN_ENV.items():
        monkeypatch.setenv(k, v)
    return monkeypatch


def _fault_call(monkeypatch, stage, spec, inputs, weights, chunk, ring, default_key, pattern):
    """The stage's fault build on ``inputs``: raises the KernelError of ``pattern``."""
    with monkeypatch.context() as m:
        m.setattr(build_mod, "BASE_FLAGS", [*build_mod.BASE_FLAGS, *build_mod.fault_flags(stage)])
        assert load(spec).KEY != default_key, f"stage {stage}: the fault flags did not reach the build"
        with pytest.raises(KernelError, match=pattern):
            virtual_ep_forward(spec, *inputs, *weights, chunk_rows=chunk, ring_chunks=ring, timeout_ms=TIMEOUT_MS)


@pytest.mark.parametrize("stage", sorted(CASES))
def test_fault_build_times_out_at_its_stage_then_the_default_build_runs(plan_env, stage):
    spec = load_spec(SPEC)
    tokens, chunk, ring, rank, peer = CASES[stage]
    weights = _weights(spec)
    inputs = _inputs(spec, tokens, seed=stage)
    default_key = load(spec).KEY
    before = torch.cat(virtual_ep_forward(spec, *inputs, *weights, chunk_rows=chunk, ring_chunks=ring))

    _fault_call(plan_env, stage, spec, inputs, weights, chunk, ring, default_key, _message(stage, rank, peer))

    release_buffers()  # the default build on fresh buffers
    assert load(spec).KEY == default_key
    after = torch.cat(virtual_ep_forward(spec, *inputs, *weights, chunk_rows=chunk, ring_chunks=ring))
    assert torch.equal(after, before), f"stage {stage}: the default build's bits changed after the fault"
    xs, ids, ws = inputs
    ref = reference.experts_forward(torch.cat(xs), torch.cat(ids), torch.cat(ws), *weights,
                                    clamp_limit=spec.activation.clamp_limit)
    err = ((after.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < REL_TOL, f"relative error {err:.3e}"


def test_a_rank_stalled_at_its_barrier_is_reported_by_a_peer_first(plan_env):
    """The stage 2 build on two virtual ranks: rank 0 waits for its missing CTA (twice the
    timeout), so rank 1, waiting on a peer for rank 0's routing tables, times out first and names
    rank 0 (docs/architecture.md: the CTA that waited for the missing peer reports)."""
    spec = load_spec(SPEC)
    weights = _weights(spec)
    inputs = _inputs(spec, [600, 400], seed=12)
    default_key = load(spec).KEY
    _fault_call(plan_env, 2, spec, inputs, weights, None, None, default_key, _message(1, 1, 0))
