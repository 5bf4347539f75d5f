"""GPU node maintenance planned (handlers/rules/maintenance.py): nodes whose VMs fit go first, a
node that does not fit waits for the cards of nodes coming back, a card is reserved once, the
window and the concurrency limit hold or the plan says so, owners' answers change only what
they must and re-tell only the owners whose notice changed."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.rules.drains import RESTARTS_AFTER_DELETION
from handlers.rules.maintenance import (
    GPUVM,
    AfterMaintenance,
    Change,
    MaintenancePlan,
    MaintenanceRequest,
    OtherNode,
    PlannedNode,
    Refusal,
    name_order_baseline,
    no_wait_guaranteed,
    plan_maintenance,
    ready_now,
    reschedule,
    wanted_elsewhere,
)

PUBLISHED = datetime(2027, 1, 4, 8, 0, tzinfo=UTC)
NOTICE = timedelta(days=3)
HOURS = timedelta(hours=4)
START = PUBLISHED + NOTICE


def gpu_vm(uid: str, *, gpu: str = "a100", cards: int = 1, strategy: str = "Always",
           after: AfterMaintenance = "elsewhere", owner: str | None = None) -> GPUVM:
    return GPUVM(uid=uid, name=f"vm-{uid}", namespace="proj", owner=owner or f"{uid}@example.com",
                 gpus={gpu: cards}, run_strategy=strategy, after_maintenance=after)


def planned(name: str, *vms: GPUVM, capacity: int | None = None, gpu: str = "a100") -> PlannedNode:
    return PlannedNode(name, {gpu: capacity if capacity is not None else sum(vm.cards for vm in vms)}, vms)


def spare(name: str = "spare", **free: int) -> OtherNode:
    return OtherNode(name, free)


def request(*nodes: PlannedNode, others: tuple[OtherNode, ...] = (), concurrency: int = 1,
            slots: int = 10) -> MaintenanceRequest:
    """A window of ``slots`` node durations from the first moment the notice allows."""
    return MaintenanceRequest(nodes=nodes, others=others, earliest_start=START,
                              latest_end=START + slots * HOURS, concurrency=concurrency,
                              duration=HOURS, notice=NOTICE, published=PUBLISHED)


def order(plan: MaintenancePlan) -> list[tuple[str, datetime]]:
    return [(slot.node, slot.start) for slot in plan.slots]


def fates(plan: MaintenancePlan) -> dict[str, str]:
    return {entry.uid: entry.fate for entry in plan.vms}


# ------------------------------------------------------------------------------ the order


def test_a_node_whose_vms_fit_elsewhere_goes_before_one_whose_vms_do_not() -> None:
    """Name order drains a first: one of its VMs takes the spare card, the other b's free
    card, and is stopped again when b goes. b's VM fits the spare card, and b back gives a
    its cards."""
    a = planned("a", gpu_vm("a1"), gpu_vm("a2"))
    b = planned("b", gpu_vm("b1"), capacity=2)
    plan = plan_maintenance(request(a, b, others=(spare(a100=1),)))
    assert order(plan) == [("b", START), ("a", START + HOURS)]
    assert set(fates(plan).values()) == {"lands_elsewhere"}
    assert name_order_baseline(request(a, b, others=(spare(a100=1),))).totals.stopped_twice == 1


def test_a_node_that_would_not_fit_now_waits_for_the_cards_of_a_node_coming_back() -> None:
    """Two nodes may go at once, but one spare card serves only one of them: the other goes
    when the first is back, and its VM lands on the first's card."""
    plan = plan_maintenance(request(planned("a", gpu_vm("a1")), planned("b", gpu_vm("b1")),
                                    others=(spare(a100=1),), concurrency=2))
    assert order(plan) == [("a", START), ("b", START + HOURS)]
    assert plan.entry("b1").lands_on == "a" and plan.entry("b1").fate == "lands_elsewhere"


def test_nodes_go_together_when_the_cards_allow() -> None:
    plan = plan_maintenance(request(planned("a", gpu_vm("a1")), planned("b", gpu_vm("b1")),
                                    others=(spare(a100=2),), concurrency=2))
    assert order(plan) == [("a", START), ("b", START)]


