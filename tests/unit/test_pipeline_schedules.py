"""Pipeline schedules as data: notation, placement, the registry's refusals, every schedule valid on a grid
(fewer micro-batches than stages and one micro-batch included), the same order as torch 2.13 where torch
has the schedule, and the validator catching what it must (missing, twice, wrong order, deadlock)."""

from __future__ import annotations

import itertools
import re
from types import SimpleNamespace

import pytest

from shardwise.pipeline.actions import (
    Action,
    Kind,
    format_actions,
    format_schedule,
    parse_action,
    parse_actions,
    parse_schedule,
    transfers,
)
from shardwise.pipeline.schedules import (
    SCHEDULES,
    ScheduleConfigError,
    build,
    check,
    main,
    placement,
    stage_placement,
)
from shardwise.pipeline.validate import ScheduleError, validate

# the paper's letters (Qi et al. 2023): I is the input gradient
F, B, I, W = Kind.FORWARD, Kind.BACKWARD, Kind.INPUT_GRAD, Kind.WEIGHT_GRAD  # noqa: E741
VIRTUAL = {"1": [1], ">=2": [2, 3], "2": [2]}


def grid() -> list[tuple[str, int, int, int]]:
    cases = []
    for name, spec in SCHEDULES.items():
        sizes = itertools.product([1, 2, 3, 4, 5], VIRTUAL[spec.virtual], [1, 2, 3, 4, 5, 7, 8, 12])
        cases.extend((name, pp, virtual, m) for pp, virtual, m in sizes)
    return cases


# ---------------------------------------------------------------------------------------- notation


def test_action_prints_and_parses_back() -> None:
    assert str(Action(0, F, 1)) == "0F1"
    assert str(Action(12, W, 30)) == "12W30"
    text = "0F0 0F1 0B0 3I2 3W2"
    assert format_actions(parse_actions(text)) == text
    assert parse_action(" 1B3 ") == Action(1, B, 3)


@pytest.mark.parametrize("bad", ["", "F0", "0X1", "0F", "-1F0", "0F0x"])
def test_bad_action_is_refused_in_one_line(bad: str) -> None:
    with pytest.raises(ValueError, match=re.escape("write <stage><F|B|I|W><micro-batch>")) as info:
        parse_action(bad)
    assert "\n" not in str(info.value)


def test_schedule_prints_and_parses_back() -> None:
    schedule = build("interleaved-zb", 2, 2, 3)
    assert parse_schedule(format_schedule(schedule)) == schedule
    with pytest.raises(ValueError, match="rank <r>"):
        parse_schedule("rnk 0: 0F0")


# --------------------------------------------------------------------------------------- placement


