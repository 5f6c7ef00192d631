"""What keeps a pass over a deep queue of many users cheap without changing its decisions: the pass stops once the
idle GPUs are planned for others before even the shortest request could end, and a rescore reads only the users
whose score may have left 0."""

from __future__ import annotations

from lease_broker.core.lease import LeaseRequest
from lease_broker.core.queue import Queue
from lease_broker.core.scheduler import Pending, SchedulerPolicy, Slot, schedule

NOW = 1000.0
RANKS = {"low": 0, "normal": 10, "high": 20}


def pending(lid: str, gpus: int, seq: int, duration: float, user: str = "") -> Pending:
    return Pending(lid, user or lid, LeaseRequest(min_gpus=gpus, max_gpus=gpus), seq, duration)


def four_gpus_two_held_until(until: float) -> list[Slot]:
    out = [Slot(id=f"n/{i}", node="n", index=i, memory_total=80 << 30) for i in range(4)]
    for s in out[:2]:
        s.exclusive, s.free_at = True, until
    return out


def test_the_pass_stops_when_no_idle_gpu_is_free_long_enough_and_grants_the_same():
    # a gang of 4 holds the 2 idle GPUs from +100; 1-GPU requests of 500 s behind it cannot use them
    queue = [pending("gang", 4, 1, 600)] + [pending(f"r{i}", 1, i + 2, 500) for i in range(50)]
    policy = SchedulerPolicy(backfill_depth=1)
    walked = schedule(queue, four_gpus_two_held_until(NOW + 100), {}, policy, NOW, ordered=True, all_exclusive=True)
    stopped = schedule(queue, four_gpus_two_held_until(NOW + 100), {}, policy, NOW, ordered=True, all_exclusive=True,
                       shortest=500)
    assert walked.grants == stopped.grants == []
    assert stopped.planned_start == walked.planned_start and stopped.planned_start["gang"] == NOW + 100
    assert len(walked.waiting) == 51 and set(stopped.waiting) == {"gang"}  # nobody behind it was looked at
    # a request short enough to end before the gang starts: no stop, it is granted as before
    queue.append(pending("short", 1, 99, 50))
    both = [schedule(queue, four_gpus_two_held_until(NOW + 100), {}, policy, NOW, ordered=True, all_exclusive=True,
                     shortest=s) for s in (0.0, 50.0)]
    assert [g.lease_id for g in both[0].grants] == [g.lease_id for g in both[1].grants] == ["short"]


def test_rescore_reads_only_scored_users_and_those_named():
    q = Queue(lambda: RANKS)
    for i in range(100):
        q.add(pending(f"l{i}", 1, i, 600.0, user=f"u{i}"), 0.0)
    q.add(pending("x", 1, 100, 60.0, user="used"), 2.0)
    read: list[str] = []

    def score(user: str) -> float:
        read.append(user)
        return {"used": 1.0, "u7": 3.0}.get(user, 0.0)

    q.rescore(lambda user: 2.0 if user == "used" else 0.0)  # the first rescore reads everyone (and the ranks)
    q.rescore(score, users={"u7"})  # only u7 may have left 0 since the last rescore
    assert sorted(read) == ["u7", "used"]
    assert [p.lease_id for p in q][:1] == ["l0"] and [p.lease_id for p in q][-2:] == ["x", "l7"]
    assert q.scored_users() == {"used", "u7"}
    read.clear()
    q.rescore(score)  # None: everyone's score is read
    assert len(read) == 101
    assert q.shortest() == 60.0
    q.remove("x")
    assert q.shortest() == 600.0 and q.scored_users() == {"u7"}