def test_no_vm_lands_on_a_planned_node_still_to_go() -> None:
    """b's free cards are no landing while b is still to be drained: that VM would be stopped
    twice, as it is when the nodes are drained in name order."""
    a = planned("a", gpu_vm("a1"))
    b = planned("b", capacity=2)
    plan = plan_maintenance(request(a, b))
    assert order(plan) == [("b", START), ("a", START + HOURS)]
    assert plan.entry("a1").lands_on == "b" and plan.totals.stopped_twice == 0
    baseline = name_order_baseline(request(a, b))
    assert baseline.entry("a1").stops == 2 and baseline.totals.stopped_twice == 1


def test_with_nothing_to_give_cards_back_a_node_goes_and_its_vm_is_flagged_before_the_plan_starts() -> None:
    plan = plan_maintenance(request(planned("a", gpu_vm("a1"), capacity=2), planned("b", gpu_vm("b1"))))
    entry = plan.entry("a1") if plan.slot("a").start == START else plan.entry("b1")
    assert entry.fate == "waits_for_card" and "no free card" in entry.reason
    assert entry.told_at == PUBLISHED and plan.totals.waiting == 1


def test_the_node_that_goes_without_cards_is_the_one_leaving_the_fewest_vms_waiting() -> None:
    """b first: its VM waits, then takes one of b's two cards back, and one of a's finds the
    other. a first would leave both of a's VMs waiting, and b's after them."""
    plan = plan_maintenance(request(planned("a", gpu_vm("a1"), gpu_vm("a2")), planned("b", gpu_vm("b1"), capacity=2)))
    assert order(plan) == [("b", START), ("a", START + HOURS)]
    assert plan.totals.waiting == 2


def test_the_window_makes_nodes_go_together_rather_than_wait_for_cards() -> None:
    """Waiting for a's card would take b out of the window: both go at once, b's VM is flagged."""
    plan = plan_maintenance(request(planned("a", gpu_vm("a1")), planned("b", gpu_vm("b1")),
                                    others=(spare(a100=1),), concurrency=2, slots=1))
    assert order(plan) == [("a", START), ("b", START)]
    assert sorted(fates(plan).values()) == ["lands_elsewhere", "waits_for_card"]
    assert not plan.totals.outside_window


def test_a_plan_longer_than_its_window_says_which_nodes_and_vms_fall_outside() -> None:
    plan = plan_maintenance(request(planned("a", gpu_vm("a1")), planned("b", gpu_vm("b1")),
                                    planned("c", gpu_vm("c1")), others=(spare(a100=1),), slots=2))
    assert plan.totals.outside_window == ("c",)
    assert [entry.uid for entry in plan.vms if entry.outside_window] == ["c1"]


def test_owners_get_their_notice_before_the_first_node_goes() -> None:
    early = MaintenanceRequest(nodes=(planned("a", gpu_vm("a1")),), others=(spare(a100=1),),
                               earliest_start=PUBLISHED, latest_end=PUBLISHED + timedelta(days=10),
                               concurrency=1, duration=HOURS, notice=NOTICE, published=PUBLISHED)
    plan = plan_maintenance(early)
    assert plan.slot("a").start == PUBLISHED + NOTICE
    assert plan.entry("a1").stop - plan.entry("a1").told_at == NOTICE


# ------------------------------------------------------------------------------ the fates


def test_vms_kubevirt_starts_again_land_elsewhere_the_others_stay_off() -> None:
    vms = [gpu_vm(strategy, strategy=strategy) for strategy in RESTARTS_AFTER_DELETION]
    plan = plan_maintenance(request(planned("a", *vms), others=(spare(a100=5),)))
    assert fates(plan) == {strategy: "lands_elsewhere" if restarts else "stays_off"
                           for strategy, restarts in RESTARTS_AFTER_DELETION.items()}


def test_a_vm_wanted_back_on_its_node_keeps_its_card_there_and_starts_when_the_node_is_back() -> None:
    """a goes first (none of its VMs wants a card elsewhere); its card stays its own VM's,
    so b's VM finds none."""
    home = gpu_vm("home", strategy="Manual", after="same_node")
    plan = plan_maintenance(request(planned("a", home), planned("b", gpu_vm("b1"))))
    assert plan.entry("home").fate == "back_on_own_node"
    assert plan.entry("home").back_at == plan.slot("a").end
    assert plan.entry("home").hours_without_gpu == 4.0
    assert plan.entry("b1").fate == "waits_for_card"


def test_a_vm_that_stays_off_gives_its_card_to_the_next_node() -> None:
    off = gpu_vm("off", after="stay_off")
    plan = plan_maintenance(request(planned("a", off), planned("b", gpu_vm("b1"))))
    assert fates(plan) == {"off": "stays_off", "b1": "lands_elsewhere"}
    assert plan.entry("b1").lands_on == "a"


