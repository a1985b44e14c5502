"""What the fault tests share: a seeded greedy workload over the tiers, the fault-free answers to it (the
offline engine's), and the check that every stream completed with exactly those tokens."""
import random

from engine import Engine
from worker.family import load_family
from worker.sampling import SamplingParams

TIERS = "2,4,6"


def workload(n, seed, max_tokens=60):
    rng = random.Random(seed)
    return [(f"k{seed}-{i}", [rng.randrange(3, 160) for _ in range(rng.randint(3, 20))], i % 3, max_tokens)
            for i in range(n)]


def by_seq(rd, rid):
    """seq -> token over every event of the request; a duplicate must repeat the same token (the
    gateway drops it by its sequence number)."""
    out: dict[int, int] = {}
    for e in rd.events.get(rid, []):
        for i, t in enumerate(e.token_ids):
            assert out.setdefault(e.seq + i, t) == t, (rid, e.seq + i)
    return out


def expected(llama_dir, work):
    """Each request's fault-free greedy tokens: the offline engine's, the requests of one length run as one
    batch, which gives each its tokens alone (test_engine.py's test_mixed_batch_equals_each_request_alone)
    in a fraction of the steps."""
    fam = load_family(str(llama_dir), tiers=TIERS, dtype="float64")
    out: dict[str, list[int]] = {}
    for n in sorted({n for *_, n in work}):
        group = [(rid, p, t) for rid, p, t, m in work if m == n]
        blocks = sum(-(-(len(p) + n) // 4) for _, p, _ in group)
        eng = Engine(fam.model, block_size=4, num_blocks=blocks + 8)
        got = eng.generate([p for _, p, _ in group], [t for *_, t in group],
                           SamplingParams(max_tokens=n, ignore_eos=True))
        out.update(zip([rid for rid, *_ in group], got))
    return out


def assert_complete_and_equal(rd, work, want):
    for rid, _, _, n in work:
        assert not any(e.error for e in rd.events[rid]), (rid, [e.error for e in rd.events[rid] if e.error])
        got = by_seq(rd, rid)
        assert sorted(got) == list(range(n)), f"{rid}: missing sequence numbers"
        assert [got[i] for i in range(n)] == want[rid], rid
