"""The reward pool (mgrpo/rewards/pool.py) under two threads at once: partial rollout scores two batches from two
producer threads, and a worker's pipe carries one call at a time."""

import operator
import threading

from mgrpo.rewards.pool import FAILED, RewardPool


def _two_threads(map_fn, n: int = 300) -> list:
    """Each thread maps operator.add over its own items; returns [(got, expected)] per thread."""
    out = [None, None]

    def work(t):
        items = [((t * 100000 + i, 1), {}) for i in range(n)]
        try:
            out[t] = (map_fn(operator.add, items, 30.0), [t * 100000 + i + 1 for i in range(n)])
        except Exception:  # noqa: BLE001  (the unlocked race can garble a reply: this thread's map died)
            out[t] = None

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    return out


def test_two_threads_mapping_at_once_each_get_their_own_values():
    """Every value comes back to the thread that asked for it, in order, none failed. Negative control: the same
    two maps without the pool's lock (`_map`) mix the workers' replies up or fail calls."""
    pool = RewardPool(workers=2)
    try:
        pool.map(operator.add, [((0, 0), {})], 30.0)  # workers up
        safe = _two_threads(pool.map)
        assert all(got == want for got, want in safe), "a thread received another's values or a failure"
        assert not pool.errors
        unsafe = _two_threads(pool._map)  # a thread may also die of a reply it could not unpack: None
        done = [x for x in unsafe if x is not None]
        wrong = sum(g != w for got, want in done for g, w in zip(got, want))
        failed = sum(g is FAILED for got, _ in done for g in got)
        print(
            f"two threads x 300 calls: locked all right; unlocked {wrong} wrong ({failed} failed), {2 - len(done)} died"
        )
        assert wrong > 0 or len(done) < 2, "negative control: the race must show"
    finally:
        pool.close()