def test_a_vm_of_two_cards_needs_them_on_one_node() -> None:
    plan = plan_maintenance(request(planned("a", gpu_vm("big", cards=2)),
                                    others=(spare("s1", a100=1), spare("s2", a100=1))))
    assert plan.entry("big").fate == "waits_for_card"


def test_a_waiting_vm_takes_the_first_card_given_back() -> None:
    plan = plan_maintenance(request(planned("a", gpu_vm("a1"), capacity=2), planned("b", gpu_vm("b1"))))
    first, second = plan.slots
    waiting = next(entry for entry in plan.vms if entry.fate == "waits_for_card")
    assert waiting.node == first.node and waiting.back_at == first.end
    assert waiting.hours_without_gpu == 4.0


def test_the_plan_is_the_same_every_time() -> None:
    made = request(planned("b", gpu_vm("b1"), gpu_vm("b2")), planned("a", gpu_vm("a1")),
                   planned("c", gpu_vm("c1", strategy="Manual")), others=(spare(a100=2),), concurrency=2)
    assert plan_maintenance(made) == plan_maintenance(made)


# ------------------------------------------------------------------------------ owners' answers


def two_nodes() -> MaintenancePlan:
    """a at START, b at START + 4 h; alice on a, bob and carol on b; three spare cards."""
    return plan_maintenance(request(
        planned("a", gpu_vm("a1", owner="alice")),
        planned("b", gpu_vm("b1", owner="bob"), gpu_vm("b2", owner="carol")),
        others=(spare(a100=3),), concurrency=1))


def test_a_node_moved_re_tells_only_its_owners() -> None:
    plan = two_nodes()
    assert order(plan) == [("a", START), ("b", START + HOURS)]
    change = reschedule(plan, "b", START + 2 * HOURS, now=PUBLISHED)
    assert isinstance(change, Change)
    assert change.owners == {"bob", "carol"}
    assert order(change.plan) == [("a", START), ("b", START + 2 * HOURS)]


def test_a_move_that_breaks_the_concurrency_limit_is_refused() -> None:
    refused = reschedule(two_nodes(), "b", START + HOURS / 2, now=PUBLISHED)
    assert isinstance(refused, Refusal) and "at most 1" in refused.reason


def test_a_move_outside_the_window_is_refused() -> None:
    refused = reschedule(two_nodes(), "b", START + 10 * HOURS, now=PUBLISHED)
    assert isinstance(refused, Refusal) and "window" in refused.reason


def test_a_move_that_shortens_the_owners_notice_is_refused() -> None:
    refused = reschedule(two_nodes(), "b", START + 2 * HOURS, now=START)
    assert isinstance(refused, Refusal) and "notice" in refused.reason


def test_a_move_that_takes_a_promised_card_is_refused() -> None:
    """b's VM lands on a's card once a is back: b cannot go before that."""
    plan = plan_maintenance(request(planned("a", gpu_vm("a1")), planned("b", gpu_vm("b1")),
                                    others=(spare(a100=1),), concurrency=2))
    refused = reschedule(plan, "b", START + HOURS / 2, now=PUBLISHED)
    assert isinstance(refused, Refusal) and "no free card" in refused.reason


def test_a_vm_stopped_earlier_re_tells_only_its_owner() -> None:
    change = reschedule(two_nodes(), "b1", START, now=PUBLISHED)
    assert isinstance(change, Change) and change.owners == {"bob"}
    assert change.plan.entry("b1").stop == START and change.plan.slot("b").start == START + HOURS


def test_a_vm_asking_for_a_later_slot_moves_its_node() -> None:
    change = reschedule(two_nodes(), "a1", START + 2 * HOURS, now=PUBLISHED)
    assert isinstance(change, Change) and change.owners == {"alice"}
    assert change.plan.slot("a").start == START + 2 * HOURS


def test_nothing_is_moved_into_the_past() -> None:
    plan = plan_maintenance(request(planned("a", gpu_vm("a1")), planned("empty", capacity=1), others=(spare(a100=1),)))
    for target in ("empty", "a1"):
        refused = reschedule(plan, target, START, now=START + HOURS)
        assert isinstance(refused, Refusal) and "has passed" in refused.reason


def test_an_unknown_target_is_refused() -> None:
    assert isinstance(reschedule(two_nodes(), "nowhere", START, now=PUBLISHED), Refusal)