def test_loop_placement_is_round_robin() -> None:
    assert placement("loop", 4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert stage_placement("interleaved", 3, 3) == (0, 1, 2) * 3


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_v_placement_holds_r_and_2p_minus_1_minus_r(pp: int) -> None:
    where = stage_placement("zbv", pp, 2)
    assert stage_placement("dualpipev", pp, 2) == where
    for rank in range(pp):
        assert [s for s, r in enumerate(where) if r == rank] == [rank, 2 * pp - 1 - rank]


def test_v_turn_exchanges_nothing_on_its_rank() -> None:
    pp = 3
    where = stage_placement("zbv", pp, 2)
    last_rank = build("zbv", pp, 2, 4)[pp - 1]
    messages = [t for _, recvs, sends in transfers(pp - 1, last_rank, where) for t in recvs + sends]
    assert all(t.peer != pp - 1 for t in messages)
    # stage p-1's output goes to stage p on the same rank: no activation of stage p-1 is sent
    assert not any(t.op == "send" and t.what == "activation" and t.stage == pp - 1 for t in messages)


def test_transfers_of_a_middle_stage() -> None:
    where = stage_placement("1f1b", 3, 1)
    (_, f_recv, f_send), (_, b_recv, b_send) = transfers(1, [Action(1, F, 0), Action(1, B, 0)], where)
    assert [(t.op, t.peer, t.what, t.stage) for t in f_recv + f_send] == [
        ("recv", 0, "activation", 0),
        ("send", 2, "activation", 1),
    ]
    assert [(t.op, t.peer, t.what, t.stage) for t in b_recv + b_send] == [
        ("recv", 2, "gradient", 2),
        ("send", 0, "gradient", 1),
    ]


# ---------------------------------------------------------------------------------------- registry


def test_registry_has_the_flag_names() -> None:
    assert list(SCHEDULES) == ["gpipe", "1f1b", "interleaved", "zb", "interleaved-zb", "zbv", "dualpipev"]


@pytest.mark.parametrize(
    ("name", "pp", "virtual", "m", "expected"),
    [
        ("interleaved", 4, 1, 8, "--virtual-stages must be >= 2"),
        ("interleaved-zb", 2, 1, 8, "--virtual-stages must be >= 2"),
        ("zbv", 4, 3, 8, r"stages r and 2\*4-1-r\): --virtual-stages must be 2, got 3 \(4 x 3 = 12 stages\)"),
        ("dualpipev", 2, 1, 8, "--virtual-stages must be 2, got 1"),
        ("1f1b", 2, 2, 8, "--virtual-stages must be 1, got 2"),
        ("gpipe", 2, 1, 0, "micro-batches >= 1"),
        ("1f1b", 0, 1, 4, "pp >= 1"),
        ("pipedream", 2, 1, 4, "choose one of gpipe, 1f1b"),
    ],
)
def test_impossible_configurations_are_refused_with_the_arithmetic(
    name: str, pp: int, virtual: int, m: int, expected: str
) -> None:
    with pytest.raises(ScheduleConfigError, match=expected) as info:
        check(name, pp, virtual, m)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------- every schedule valid


@pytest.mark.parametrize(("name", "pp", "virtual", "m"), grid())
def test_every_schedule_validates(name: str, pp: int, virtual: int, m: int) -> None:
    schedule = build(name, pp, virtual, m)
    report = validate(schedule, stage_placement(name, pp, virtual), m)
    kinds = {a.kind for acts in schedule.values() for a in acts}
    if name == "dualpipev":  # full backwards in the steady state, split ones at the end
        assert F in kinds and kinds <= {F, B, I, W}
    elif SCHEDULES[name].splits_backward:
        assert kinds == {F, I, W}
    else:
        assert kinds == {F, B}
    assert all(peak >= 1 for peak in report.peak_in_flight.values())


def test_the_first_stages_i_followed_by_its_own_w_runs_as_one_b() -> None:
    """The runtime's ``fuse_weight_passes``: only on stage 0, whose I sends nothing ahead of its W."""
    from shardwise.pipeline.actions import fuse_weight_passes, parse_actions

    fused = fuse_weight_passes(parse_actions("0F0 0I0 0W0 0F1 1I1 1W1 0I1 1W0 0W1 0I2 0W2"))
    assert " ".join(map(str, fused)) == "0F0 0B0 0F1 1I1 1W1 0I1 1W0 0W1 0B2"
    zb = {rank: fuse_weight_passes(acts) for rank, acts in build("zb", 2, 1, 4).items()}
    assert {a.kind for a in zb[0]} == {F, B} and {a.kind for a in zb[1]} == {F, I, W}


@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 9])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_activation_memory(pp: int, m: int) -> None:
    """GPipe holds every micro-batch; 1F1B min(m, p-r); ZB-H1 and ZB-V stay at 1F1B's peak."""
    gpipe = validate(build("gpipe", pp, 1, m), stage_placement("gpipe", pp, 1), m)
    assert gpipe.peak_in_flight == {r: m for r in range(pp)}
    one = validate(build("1f1b", pp, 1, m), stage_placement("1f1b", pp, 1), m)
    assert one.peak_in_flight == {r: min(m, pp - r) for r in range(pp)}
    assert one.peak_held == one.peak_in_flight
    zb = validate(build("zb", pp, 1, m), stage_placement("zb", pp, 1), m)
    assert max(zb.peak_held.values()) == max(one.peak_held.values())
    zbv = validate(build("zbv", pp, 2, m), stage_placement("zbv", pp, 2), m)
    # a V chunk is half a rank's layers: 2p chunks held = p stages' worth, 1F1B's peak
    assert max(zbv.peak_held.values()) <= 2 * min(m, pp)


def test_1f1b_is_the_pipedream_flush_order() -> None:
    """p = 4, m = 6: the order of Narayanan et al. 2021, figure 4 (top), as torch's Schedule1F1B runs it."""
    assert format_schedule(build("1f1b", 4, 1, 6)) == "\n".join(
        [
            "rank 0: 0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5",
            "rank 1: 1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1B4 1B5",
            "rank 2: 2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2B5",
            "rank 3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5",
        ]
    )
    # fewer micro-batches than stages (torch refuses): all forwards, then all backwards
    assert format_schedule(build("1f1b", 4, 1, 2)).splitlines()[0] == "rank 0: 0F0 0F1 0B0 0B1"


# --------------------------------------------------------------------------------- against torch 2.13


