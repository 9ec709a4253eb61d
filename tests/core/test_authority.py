"""Who may ask for what, as pure rules: priority ceilings, which allocation a session
belongs to, the ceilings an allocation or an admin puts on limits, and lease terms
that only tighten. No daemon; fake time in integer microseconds."""

from __future__ import annotations

import random

import pytest

from gpud.core.authority import (
    ADMIN_PRIORITY,
    Members,
    PriorityRules,
    check_may_free,
    check_priority,
    check_task_owner,
    check_tenant,
    fraction_ceilings,
    lease_priority,
    owning_allocation,
    priority_ceiling,
)
from gpud.core.errors import Refused
from gpud.core.leases import LeasePolicy, resolve_terms
from gpud.core.ledger import UNIT, Allocation
from gpud.core.scheduler import GpuScheduler, SchedulerConfig
from gpud_client.protocol import BusyPolicy, ErrorCode

from .statecheck import state_of

GIB = 2**30
MS = 1000

# --- priority ceilings --------------------------------------------------------

RULES = PriorityRules(default_max=40, by_uid={1000: 60}, by_gid={10: 30, 20: 70})


def test_an_admin_may_declare_any_priority() -> None:
    assert ADMIN_PRIORITY == 100
    assert priority_ceiling(RULES, 1000, [20], admin=True) == 100  # whatever its uid or groups say
    assert priority_ceiling(RULES, 4242, [], admin=True) == 100


def test_the_uid_setting_wins_over_the_groups() -> None:
    assert priority_ceiling(RULES, 1000, [10, 20], admin=False) == 60  # not 70: the uid is named


def test_the_highest_of_the_peers_groups_counts() -> None:
    assert priority_ceiling(RULES, 4242, [10, 20, 99], admin=False) == 70
    assert priority_ceiling(RULES, 4242, [10], admin=False) == 30  # below the default: a group may lower it


def test_without_uid_or_group_settings_the_default_applies() -> None:
    assert priority_ceiling(RULES, 4242, [99], admin=False) == 40
    assert priority_ceiling(PriorityRules(), 4242, [], admin=False) == 50


def test_a_priority_above_the_ceiling_is_refused_and_names_the_maximum() -> None:
    with pytest.raises(Refused, match=r"session priority 41 is above your maximum 40") as err:
        check_priority(41, 40, "session")
    assert err.value.code == ErrorCode.PERMISSION_DENIED


@pytest.mark.parametrize("asked", [None, 0, 39, 40])
def test_a_priority_at_or_below_the_ceiling_is_accepted(asked: int | None) -> None:
    check_priority(asked, 40, "allocation")  # no exception


# --- which allocation a session belongs to ------------------------------------


def alloc(task: str, gpu: int, share: int, owner_pid: int | None = None) -> Allocation:
    return Allocation(task, (gpu,), share, (), None, 50, owner_pid, 0)


QUARTER, HALF = UNIT // 4, UNIT // 2


def owned(allocs: list[Allocation], chain: list[int]) -> list[set[str]]:
    """What each process of ``chain`` owns, as the shell's held owners say."""
    return [{a.task_id for a in allocs if a.owner_pid == pid} for pid in chain]


def find(allocs: list[Allocation], owners: dict[str, int], gpu: int, chain: list[int], uid: int) -> Allocation | None:
    return owning_allocation(allocs, owners, gpu, owned(allocs, chain), uid)


def test_the_owner_pid_wins_over_the_smallest_share() -> None:
    mine = alloc("mine", 0, QUARTER)  # made by uid 1000, no owner pid
    by_pid = alloc("by-pid", 0, HALF, owner_pid=77)  # made by uid 1000 for this process
    assert find([mine, by_pid], {"mine": 1000, "by-pid": 1000}, 0, [77, 1], 1000) is by_pid