def test_a_vm_ready_now_is_stopped_now() -> None:
    now = PUBLISHED + timedelta(days=1)
    change = ready_now(two_nodes(), "b1", now)
    assert isinstance(change, Change) and change.owners == {"bob"}
    assert change.plan.entry("b1").stop == now and change.plan.slot("b").start == START + HOURS


def test_a_node_whose_owners_are_all_ready_goes_early() -> None:
    """The window opens a day after the plan is made; the notice would hold b until day 3,
    but its owners are all ready on day 2."""
    made = MaintenanceRequest(
        nodes=(planned("a", gpu_vm("a1", owner="alice")),
               planned("b", gpu_vm("b1", owner="bob"), gpu_vm("b2", owner="carol"))),
        others=(spare(a100=3),), earliest_start=PUBLISHED + timedelta(days=1), latest_end=START + 10 * HOURS,
        concurrency=1, duration=HOURS, notice=NOTICE, published=PUBLISHED)
    now = PUBLISHED + timedelta(days=2)
    first = ready_now(plan_maintenance(made), "b1", now)
    assert isinstance(first, Change) and first.plan.slot("b").start == START + HOURS
    change = ready_now(first.plan, "b2", now)
    assert isinstance(change, Change) and change.owners == {"carol"}
    assert change.plan.slot("b").start == now


def test_a_node_whose_owners_are_all_ready_keeps_its_slot_when_the_limit_is_reached() -> None:
    first = ready_now(two_nodes(), "b1", START - HOURS)
    assert isinstance(first, Change)
    change = ready_now(first.plan, "b2", START - HOURS)
    assert isinstance(change, Change) and change.owners == {"carol"}
    assert change.plan.slot("b").start == START + HOURS  # a is in maintenance until then


def test_a_vm_ready_now_without_a_card_free_now_is_refused() -> None:
    plan = plan_maintenance(request(planned("a", gpu_vm("a1")), planned("b", gpu_vm("b1")),
                                    others=(spare(a100=1),), concurrency=2))
    refused = ready_now(plan, "b1", START)
    assert isinstance(refused, Refusal) and "no free card" in refused.reason


# ------------------------------------------------------------------------------ properties

CLASSES = ("a100", "l40s")
STRATEGIES = tuple(RESTARTS_AFTER_DELETION)
AFTER: tuple[AfterMaintenance, ...] = ("elsewhere", "same_node", "stay_off")


@st.composite
def requests(draw: st.DrawFn, *, guaranteed: bool = False) -> MaintenanceRequest:
    """A small AZ, its nodes of one or two classes. ``guaranteed``: one card per VM, spare cards for any one node's VMs of each
    class, and a window for every node one after another — the guarantee's conditions."""
    nodes = []
    for n in range(draw(st.integers(1, 5))):
        capacity = {gpu: draw(st.integers(1, 4)) for gpu in draw(st.sets(st.sampled_from(CLASSES), min_size=1))}
        vms: list[GPUVM] = []
        held: Counter[str] = Counter()
        for i in range(draw(st.integers(0, sum(capacity.values())))):
            gpu = draw(st.sampled_from(sorted(capacity)))
            cards = 1 if guaranteed else draw(st.integers(1, 2))
            if held[gpu] + cards > capacity[gpu]:
                continue
            held[gpu] += cards
            vms.append(gpu_vm(f"n{n}v{i}", gpu=gpu, cards=cards, strategy=draw(st.sampled_from(STRATEGIES)),
                              after=draw(st.sampled_from(AFTER)), owner=f"owner{draw(st.integers(0, 3))}"))
        nodes.append(PlannedNode(f"n{n}", capacity, tuple(vms)))
    others = tuple(OtherNode(f"o{i}", {gpu: draw(st.integers(0, 3)) for gpu in CLASSES})
                   for i in range(draw(st.integers(0, 3))))
    slots = len(nodes) if guaranteed else draw(st.integers(1, 2 * len(nodes)))
    made = request(*nodes, others=others, concurrency=draw(st.integers(1, 3)), slots=slots)
    if guaranteed:
        largest: Counter[str] = Counter()
        for node in nodes:
            largest |= wanted_elsewhere(node)
        topped = OtherNode("topped-up", {gpu: largest[gpu] for gpu in CLASSES})
        made = request(*nodes, others=(*others, topped), concurrency=made.concurrency, slots=slots)
        assert no_wait_guaranteed(made)
    return made


