"""A model check of the CTA pair's stage protocol with a split B (v0.70, -DMOKGEN_MX_RAWB_SPLIT:
hopper_gemm.cuh kSplitB, mx_tile.cuh MxQuantBSplit), run on the CPU with random interleavings.

The two CTAs of a pair are modelled with their producer thread and their two consumer
warpgroups, and the mbarriers as PTX defines them: an arrival count, a transaction count that
may go below zero, and a phase that completes when both reach zero, waited on by parity. The
asynchronous writes are modelled too, with random delays: the TMA loads and multicasts, and the
st.async stores, each counted on its barrier when it lands.

Every run walks one random sequence of pair-tiles: shared B (split, or multicast without the
macro), shared A, or none, with a random count of k-blocks each. The scheduler picks at random,
at every step, among the agents that can move and the writes in flight. It fails on:
- a deadlock;
- a write that lands on a stage some warpgroup's wgmmas are still reading (between the issue and
  the release one k-block later);
- a quantizer that finds other than the raw bytes of its own k-block;
- a wgmma issued on other than this k-block's A and rounded B.

The protocol as built passes every run. Each of four broken variants fails some run, so the model
can tell:
- without the plain xfull arrival on the stage's other uses, a deadlock, or wgmmas on the previous
  use's half (xfull falls a phase behind, and a parity wait passes on the phase before);
- the split with the peer's half still multicast, v0.69's race;
- empty barriers that count only this CTA's consumers, a write into a stage being read;
- no wait on xfull, a wgmma on a half that has not landed."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest


class Bar:
    """An mbarrier: ``count`` arrivals and the transaction bytes armed with them complete a phase."""

    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def arrive(self, expect: int = 0) -> None:
        self.tx += expect
        self.pending -= 1
        assert self.pending >= 0, "more arrivals than the barrier's count in one phase"
        self._settle()

    def complete_tx(self, n: int) -> None:
        self.tx -= n
        self._settle()

    def _settle(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phase, self.pending = self.phase + 1, self.count

    def done(self, parity: int) -> bool:  # mbarrier.try_wait.parity
        return (self.phase & 1) != parity


class ProtocolError(AssertionError):
    pass


@dataclass(frozen=True)
class Variant:
    split: bool = True               # kShareB tiles split B (False: the multicast of every build before v0.70)
    plain_xfull: bool = True         # the producer's plain arrival on xfull for a stage's other uses
    split_multicast: bool = False    # (broken) the split's own half still multicast into the peer
    empty_count: int = 4             # arrivals an empty barrier waits for (both CTAs' consumer warpgroups)
    wait_xfull: bool = True          # the consumers wait on xfull before their wgmmas


def run(seed: int, variant: Variant = Variant()) -> None:
    """One random pair-tile sequence under one random interleaving; raises ProtocolError."""
    rng = random.Random(seed)
    stages = rng.choice([2, 3, 4])
    tiles = [(rng.choice("BBAN"), rng.randint(1, 4)) for _ in range(rng.randint(1, 7))]
    full = [[Bar(1) for _ in range(stages)] for _ in range(2)]
    empty = [[Bar(variant.empty_count) for _ in range(stages)] for _ in range(2)]
    xfull = [[Bar(1) for _ in range(stages)] for _ in range(2)]
    slots = [[{} for _ in range(stages)] for _ in range(2)]  # (A, h) / (B, h, part) -> (tile, kb, state)
    reading = [[0] * stages for _ in range(2)]  # warpgroups whose wgmmas may still read the stage
    meet = {}  # named barrier 2: (cta, tile, kb) -> arrivals
    flight = []  # writes in flight: callables

    def land(cta, s, key, tag, bar):
        def write():
            if reading[cta][s]:
                raise ProtocolError(f"a write lands on CTA {cta}'s stage {s} while it is read ({key}, {tag})")
            slots[cta][s][key] = tag
            bar.complete_tx(1)
        flight.append(write)

    def producer(c):
        stage, phase = 0, 0
        for ti, (share, nk) in enumerate(tiles):
            for kb in range(nk):
                s, ph = stage, phase
                yield lambda s=s, ph=ph: empty[c][s].done(ph ^ 1)
                split = variant.split and share == "B"
                if variant.split:
                    if split:
                        xfull[c][s].arrive(2)
                    elif variant.plain_xfull:
                        xfull[c][s].arrive()
                full[c][s].arrive(4 if split and not variant.split_multicast else 6)  # A 2 units, B 4 (2 a half)
                raw = (ti, kb, "raw")
                for h in (0, 1):  # A: halves, multicast by their CTA for a shared A
                    if share == "A":
                        if h == c:
                            for t in (0, 1):
                                land(t, s, ("A", h), raw, full[t][s])
                    else:
                        land(c, s, ("A", h), raw, full[c][s])
                for h in (0, 1):  # B: two parts (one a consumer warpgroup) a half
                    for part in (0, 1):
                        if split and not variant.split_multicast:
                            if h == c:
                                land(c, s, ("B", h, part), raw, full[c][s])
                        elif share == "B":
                            if h == c:
                                for t in (0, 1):
                                    land(t, s, ("B", h, part), raw, full[t][s])
                        else:
                            land(c, s, ("B", h, part), raw, full[c][s])
                stage, phase = (0, phase ^ 1) if stage + 1 == stages else (stage + 1, phase)
                yield lambda: True

    def release(c, s):
        reading[c][s] -= 1
        empty[c][s].arrive()
        if variant.empty_count == 4:
            empty[c ^ 1][s].arrive()

    def consumer(c, w):
        stage, phase = 0, 0
        for ti, (share, nk) in enumerate(tiles):
            prev = None
            for kb in range(nk):
                s, ph = stage, phase
                yield lambda s=s, ph=ph: full[c][s].done(ph)
                split = variant.split and share == "B"
                here = slots[c][s]
                for h in ((c,) if split else (0, 1)):  # this warpgroup's part of the halves it rounds
                    if here.get(("B", h, w)) != (ti, kb, "raw"):
                        raise ProtocolError(f"CTA {c} wg {w} rounds {here.get(('B', h, w))} for {(ti, kb)}")
                    here[("B", h, w)] = (ti, kb, "rounded")
                    if split:
                        land(c ^ 1, s, ("B", h, w), (ti, kb, "rounded"), xfull[c ^ 1][s])
                    yield lambda: True
                if split and variant.wait_xfull:
                    yield lambda s=s, ph=ph: xfull[c][s].done(ph)
                key = (c, ti, kb)
                meet[key] = meet.get(key, 0) + 1
                yield lambda key=key: meet[key] == 2
                want = {("A", w): (ti, kb, "raw"), **{("B", h, p): (ti, kb, "rounded") for h in (0, 1) for p in (0, 1)}}
                bad = {k: here.get(k) for k, v in want.items() if here.get(k) != v}
                if bad:
                    raise ProtocolError(f"CTA {c} wg {w}'s wgmmas for {(ti, kb)} read {bad}")
                reading[c][s] += 1
                if prev is not None:  # wait_group 1: the k-block before retired
                    release(c, prev)
                prev = s
                stage, phase = (0, phase ^ 1) if stage + 1 == stages else (stage + 1, phase)
            release(c, prev)  # wait_group 0 at the tile's end
            yield lambda: True

    agents = [producer(0), producer(1)] + [consumer(c, w) for c in (0, 1) for w in (0, 1)]
    waits = [next(a) for a in agents]
    live = list(range(len(agents)))
    while live or flight:
        movable = [i for i in live if waits[i]()]
        n = len(movable) + len(flight)
        if n == 0:
            raise ProtocolError(f"deadlock: {len(live)} agents wait, nothing in flight ({stages} stages, tiles {tiles})")
        pick = rng.randrange(n)
        if pick < len(movable):
            i = movable[pick]
            try:
                waits[i] = next(agents[i])
            except StopIteration:
                live.remove(i)
        else:
            flight.pop(pick - len(movable))()


SEEDS = range(400)


@pytest.mark.parametrize("variant", [Variant(), Variant(split=False)], ids=["split", "multicast"])
def test_the_pair_protocol_runs_without_deadlock_or_race(variant):
    """The protocol as built (and, as a check of the model, the multicast every build ran before
    v0.70): every random run completes with the right bytes under every wgmma."""
    for seed in SEEDS:
        run(seed, variant)


@pytest.mark.parametrize("broken, why", [
    (Variant(plain_xfull=False), "deadlock"),
    (Variant(split_multicast=True), "read"),
    (Variant(empty_count=2), "while it is read"),
    (Variant(wait_xfull=False), "read"),
])
def test_each_broken_variant_of_the_protocol_fails_a_run(broken, why):
    """The model can fail: each of four broken protocols fails some random run, and for the reason
    that names it."""
    failures = []
    for seed in SEEDS:
        try:
            run(seed, broken)
        except ProtocolError as err:
            failures.append(str(err))
    assert failures, f"{broken}: no run failed"
    assert any(why in f for f in failures), (broken, failures[:3])