def test_another_uids_allocation_never_sets_a_sessions_ceiling() -> None:
    """Naming another user's shell as an owner (gpud refuses that now) would not cap it either."""
    squat = alloc("squat", 0, UNIT // 100, owner_pid=77)  # made by uid 2000, naming uid 1000's process
    assert find([squat], {"squat": 2000}, 0, [77, 1], 1000) is None
    mine = alloc("mine", 0, HALF)
    assert find([squat, mine], {"squat": 2000, "mine": 1000}, 0, [77, 1], 1000) is mine


def test_the_nearest_ancestor_that_owns_one_wins() -> None:
    grandparent = alloc("gp", 0, QUARTER, owner_pid=50)
    parent = alloc("p", 0, HALF, owner_pid=60)
    owners = {"gp": 1000, "p": 1000}
    assert find([grandparent, parent], owners, 0, [70, 60, 50], 1000) is parent
    assert find([parent, grandparent], owners, 0, [70, 50], 1000) is grandparent


def test_by_uid_the_smallest_share_is_chosen() -> None:
    big, small, other_uid = alloc("big", 0, HALF), alloc("small", 0, QUARTER), alloc("theirs", 0, UNIT // 10)
    owners = {"big": 1000, "small": 1000, "theirs": 2000}
    assert find([big, small, other_uid], owners, 0, [70], 1000) is small
    tie_b, tie_a = alloc("b", 0, QUARTER), alloc("a", 0, QUARTER)
    assert find([tie_b, tie_a], {"a": 1, "b": 1}, 0, [70], 1) is tie_a  # then by task id


def test_whole_gpu_and_other_gpu_allocations_never_match() -> None:
    whole = Allocation("whole", (0,), UNIT, (), None, 50, 77, 0)  # owned by this very process
    elsewhere = alloc("elsewhere", 1, QUARTER, owner_pid=77)
    cpus_only = Allocation("cpus", (), 0, (3,), None, 50, 77, 0)
    owners = {"whole": 1000, "elsewhere": 1000, "cpus": 1000}
    assert find([whole, elsewhere, cpus_only], owners, 0, [77], 1000) is None
    assert find([whole, elsewhere], owners, 1, [77], 1000) is elsewhere


def test_nothing_matches_a_stranger() -> None:
    assert find([alloc("x", 0, QUARTER, owner_pid=5)], {"x": 1000}, 0, [70, 6], 2000) is None


# --- the ceilings of a fractional allocation ------------------------------------


def test_a_quarter_caps_a_quarter_of_time_and_memory() -> None:
    assert fraction_ceilings(alloc("q", 0, QUARTER), 0, 16 * GIB) == (25, 4 * GIB)


def test_a_whole_gpu_another_gpu_or_no_allocation_caps_nothing() -> None:
    whole = Allocation("whole", (0, 1), UNIT, (), None, 50, None, 0)
    assert fraction_ceilings(whole, 0, 16 * GIB) == (100, None)
    assert fraction_ceilings(alloc("q", 1, QUARTER), 0, 16 * GIB) == (100, None)
    assert fraction_ceilings(None, 0, 16 * GIB) == (100, None)


def test_a_tiny_share_still_leaves_one_percent() -> None:
    assert fraction_ceilings(alloc("tiny", 0, 1), 0, 16 * GIB) == (1, 16 * GIB // UNIT)


# --- the scheduler keeps the ceilings -----------------------------------------


def gpu() -> GpuScheduler:
    return GpuScheduler(SchedulerConfig(tq_us=3600 * 10**6, memory_total_bytes=16 * GIB))


def limits(s: GpuScheduler, sid: int = 1) -> tuple[int, int, int | None, int | None]:
    v = s.session(sid, 0)
    return v.core_limit, v.core_ceiling, v.mem_limit, v.mem_ceiling


def refused_unchanged(
    s: GpuScheduler, now: int, core_limit: int | None = None, mem_limit: int | None = None
) -> Refused:
    before = state_of(s)
    with pytest.raises(Refused) as err:
        s.set_limits(1, now, core_limit=core_limit, mem_limit=mem_limit)
    assert state_of(s) == before
    assert err.value.code == ErrorCode.PERMISSION_DENIED
    return err.value


def test_a_core_ceiling_may_be_reached_but_never_passed_without_authority() -> None:
    s = gpu()
    s.attach(1, 0, core_ceiling=30)
    assert limits(s) == (30, 30, None, None)  # attached at 100, cut to the ceiling
    err = refused_unchanged(s, 1 * MS, core_limit=50)
    assert "ceiling of 30 %" in err.message
    s.set_limits(1, 2 * MS, core_limit=20)
    assert limits(s) == (20, 30, None, None)
    s.set_limits(1, 3 * MS, core_limit=30)  # back up to the ceiling
    assert limits(s) == (30, 30, None, None)
    refused_unchanged(s, 4 * MS, core_limit=31)


def test_with_authority_a_new_limit_is_the_new_ceiling() -> None:
    s = gpu()
    s.attach(1, 0, core_ceiling=30)
    s.set_limits(1, 1 * MS, core_limit=80, authority=True)
    assert limits(s) == (80, 80, None, None)
    s.set_limits(1, 2 * MS, core_limit=10)
    s.set_limits(1, 3 * MS, core_limit=80)
    refused_unchanged(s, 4 * MS, core_limit=81)
    s.set_limits(1, 5 * MS, core_limit=5, authority=True)  # an admin may also lower the ceiling
    refused_unchanged(s, 6 * MS, core_limit=6)


def test_a_memory_ceiling_may_not_be_lifted_or_passed() -> None:
    s = gpu()
    s.attach(1, 0, mem_limit=8 * GIB, mem_ceiling=4 * GIB)
    assert limits(s) == (100, 100, 4 * GIB, 4 * GIB)  # asked for more than the ceiling: the ceiling
    err = refused_unchanged(s, 1 * MS, mem_limit=0)
    assert "lifting the memory limit" in err.message
    refused_unchanged(s, 2 * MS, mem_limit=4 * GIB + 1)
    refused_unchanged(s, 3 * MS, core_limit=50, mem_limit=0)  # all or nothing: the core part is not applied
    s.set_limits(1, 4 * MS, mem_limit=GIB)
    assert limits(s) == (100, 100, GIB, 4 * GIB)
    s.set_limits(1, 5 * MS, mem_limit=4 * GIB)
    assert limits(s)[2] == 4 * GIB


def test_an_admin_may_lift_a_memory_ceiling() -> None:
    s = gpu()
    s.attach(1, 0, mem_ceiling=4 * GIB)
    s.set_limits(1, 1 * MS, mem_limit=0, authority=True)
    assert limits(s) == (100, 100, None, None)
    s.set_limits(1, 2 * MS, mem_limit=12 * GIB)  # no ceiling left: anything goes
    assert limits(s)[2] == 12 * GIB


def test_without_a_ceiling_a_session_sets_what_it_likes() -> None:
    s = gpu()
    s.attach(1, 0, core_limit=20, mem_limit=GIB)
    s.set_limits(1, 1 * MS, core_limit=100, mem_limit=0)
    assert limits(s) == (100, 100, None, None)


def test_random_limit_changes_never_pass_a_ceiling() -> None:
    """Seeded sequences of set_limits with and without authority: the limits stay under the
    ceilings, and a refused call changes nothing."""
    rng = random.Random(7)
    for _ in range(20):
        s = gpu()
        s.attach(1, 0, core_ceiling=rng.randint(1, 100), mem_ceiling=rng.choice([None, 2 * GIB, 4 * GIB]))
        for step in range(1, 60):
            core_limit = rng.randint(1, 100) if rng.random() < 0.7 else None
            mem_limit = rng.choice([0, GIB, 3 * GIB, 8 * GIB]) if rng.random() < 0.5 else None
            authority = rng.random() < 0.15
            before = state_of(s)
            try:
                s.set_limits(1, step * MS, core_limit=core_limit, mem_limit=mem_limit, authority=authority)
            except Refused as exc:
                assert not authority and exc.code == ErrorCode.PERMISSION_DENIED
                assert state_of(s) == before
            core, core_ceiling, mem, mem_ceiling = limits(s)
            assert core <= core_ceiling
            assert mem_ceiling is None or (mem is not None and mem <= mem_ceiling)


# --- lease terms only tighten ---------------------------------------------------

POLICIES = {
    "T": LeasePolicy(60, BusyPolicy.WAIT, 1000, queue_limit=4, hold_max_ms=2000),
    "BARE": LeasePolicy(60, BusyPolicy.WAIT, 1000),
    "OTHER": LeasePolicy(50, BusyPolicy.WAIT, 3000),
}


def test_terms_above_the_policy_are_cut_to_it() -> None:
    t = resolve_terms("T", POLICIES, priority=99, max_wait_ms=5000, hold_max_ms=9000, queue_limit=10)
    assert (t.priority, t.max_wait_ms, t.hold_max_ms, t.queue_limit) == (60, 1000, 2000, 4)


def test_terms_below_the_policy_are_kept() -> None:
    t = resolve_terms("T", POLICIES, priority=10, max_wait_ms=100, hold_max_ms=500, queue_limit=2)
    assert (t.priority, t.max_wait_ms, t.hold_max_ms, t.queue_limit) == (10, 100, 500, 2)


def test_the_node_defaults_bound_a_policy_without_its_own() -> None:
    def bare(queue_limit: int | None = None, hold_max_ms: int | None = None) -> tuple[int, int]:
        t = resolve_terms(
            "BARE",
            POLICIES,
            queue_limit=queue_limit,
            hold_max_ms=hold_max_ms,
            default_queue_limit=5,
            default_hold_max_ms=3000,
        )
        return t.queue_limit, t.hold_max_ms

    assert bare(50, 10_000) == (5, 3000)
    assert bare(2, 1000) == (2, 1000)
    assert bare() == (5, 3000)


def test_an_unknown_task_type_is_bound_by_other() -> None:
    t = resolve_terms("ANYTHING", POLICIES, priority=99, max_wait_ms=60_000)
    assert (t.task_type, t.priority, t.max_wait_ms) == ("ANYTHING", 50, 3000)


# --- who may use a task type, and at what priority ------------------------------------------

OPEN = LeasePolicy(90, BusyPolicy.WAIT, 3000)
RESERVED = LeasePolicy(90, BusyPolicy.WAIT, 3000, uids=frozenset({1000}), gids=frozenset({20}))


def test_naming_a_task_type_gives_no_more_than_the_caller_may_declare() -> None:
    assert lease_priority("ASR", OPEN, 90, 2000, [], admin=False, ceiling=50) == 50
    assert lease_priority("ASR", OPEN, 40, 2000, [], admin=False, ceiling=50) == 40  # asked lower: kept
    assert lease_priority("ASR", OPEN, 90, 2000, [], admin=False, ceiling=95) == 90


def test_an_admin_gets_the_policys_priority() -> None:
    assert lease_priority("ASR", OPEN, 90, 0, [], admin=True, ceiling=ADMIN_PRIORITY) == 90
    assert lease_priority("ASR", RESERVED, 90, 0, [], admin=True, ceiling=ADMIN_PRIORITY) == 90


def test_a_reserved_policy_gives_its_priority_to_the_uids_and_groups_it_names() -> None:
    assert lease_priority("ASR", RESERVED, 90, 1000, [], admin=False, ceiling=50) == 90
    assert lease_priority("ASR", RESERVED, 90, 3000, [7, 20], admin=False, ceiling=50) == 90


def test_a_reserved_policy_refuses_anyone_else_and_says_who_may_use_it() -> None:
    with pytest.raises(Refused, match=r"task type ASR is reserved for uids \[1000\] and gids \[20\]") as exc:
        lease_priority("ASR", RESERVED, 90, 3000, [7], admin=False, ceiling=100)
    assert exc.value.code == ErrorCode.PERMISSION_DENIED
    assert "peer uid 3000" in str(exc.value)


# --- whose task, which tenant ---------------------------------------------------------------

TEAM = Members(uids=frozenset({1000}), gids=frozenset({20}))
OPEN_TENANT = Members()


def test_another_uids_task_is_refused_unless_admin_or_nobodys_yet() -> None:
    with pytest.raises(Refused, match="task 'etl' belongs to uid 1000: you may not ask for it") as exc:
        check_task_owner("etl", 1000, 2000, admin=False, what="ask for")
    assert exc.value.code == ErrorCode.PERMISSION_DENIED
    check_task_owner("etl", 1000, 1000, admin=False, what="ask for")
    check_task_owner("etl", 1000, 2000, admin=True, what="ask for")
    check_task_owner("etl", None, 2000, admin=False, what="ask for")


def test_only_a_tenants_members_allocate_as_it_and_an_open_tenant_takes_anyone() -> None:
    check_tenant("team", TEAM, 1000, 5, admin=False)
    check_tenant("team", TEAM, 3000, 20, admin=False)
    check_tenant("lab", OPEN_TENANT, 3000, 5, admin=False)
    check_tenant("team", TEAM, 3000, 5, admin=True)
    check_tenant("unknown", None, 3000, 5, admin=False)  # the ledger refuses an unknown tenant
    with pytest.raises(Refused, match="uid 3000 may not allocate as tenant 'team'"):
        check_tenant("team", TEAM, 3000, 5, admin=False)


def test_freeing_another_uids_task_needs_admin_or_being_listed_by_its_tenant() -> None:
    check_may_free("t", 1000, None, None, 1000, 5, admin=False)  # its own
    check_may_free("t", 1000, "team", TEAM, 3000, 20, admin=False)  # listed by gid
    check_may_free("t", 1000, None, None, 3000, 5, admin=True)
    for tenant, members in (("lab", OPEN_TENANT), (None, None), ("team", TEAM)):  # "anyone" frees nothing
        with pytest.raises(Refused, match="freeing it needs admin rights"):
            check_may_free("t", 1000, tenant, members, 3000, 5, admin=False)
