"""The order a pipeline posts its messages in (``pipeline/messages.py``): for every schedule on a grid
of sizes, the same at both ends of every pair of ranks (NCCL matches a pair's sends and receives by
order alone), every message once at each end, a send right after the action that produced it and a
receive before the action that reads it; a plan whose ends disagree is refused naming the pair."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from shardwise.pipeline.actions import transfers
from shardwise.pipeline.messages import check_same_order, message_order, plan, post_plan
from shardwise.pipeline.schedules import SCHEDULES, build, stage_placement
from shardwise.pipeline.tied import TiedExchange
from shardwise.pipeline.validate import ScheduleError, validate

VIRTUAL = {"1": [1], ">=2": [2, 3], "2": [2]}


def grid() -> list[tuple[str, int, int, int]]:
    cases = []
    for name, spec in SCHEDULES.items():
        sizes = itertools.product([2, 3, 4, 5], VIRTUAL[spec.virtual], [1, 2, 3, 4, 5, 7, 8, 12])
        cases.extend((name, pp, virtual, m) for pp, virtual, m in sizes)
    return cases


@pytest.mark.parametrize(("name", "pp", "virtual", "m"), grid())
def test_every_schedule_posts_its_messages_in_one_order_at_both_ends(
    name: str, pp: int, virtual: int, m: int
) -> None:
    schedule, where = build(name, pp, virtual, m), stage_placement(name, pp, virtual)
    plans = plan(schedule, where)
    assert check_same_order(plans) == validate(schedule, where, m).messages
    for rank, actions in schedule.items():
        posts = plans[rank]
        assert len(posts) == len(actions) + 1
        at = {t: i for i, boundary in enumerate(posts) for t in boundary}  # boundary i: before action i
        for index, (_, recvs, sends) in enumerate(transfers(rank, actions, where)):
            assert all(at[t] <= index for t in recvs), (rank, actions[index])  # before it reads them
            assert all(at[t] == index + 1 for t in sends), (rank, actions[index])  # right after
        assert sorted(at.values()) == list(at.values())  # posted in one order, boundary after boundary
        assert len(at) == sum(len(r) + len(s) for _, r, s in transfers(rank, actions, where))


@pytest.mark.parametrize(("name", "pp", "virtual", "m"), grid())
def test_early_receives_all_come_first_in_each_directions_order(
    name: str, pp: int, virtual: int, m: int
) -> None:
    """Over gloo every receive is posted at once: at the step's start where the rank's first action
    reads one, else (the first stage's rank) right after its first action's sends. Each direction of
    every pair still matches its messages in one order, the sends stay right after the actions
    producing them."""
    schedule, where = build(name, pp, virtual, m), stage_placement(name, pp, virtual)
    plans, early = plan(schedule, where), plan(schedule, where, early=True)
    assert check_same_order(early, directed=True) == check_same_order(plans)
    for rank, actions in schedule.items():
        at = 1 if actions[0].stage == 0 else 0  # the first stage's F reads nothing
        sends = [t for t in early[rank][at] if t.op == "send"]
        assert early[rank][at] == sends + [t for b in plans[rank] for t in b if t.op == "recv"]
        assert sends == [t for t in plans[rank][at] if t.op == "send"]
        assert [[t for t in b if t.op == "send"] for b in early[rank]] == [
            [t for t in b if t.op == "send"] for b in plans[rank]
        ]
        assert all(t.op == "send" for i, b in enumerate(early[rank]) if i != at for t in b)


def test_early_receives_break_the_one_order_nccl_needs() -> None:
    """Early plans are gloo's alone: a pair with messages both ways no longer posts them in one order."""
    schedule, where = build("1f1b", 2, 1, 4), stage_placement("1f1b", 2, 1)
    with pytest.raises(ScheduleError, match=r"^ranks 0 and 1 post their messages in different orders"):
        check_same_order(plan(schedule, where, early=True))


def test_a_v_is_read_in_another_order_than_it_is_produced_yet_posted_in_one() -> None:
    """In ZB-V rank 1 reads rank 0's activations of stage 0 and gradients of stage 3 in another order
    than rank 0 produces them, so receiving in reading order would cross the pair's messages (on
    NCCL: a gradient in an activation's buffer, or a hang); the plan posts them in production order."""
    schedule, where = build("zbv", 2, 2, 4), stage_placement("zbv", 2, 2)
    sent = [t.key for _, _, sends in transfers(0, schedule[0], where) for t in sends]
    read = [t.key for _, recvs, _ in transfers(1, schedule[1], where) for t in recvs]
    assert sorted(sent) == sorted(read) and sent != read
    plans = plan(schedule, where)
    posted_by_1 = [t.key for boundary in plans[1] for t in boundary if t.op == "recv"]
    assert posted_by_1 == sent


def test_ends_that_disagree_are_refused_naming_the_pair() -> None:
    schedule, where = build("1f1b", 3, 1, 4), stage_placement("1f1b", 3, 1)
    plans = plan(schedule, where)
    order = message_order(schedule, where)
    swapped = {key: order[key] for key in order}
    first, second = [t.key for boundary in plans[2] for t in boundary if t.op == "recv"][:2]
    swapped[first], swapped[second] = order[second], order[first]  # rank 2 alone receives them swapped
    plans[2] = post_plan(2, schedule[2], where, swapped)
    with pytest.raises(ScheduleError, match=r"^ranks 1 and 2 post their messages in different orders"):
        check_same_order(plans)


def _tied_end(owner: bool, rank: int, peer: int) -> TiedExchange:
    """A ``TiedExchange`` as the owner's or the copy's rank has it (no process group needed)."""
    end = object.__new__(TiedExchange)
    end.owner, end.tied = (object(), None) if owner else (None, object())  # type: ignore[assignment]
    end.comm, end.peer = SimpleNamespace(rank=rank), peer  # type: ignore[assignment]
    return end


@pytest.mark.parametrize(("name", "pp", "virtual", "m"), grid())
def test_the_tied_values_follow_the_same_message_at_both_ends(
    name: str, pp: int, virtual: int, m: int
) -> None:
    """Both ends of the tied weight find the same anchor, and it is the first message of their pair at
    both ends, so posting the values right after it keeps the pair's one order (NCCL's) and each
    direction's (gloo's); without an anchor both ends post the values first."""
    schedule, where = build(name, pp, virtual, m), stage_placement(name, pp, virtual)
    owner, copy = where[0], where[-1]
    if owner == copy:
        return  # one rank holds both ends (a V): nothing is sent
    for early in (False, True):
        plans = plan(schedule, where, early)
        anchor = _tied_end(True, owner, copy).values_anchor(plans[owner])
        assert _tied_end(False, copy, owner).values_anchor(plans[owner]) == anchor
        if anchor is None:
            continue
        for rank, peer in ((owner, copy), (copy, owner)):
            pair = [t.key for boundary in plans[rank] for t in boundary if t.peer == peer]
            assert pair[0] == anchor, (rank, early)


def _copy_end(rank: int, peer: int) -> TiedExchange:
    """The copy's end of a tied weight that trains."""
    end = _tied_end(False, rank, peer)
    end.tied = SimpleNamespace(copy=SimpleNamespace(requires_grad=True))  # type: ignore[assignment]
    return end


@pytest.mark.parametrize(("name", "pp", "virtual", "m"), grid())
def test_the_tied_gradient_leaves_once_whole_and_last_in_its_pair(
    name: str, pp: int, virtual: int, m: int
) -> None:
    """The copy's rank sends the tied gradient at the first boundary past both its last backward (B
    or I) of the last stage, which makes the gradient whole, and its last other message with the
    owner's rank, so it is the last message of their pair at both ends (the owner receives it after
    its last other message with that rank)."""
    schedule, where = build(name, pp, virtual, m), stage_placement(name, pp, virtual)
    owner, copy, last = where[0], where[-1], len(where) - 1
    if owner == copy:
        return
    for early in (False, True):
        plans = plan(schedule, where, early)
        at = _copy_end(copy, owner).send_boundary(schedule[copy], plans[copy], last)
        assert at is not None
        made = max(i + 1 for i, a in enumerate(schedule[copy]) if a.stage == last and a.kind.value in "BI")
        with_owner = [i for i, b in enumerate(plans[copy]) for t in b if t.peer == owner]
        assert at == max([made, *with_owner])
        assert all(t.peer != owner for b in plans[copy][at + 1 :] for t in b)


def test_zb_s_tied_gradient_leaves_before_the_w_passes_left_at_the_step_s_end() -> None:
    """On zb over 2 ranks the last stage runs its last I, then W passes: the gradient leaves between
    them, not after the last W (the first stage's update waits for it)."""
    schedule, where = build("zb", 2, 1, 4), stage_placement("zb", 2, 1)
    actions = schedule[1]
    at = _copy_end(1, 0).send_boundary(actions, plan(schedule, where, True)[1], 1)
    assert [str(a) for a in actions[at:]] == ["1W2", "1W3"]
    assert str(actions[at - 1]) == "1I3"


def test_the_copy_s_head_waits_for_the_values_when_it_starts() -> None:
    """The copy's end waits for the owner's values where the head that reads them starts its forward
    (a pre-hook), so the last stage's first F starts on its activation alone."""
    from torch import nn

    from shardwise.pipeline.split import Tied

    head = nn.Linear(3, 2, bias=False)
    copy = head.weight.detach().clone().requires_grad_(True)
    split = SimpleNamespace(tied_owner=None, tied=Tied("wte.weight", copy, head))
    waited: list[str] = []
    posted = SimpleNamespace(wait=lambda: waited.append("values"))
    comm = SimpleNamespace(rank=1, irecv=lambda *_: posted)
    end = TiedExchange(split, comm, [0, 1])  # type: ignore[arg-type]
    assert end.waits_in_head
    end.post_values(SimpleNamespace(), torch.float32)  # type: ignore[arg-type]
    assert waited == []
    head(torch.ones(1, 3))
    head(torch.ones(1, 3))
    assert waited == ["values"]  # once, at the first forward after the post


def test_a_head_that_never_runs_its_module_is_named() -> None:
    """An adapter whose head reads the copy without calling the module would read values still on
    their way: the last stage's F says so in one line instead."""
    from torch import nn

    from shardwise.pipeline.split import SplitError, Tied

    head = nn.Linear(3, 2, bias=False)
    split = SimpleNamespace(tied_owner=None, tied=Tied("wte.weight", head.weight.detach().clone(), head))
    comm = SimpleNamespace(rank=1, irecv=lambda *_: SimpleNamespace(wait=lambda: None))
    end = TiedExchange(split, comm, [0, 1])  # type: ignore[arg-type]
    end.post_values(SimpleNamespace(), torch.float32)  # type: ignore[arg-type]
    with pytest.raises(SplitError, match=r"^the last stage's forward ran without calling Linear"):
        end.check_values_read()
    head(torch.ones(1, 3))
    end.check_values_read()  # waited for at the head: nothing to say
