"""BoundedMap: the one bounded memory of the job store's clients (verified values, bad
values logged once, etcd counters and prefix sizes)."""

import threading

import pytest

from replica.jobstore.bounded import BoundedMap


def test_the_least_recently_used_entry_goes_first():
    m = BoundedMap(2)
    m.put("a", 1)
    m.put("b", 2)
    assert m.get("a") == 1  # a is now the most recently used
    m.put("c", 3)
    assert m.get("b") is None and m.get("a") == 1 and m.get("c") == 3
    assert len(m) == 2


def test_first_time_says_whether_a_key_was_new():
    m = BoundedMap(2)
    assert m.first_time("x") and not m.first_time("x")
    m.first_time("y")
    m.first_time("z")  # x forgotten: it would be logged again, once
    assert m.first_time("x")


def test_a_limit_below_one_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        BoundedMap(0)


def test_threads_never_push_it_past_its_limit():
    m = BoundedMap(64)

    def fill(base):
        for i in range(2000):
            m.put((base, i), i)
            m.get((base, i // 2))

    threads = [threading.Thread(target=fill, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(m) == 64