def torch_order(name: str, pp: int, virtual: int, m: int) -> dict[int, list[str]] | None:
    """torch's per-rank compute order (overlapped pairs listed F then B), or None where torch refuses."""
    ts = pytest.importorskip("torch.distributed.pipelining.schedules")
    if name in ("interleaved", "interleaved-zb", "zb"):
        rounds = max(1, m // pp)
        if m % rounds:
            return None
        cls = ts.ScheduleInterleaved1F1B if name == "interleaved" else ts.ScheduleInterleavedZeroBubble
        fake = SimpleNamespace(
            n_local_stages=virtual, pp_group_size=pp, microbatches_per_round=m // rounds, _n_microbatches=m
        )
    else:
        if name == "dualpipev" and m < 2 * pp:
            return None
        cls = ts.ScheduleZBVZeroBubble if name == "zbv" else ts.ScheduleDualPipeV
        fake = SimpleNamespace(pp_group_size=pp, num_stages=2 * pp, _n_microbatches=m)
    order = {}
    for rank in range(pp):
        ops = cls._calculate_single_rank_operations(fake, rank)
        flat = []
        for op in ops:
            if op is not None:
                flat.extend(str(sub) for sub in (op.sub_actions or (op,)))
        order[rank] = flat
    return order


@pytest.mark.parametrize(
    ("name", "virtual"),
    [
        ("interleaved", 2),
        ("interleaved", 3),
        ("interleaved-zb", 2),
        ("interleaved-zb", 3),
        ("zb", 1),
        ("zbv", 2),
        ("dualpipev", 2),
    ],
)
def test_same_order_as_torch(name: str, virtual: int) -> None:
    """Where torch 2.13 accepts the sizes, our lists are its lists (its idle slots dropped); ZB-H1 is
    torch's interleaved zero-bubble with one stage per rank."""
    compared = 0
    for pp, m in itertools.product([1, 2, 3, 4], range(1, 13)):
        theirs = torch_order(name, pp, virtual, m)
        if theirs is None:
            continue
        ours = {rank: [str(a) for a in acts] for rank, acts in build(name, pp, virtual, m).items()}
        assert ours == theirs, (name, pp, virtual, m)
        compared += 1
    assert compared >= 24


# ----------------------------------------------------------------------------------- validator faults


def one_f_one_b(pp: int = 2, m: int = 2) -> dict[int, list[Action]]:
    return build("1f1b", pp, 1, m)


def test_missing_action_is_named() -> None:
    schedule = one_f_one_b(3, 3)
    schedule[1].remove(Action(1, B, 2))
    with pytest.raises(ScheduleError, match=r"1 actions are missing: 1B2"):
        validate(schedule, stage_placement("1f1b", 3, 1), 3)


def test_missing_weight_gradient_is_named() -> None:
    schedule = build("zb", 2, 1, 2)
    schedule[0].remove(Action(0, W, 1))
    with pytest.raises(ScheduleError, match=r"missing: 0W1"):
        validate(schedule, stage_placement("zb", 2, 1), 2)


def test_action_twice_is_named() -> None:
    schedule = one_f_one_b()
    schedule[0].append(Action(0, F, 1))
    with pytest.raises(ScheduleError, match=r"more than once: 0F1"):
        validate(schedule, stage_placement("1f1b", 2, 1), 2)


def test_full_and_split_backward_together_is_refused() -> None:
    schedule = one_f_one_b()
    schedule[0] += [Action(0, I, 0), Action(0, W, 0)]
    with pytest.raises(ScheduleError, match="both a full backward and a split one: 0B0"):
        validate(schedule, stage_placement("1f1b", 2, 1), 2)


def test_action_on_the_wrong_rank_is_refused() -> None:
    schedule = one_f_one_b()
    schedule[0], schedule[1] = schedule[1], schedule[0]
    with pytest.raises(ScheduleError, match="rank 0 runs 1F0, but stage 1 is placed on rank 1"):
        validate(schedule, stage_placement("1f1b", 2, 1), 2)


@pytest.mark.parametrize(
    ("rank0", "message"),
    [
        ("0B0 0F0 0F1 0B1", r"wrong order on rank 0: 0B0 \(position 0\) comes before 0F0 \(position 1\)"),
        ("0F0 0F1 0W0 0I0 0I1 0W1", r"wrong order on rank 0: 0W0 \(position 2\) comes before 0I0"),
    ],
)
def test_wrong_order_on_a_rank(rank0: str, message: str) -> None:
    split = "W" in rank0
    rank1 = "1F0 1I0 1W0 1F1 1I1 1W1" if split else "1F0 1B0 1F1 1B1"
    with pytest.raises(ScheduleError, match=message):
        validate({0: parse_actions(rank0), 1: parse_actions(rank1)}, (0, 1), 2)


def test_wrong_order_across_a_v_turn() -> None:
    """Stages 0 and 1 on one rank (zbv with p = 1): stage 1's forward needs stage 0's first."""
    schedule = {0: parse_actions("1F0 0F0 1B0 0B0")}
    with pytest.raises(ScheduleError, match=r"wrong order on rank 0: 1F0 \(position 0\) comes before 0F0"):
        validate(schedule, (0, 0), 1)


def test_deadlock_is_named_with_its_cycle() -> None:
    """Rank 0 finishes micro-batch 0 first, rank 1 micro-batch 1 first: each waits for the other."""
    schedule = {0: parse_actions("0F0 0B0 0F1 0B1"), 1: parse_actions("1F1 1B1 1F0 1B0")}
    with pytest.raises(ScheduleError) as info:
        validate(schedule, (0, 1), 2)
    assert str(info.value) == (
        "deadlock: rank 0 waits at 0B0 for 1B0 (rank 1), rank 1 waits at 1F1 for 0F1 (rank 0)"
    )


def test_deadlock_through_three_ranks() -> None:
    """Interleaved on 3 ranks with rank 0's second chunk moved first: 3F0 waits around the whole ring."""
    schedule = build("interleaved", 3, 2, 1)
    schedule[0].remove(Action(3, F, 0))
    schedule[0].insert(0, Action(3, F, 0))
    with pytest.raises(ScheduleError) as info:
        validate(schedule, stage_placement("interleaved", 3, 2), 1)
    assert str(info.value) == (
        "deadlock: rank 0 waits at 3F0 for 2F0 (rank 2), rank 2 waits at 2F0 for 1F0 (rank 1), "
        "rank 1 waits at 1F0 for 0F0 (rank 0)"
    )


def test_the_valid_reference_of_the_deadlock_passes() -> None:
    """The same actions in a consistent order run: the validator objects to the order, nothing else."""
    schedule = {0: parse_actions("0F0 0B0 0F1 0B1"), 1: parse_actions("1F0 1B0 1F1 1B1")}
    report = validate(schedule, (0, 1), 2)
    assert report.messages == 4


def test_message_count_between_ranks() -> None:
    """One stage per rank: an activation and a gradient per micro-batch and link; in a V, only the two
    links between ranks carry messages (the turn stays on its rank)."""
    for name in ("gpipe", "1f1b", "zb"):
        report = validate(build(name, 4, 1, 6), stage_placement(name, 4, 1), 6)
        assert report.messages == 2 * 3 * 6  # 3 links, an activation and a gradient per micro-batch
    zbv = validate(build("zbv", 2, 2, 4), stage_placement("zbv", 2, 2), 4)
    assert zbv.messages == 2 * 2 * 4  # 2 cross-rank links in the V (0-1, 2-3)


def test_printer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["1f1b", "4", "1", "8"]) == 0
    out = capsys.readouterr().out
    assert "rank 3: 3F0 3B0 3F1" in out and "bubble 0.2727" in out
    assert main(["zbv", "4", "3", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: zbv holds two stages per rank") and "\n" not in err
    assert main(["1f1b", "x"]) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["1f1b", "4", "1", "-1"], "error: MICROBATCHES must be an integer >= 1, got '-1'"),
        (["1f1b", "4", "1", "0"], "error: MICROBATCHES must be an integer >= 1, got '0'"),
        (["1f1b", "x", "1", "8"], "error: PP must be an integer >= 1, got 'x'"),
        (["1f1b", "4", "0", "8"], "error: VIRTUAL must be an integer >= 1, got '0'"),
        (["nope", "4", "1", "8"], "error: unknown schedule 'nope'"),
        (["1f1b", "4", "1"], "PP VIRTUAL MICROBATCHES (got 3 arguments, not 4)"),
    ],
)
def test_the_printer_says_what_is_wrong_with_an_argument(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardwise.pipeline.schedules import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_the_printer_names_what_its_peak_counts(capsys: pytest.CaptureFixture[str]) -> None:
    """Interleaved 4 x 2 at 8 micro-batches: rank 0 holds 11 (stage, micro-batch) activations at
    most, more than the 8 micro-batches, each a half of its layers; not "micro-batches in flight"."""
    from shardwise.pipeline.schedules import main

    assert main(["interleaved", "4", "2", "8"]) == 0
    out = capsys.readouterr().out
    assert "most (stage, micro-batch) activations held per rank, F to B/I: {0: 11, 1: 9, 2: 7, 3: 5}" in out
    assert "(each 1/2 of the rank's layers)" in out and "micro-batches in flight" not in out