def assert_never_over_reserved(plan: MaintenancePlan) -> None:
    """On every node a VM lands on, the cards its VMs take, of each class, are at most those
    free there, and none is taken before the node is available."""
    request = plan.request
    free = {other.name: Counter(other.free) for other in request.others}
    free |= {node.name: Counter(node.capacity) for node in request.nodes}
    available = {slot.node: slot.end for slot in plan.slots}
    taken: dict[str, Counter[str]] = {}
    for entry in plan.vms:
        if entry.lands_on is None:
            continue
        assert entry.back_at is not None and entry.back_at >= entry.stop
        if entry.lands_on in available:
            assert entry.back_at >= available[entry.lands_on]
        taken.setdefault(entry.lands_on, Counter()).update(entry.gpus)
    for node, cards in taken.items():
        assert all(count <= free[node][gpu] for gpu, count in cards.items()), (node, cards, free[node])


def assert_within_limits(plan: MaintenancePlan) -> None:
    request = plan.request
    for slot in plan.slots:
        during = [other for other in plan.slots if other.start <= slot.start < other.end]
        assert len(during) <= request.concurrency
        inside = request.earliest_start <= slot.start and slot.end <= request.latest_end
        assert slot.outside_window == (not inside)
        ready = all(entry.uid in plan.ready for entry in plan.vms if entry.node == slot.node)
        assert slot.start >= request.start or (ready and slot.start >= request.earliest_start)
    assert sorted(slot.node for slot in plan.slots) == sorted(node.name for node in request.nodes)
    for entry in plan.vms:
        assert entry.told_at <= entry.stop <= plan.slot(entry.node).start


@settings(max_examples=200, deadline=None)
@given(requests())
def test_a_plan_never_reserves_a_card_twice_and_keeps_its_limits(made: MaintenanceRequest) -> None:
    plan = plan_maintenance(made)
    assert_never_over_reserved(plan)
    assert_within_limits(plan)
    assert len(plan.vms) == sum(len(node.vms) for node in made.nodes)


@settings(max_examples=200, deadline=None)
@given(requests(guaranteed=True))
def test_under_the_guarantee_no_vm_waits_for_a_card(made: MaintenanceRequest) -> None:
    plan = plan_maintenance(made)
    assert plan.totals.waiting == 0
    assert not plan.totals.outside_window


@settings(max_examples=200, deadline=None)
@given(requests(), st.data())
def test_an_answer_re_tells_exactly_the_owners_whose_notice_changed(made: MaintenanceRequest,
                                                                    data: st.DataObject) -> None:
    """Another slot for a node or a VM, or a VM ready now: the other nodes keep their slots,
    the other VMs their stops, no VM loses its card, and the owners told again are exactly
    those whose notice changed."""
    plan = plan_maintenance(made)
    nodes = [slot.node for slot in plan.slots]
    target = data.draw(st.sampled_from(nodes + [entry.uid for entry in plan.vms]))
    at = made.start + data.draw(st.integers(-2 * len(made.nodes), 4 * len(made.nodes))) * made.duration / 2
    if target in nodes or not data.draw(st.booleans()):
        answer = reschedule(plan, target, at, now=PUBLISHED)
    else:
        answer = ready_now(plan, target, max(at, PUBLISHED))
    if isinstance(answer, Refusal):
        assert answer.reason
        return
    new = answer.plan
    before = {entry.uid: entry for entry in plan.vms}
    assert answer.owners == {entry.owner for entry in new.vms if entry.notice != before[entry.uid].notice}
    moved = target if target in nodes else plan.entry(target).node
    assert {slot for slot in new.slots if slot.node != moved} == {slot for slot in plan.slots if slot.node != moved}
    for entry in new.vms:
        if entry.node != moved and entry.uid != target:
            assert entry.stop == before[entry.uid].stop
        if before[entry.uid].fate != "waits_for_card":
            assert entry.fate != "waits_for_card"
    assert_never_over_reserved(new)
    assert_within_limits(new)


@settings(max_examples=200, deadline=None)
@given(requests(), st.data())
def test_a_node_kept_where_it_is_changes_nothing(made: MaintenanceRequest, data: st.DataObject) -> None:
    """An answer re-plays the whole plan: it must find what the plan found, card for card."""
    plan = plan_maintenance(made)
    slot = data.draw(st.sampled_from(plan.slots))
    answer = reschedule(plan, slot.node, slot.start, now=PUBLISHED)
    if slot.outside_window:
        assert isinstance(answer, Refusal)
        return
    assert isinstance(answer, Change) and answer.owners == frozenset()
    assert answer.plan.vms == plan.vms and answer.plan.slots == plan.slots
