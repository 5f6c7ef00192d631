# interactive-first.py: a broker policy for a contended cluster where notebooks' short cells wait behind long,
# big cells. Small requests may suspend long leases instead of waiting for them to end: the victims' GPU state goes
# to host memory (CUDA checkpoint, or SIGSTOP where they hold none), their processes stop, and they resume on GPUs of
# their model, losing nothing. A whole-node gang suspended for a small request keeps its node: it lends it to small
# requests for a minute and then takes it back before anyone else.
#
# Use it for the broker (lease-broker --LeaseBroker.config_file=examples/policies/interactive-first.py) or to
# measure it on a trace first (gpulease replay BURSTS.csv --config examples/policies/interactive-first.py).
#
# The trade-off: a small cell's wait falls from the length of the longest running cell to about a suspend (the
# copy of the victim's GPU memory to host memory, seconds to a minute for a whole node), and the big requests pay:
# their p95 wait falls (1-GPU cells no longer hold back the last gangs of a busy stretch), but their median wait
# rises, since small requests go first for up to two days (small_first_timeout) and gangs are suspended for them.
# Only kernels that can suspend (their requests say "suspendable": the local executor on a host with the CUDA
# checkpoint API or no CUDA at all) are ever asked; other leases are preempted only as preempt_grace_seconds says
# (here: never). See docs/admin-guide.md, "Preemption by suspension".
#
# The values are tuned on the replays of issue 33 (python -m benchmarks --only replay, figures in BENCHMARKS.md; the
# designs tried are in docs/admin-guide.md and docs/images/replay-interactive-first-2x8.png), at the suspend/resume
# costs measured on an H100 (0.46 s / 0.17 s per GiB) and 16 GiB per GPU, against the default policy in the same run:
# - the contended 2x8 notebook trace: 1-GPU p95 time to GPU 0 s (default 840 s), 8-GPU p95 74,370 s (105,456 s),
#   held-but-idle 5.2 % (6.7 %); over 16 jittered copies (medians) 1-GPU 7 s, 8-GPU 85,022 s (90,558 s);
# - the contended month (3,000 jobs, load 0.9 of 2x8): 1-GPU p95 59 s (16,154 s), 8-GPU p95 234,433 s (433,230 s),
#   held-but-idle 6.2 % (5.9 %); every suspended job completes.
# What they cost: the month's 8-GPU median wait is 173,473 s (default 18,306 s) and its 4-GPU p95 70,353 s (49,939 s);
# the trace's 8-GPU median 1,320 s (180 s) and 4-GPU p95 26,142 s (12,417 s). The month's 1-GPU p95 of 59 s is the suspend of one whole-node gang
# (8 x 16 GiB x 0.46 s/GiB): with more GPU memory per GPU it is longer. On other generated months (seeds 2 and 3) the
# 1-GPU p95 is 1,123 s and 721 s: there 16 % of the 1-GPU jobs arrive while gangs hold every GPU, more than one
# suspend each can serve.

c = get_config()  # noqa: F821  (traitlets config files get `get_config` from the loader)

# Preemption by suspension instead of by revocation (the default is "revoke": nothing is ever suspended for others).
c.LeasePolicy.preempt_mode = "suspend"

# Which requests may suspend others: those of 1 GPU (interactive cells, not training gangs) ...
c.LeasePolicy.suspend_max_gpus = 1
# ... of any time limit (0; 3600 kept the month's 1-GPU p95 at 16,343 s: its 1-GPU jobs' limits are often longer) ...
c.LeasePolicy.suspend_max_duration_seconds = 0
# ... of any class ([] = every class; e.g. ["normal", "high"] to keep "low" requests from suspending anyone).
# A victim is never of a higher class than the request that suspends it.
c.LeasePolicy.suspend_classes = []

# 1-GPU requests go before bigger ones of their class, until the bigger one has waited two days: they take GPUs that
# free up before the gangs' reservations do, instead of suspending gangs for them (on the month 309 gang suspensions
# instead of 469, and the 8-GPU p95 about 260,000 s instead of 464,659 s without it; a day instead of two: 331,019 s,
# and the 16 copies' 8-GPU median 128,476 s, over the default's).
c.LeasePolicy.small_first_gpus = 1
c.LeasePolicy.small_first_timeout = 172800

# A lease holds its GPUs at least 500 s since its grant or its last resume before it may be suspended: each
# suspension copies its GPU memory out and back (400-550 s gave the same bars; 600 s let the month's 1-GPU p95 reach
# 210 s, 300 s made the trace's 8-GPU p95 108,076 s).
c.LeasePolicy.suspend_min_runtime_seconds = 500
# The starvation bound: a lease is not suspended by preemption again once it spent half its life suspended (a
# whole-node gang keeps its node, below, so it is suspended at most suspend_keep_max_seconds at a time anyway; with
# 0.75 or 1.0, no bound, the month's 8-GPU p95 was 250,856 s / 264,290 s, the other bars the same).
c.LeasePolicy.suspend_max_share = 0.5

# A holder asked to suspend reports within a minute; else it is revoked as without suspension.
c.LeasePolicy.suspend_report_seconds = 60
# A suspended lease ends after a week (its host memory is not held forever).
c.LeasePolicy.suspend_max_seconds = 604800

# A whole-node gang (8 GPUs or more) suspended for a small request keeps its node: its GPUs are lent only to small
# requests (those that may suspend others) for suspend_keep_max_seconds, then it takes them back (its borrowers are
# asked to suspend in turn) and resumes before anyone else. Smaller victims (4 GPUs) give their GPUs to the queue.
# Without keeping (off), the 16 GPUs of the month went to the queue's gangs and the month's 1-GPU p95 was 16,343 s.
c.LeasePolicy.suspend_keep_gpus = "small"
c.LeasePolicy.suspend_keep_min_gpus = 8
c.LeasePolicy.suspend_keep_max_seconds = 60

# Big requests are not made to wait longer by the small cells that overtake them: a lease suspended by preemption
# resumes behind a waiting gang that asked before it was suspended (without: the month's 8-GPU p95 936,191 s with the
# keep-node values above) ...
c.LeasePolicy.suspend_resume_behind_gangs = True
# ... but a waiting gang's planned GPUs are not spared from suspension (suspend_spare_gangs): small requests would
# then wait for the gangs' reservations (the month's 1-GPU p95 723-1,791 s with it after 12 h to 36 h).
c.LeasePolicy.suspend_spare_gangs = False

# Idle sessions are revoked and parked (pickled) as by default, not suspended: a resumed session goes before new
# requests of its class, which on the trace made the 8-GPU requests' p95 wait half as long again (and the 1-GPU
# cells' p95 660 s). Where big requests are rare, set it to True: a session's next cell then loses nothing.
c.LeasePolicy.suspend_idle = False

# The GPUs a suspension frees go to whoever is first in queue order (with the node kept, above, that is the small
# requests); True hands them to the request the suspension was made for first (the month's 8-GPU p95 292,957 s with
# a day of small-first: no better).
c.LeasePolicy.suspend_grant_asker = False
