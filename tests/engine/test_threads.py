"""segcli.threads.ordered: results in order, computed ahead on the pool's threads."""

import threading
import time

import pytest

from segcli import threads


@pytest.fixture(params=[1, 3])
def count(request):
    threads.set_count(request.param)
    yield request.param
    threads.set_count(None)


def test_ordered_yields_in_order_computed_ahead_on_the_pools_threads(count):
    names = []

    def task(k):
        names.append(threading.current_thread().name)
        time.sleep(0.002 * (k % 3))  # finished out of order
        return k * k

    taken = []

    def tasks():
        for k in range(20):
            taken.append(k)
            yield lambda k=k: task(k)

    results = threads.ordered(tasks())
    assert next(results) == 0
    assert len(taken) == (1 if count == 1 else 2 * count)  # no more than that ahead
    assert list(results) == [k * k for k in range(1, 20)]
    assert all(name.startswith("segcli") for name in names) == (count > 1)


def test_ordered_raises_a_tasks_error_where_its_result_would_be_and_cancels_the_rest(count):
    done = []

    def task(k):
        if k == 2:
            raise ValueError("task 2")
        time.sleep(0.01)
        done.append(k)
        return k

    results = threads.ordered(lambda k=k: task(k) for k in range(100))
    assert [next(results), next(results)] == [0, 1]
    with pytest.raises(ValueError, match="task 2"):
        next(results)
    results.close()
    time.sleep(0.05)
    assert len(done) <= 2 + 2 * count  # those not begun were cancelled
