"""plan_fetches: coalescing, splitting and the invariants the transport's vectored reads rely on."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_storage.transports.ranges import FetchGroup, RangeRequest, plan_fetches


def R(path: str, start: int, end: int) -> RangeRequest:
    return RangeRequest(path, start, end)


def spans(groups: list[FetchGroup]) -> list[tuple[str, int, int]]:
    return [(g.path, g.start, g.end) for g in groups]


def seg_tuples(group: FetchGroup) -> list[tuple[int, int, int]]:
    return [(s.index, s.start, s.end) for s in group.segments]


# ------------------------------------------------------------------------------------ coalescing


def test_adjacent_ranges_merge_into_one_group() -> None:
    reqs = [R("a", i * 10, i * 10 + 10) for i in range(10)]
    groups = plan_fetches(reqs, coalesce_gap=0, max_request_bytes=1 << 20)
    assert spans(groups) == [("a", 0, 100)]
    assert seg_tuples(groups[0]) == [(i, i * 10, i * 10 + 10) for i in range(10)]


def test_gap_at_most_coalesce_gap_merges_larger_gap_splits() -> None:
    reqs = [R("a", 0, 10), R("a", 15, 20), R("a", 26, 30)]  # gaps of 5 then 6
    assert spans(plan_fetches(reqs, coalesce_gap=5, max_request_bytes=1000)) == [("a", 0, 20), ("a", 26, 30)]
    assert spans(plan_fetches(reqs, coalesce_gap=6, max_request_bytes=1000)) == [("a", 0, 30)]
    assert spans(plan_fetches(reqs, coalesce_gap=4, max_request_bytes=1000)) == [
        ("a", 0, 10),
        ("a", 15, 20),
        ("a", 26, 30),
    ]


def test_unsorted_input_is_sorted_and_indices_kept() -> None:
    reqs = [R("a", 20, 30), R("a", 0, 10), R("a", 10, 20)]
    (group,) = plan_fetches(reqs, coalesce_gap=0, max_request_bytes=1000)
    assert (group.start, group.end) == (0, 30)
    assert seg_tuples(group) == [(1, 0, 10), (2, 10, 20), (0, 20, 30)]


def test_no_merge_across_paths() -> None:
    reqs = [R("a", 0, 10), R("b", 10, 20), R("a", 10, 20)]
    groups = plan_fetches(reqs, coalesce_gap=1000, max_request_bytes=1000)
    assert spans(groups) == [("a", 0, 20), ("b", 10, 20)]
    assert {s.index for s in groups[0].segments} == {0, 2}


def test_overlapping_ranges_start_new_group() -> None:
    reqs = [R("a", 0, 10), R("a", 5, 15), R("a", 15, 20)]
    groups = plan_fetches(reqs, coalesce_gap=100, max_request_bytes=1000)
    # [5, 15) overlaps [0, 10): new group; [15, 20) abuts [5, 15): merged into the second
    assert spans(groups) == [("a", 0, 10), ("a", 5, 20)]


def test_identical_ranges_get_separate_groups() -> None:
    reqs = [R("a", 0, 8), R("a", 0, 8)]
    groups = plan_fetches(reqs, coalesce_gap=100, max_request_bytes=1000)
    assert spans(groups) == [("a", 0, 8), ("a", 0, 8)]
    assert sorted(s.index for g in groups for s in g.segments) == [0, 1]


def test_merge_stops_at_max_request_bytes() -> None:
    reqs = [R("a", i * 10, i * 10 + 10) for i in range(10)]
    groups = plan_fetches(reqs, coalesce_gap=0, max_request_bytes=35)
    assert spans(groups) == [("a", 0, 30), ("a", 30, 60), ("a", 60, 90), ("a", 90, 100)]


def test_gap_bytes_count_toward_max_request_bytes() -> None:
    reqs = [R("a", 0, 10), R("a", 30, 40)]
    assert spans(plan_fetches(reqs, coalesce_gap=20, max_request_bytes=40)) == [("a", 0, 40)]
    assert spans(plan_fetches(reqs, coalesce_gap=20, max_request_bytes=39)) == [("a", 0, 10), ("a", 30, 40)]


# ------------------------------------------------------------------------------------ splitting


def test_large_request_split_into_max_sized_parts() -> None:
    groups = plan_fetches([R("a", 100, 1100)], coalesce_gap=0, max_request_bytes=300)
    assert spans(groups) == [("a", 100, 400), ("a", 400, 700), ("a", 700, 1000), ("a", 1000, 1100)]
    assert all(seg_tuples(g) == [(0, g.start, g.end)] for g in groups)


def test_request_of_exactly_max_is_not_split() -> None:
    groups = plan_fetches([R("a", 0, 300)], coalesce_gap=0, max_request_bytes=300)
    assert spans(groups) == [("a", 0, 300)]


def test_split_tail_can_merge_with_a_neighbour() -> None:
    reqs = [R("a", 0, 250), R("a", 250, 260)]
    groups = plan_fetches(reqs, coalesce_gap=0, max_request_bytes=100)
    assert spans(groups) == [("a", 0, 100), ("a", 100, 200), ("a", 200, 260)]
    assert seg_tuples(groups[-1]) == [(0, 200, 250), (1, 250, 260)]


# ------------------------------------------------------------------------------------ edge cases


def test_zero_length_requests_produce_no_groups() -> None:
    reqs = [R("a", 5, 5), R("a", 0, 10), R("b", 0, 0)]
    groups = plan_fetches(reqs, coalesce_gap=0, max_request_bytes=100)
    assert spans(groups) == [("a", 0, 10)]
    assert seg_tuples(groups[0]) == [(1, 0, 10)]


def test_empty_request_list() -> None:
    assert plan_fetches([], coalesce_gap=0, max_request_bytes=1) == []


@pytest.mark.parametrize(("gap", "max_bytes"), [(-1, 10), (0, 0), (0, -5)])
def test_invalid_planner_arguments_raise(gap: int, max_bytes: int) -> None:
    with pytest.raises(ValueError):
        plan_fetches([R("a", 0, 1)], coalesce_gap=gap, max_request_bytes=max_bytes)


@pytest.mark.parametrize(("start", "end"), [(-1, 5), (10, 5)])
def test_invalid_range_request_raises(start: int, end: int) -> None:
    with pytest.raises(ValueError, match="invalid byte range"):
        RangeRequest("a", start, end)


def test_into_buffer_validation() -> None:
    with pytest.raises(ValueError, match="holds 4 bytes, expected 5"):
        RangeRequest("a", 0, 5, into=memoryview(bytearray(4)))
    with pytest.raises(ValueError, match="writable"):
        RangeRequest("a", 0, 4, into=memoryview(b"abcd"))
    # a non-byte format is cast to bytes
    import array

    req = RangeRequest("a", 0, 8, into=memoryview(array.array("i", [0, 0])))
    assert req.into is not None and req.into.format == "B" and req.into.nbytes == 8


# ------------------------------------------------------------------------------------ properties

_request = st.builds(
    lambda path, start, length: (path, start, start + length),
    st.sampled_from(["a", "b", "c"]),
    st.integers(0, 400),
    st.integers(0, 120),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    raw=st.lists(_request, max_size=40),
    gap=st.integers(0, 64),
    max_bytes=st.integers(1, 200),
)
def test_plan_invariants(raw: list[tuple[str, int, int]], gap: int, max_bytes: int) -> None:
    reqs = [R(*r) for r in raw]
    groups = plan_fetches(reqs, coalesce_gap=gap, max_request_bytes=max_bytes)

    covered: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(reqs))}
    for g in groups:
        assert g.segments, "a group without segments would be a wasted request"
        assert g.start == g.segments[0].start and g.end == g.segments[-1].end
        # a group is one storage request: never longer than max_request_bytes (split pieces are <= max too)
        single_split_piece = len(g.segments) == 1 and reqs[g.segments[0].index].length > max_bytes
        assert g.length <= max_bytes or single_split_piece
        assert g.length <= max_bytes
        prev_end = None
        for seg in g.segments:
            req = reqs[seg.index]
            assert req.path == g.path
            assert req.start <= seg.start < seg.end <= req.end
            if prev_end is not None:
                assert seg.start >= prev_end, "segments within a group are sorted and disjoint"
                assert seg.start - prev_end <= gap, "only gaps up to coalesce_gap are bridged"
            prev_end = seg.end
            covered[seg.index].append((seg.start, seg.end))

    for i, req in enumerate(reqs):
        pieces = sorted(covered[i])
        if req.length == 0:
            assert pieces == []
            continue
        # every requested byte is covered exactly once
        pos = req.start
        for s, e in pieces:
            assert s == pos, f"request {i} {req} not tiled exactly by {pieces}"
            pos = e
        assert pos == req.end

    # groups of one path never overlap in a way that hides a mergeable neighbour: consecutive groups of a
    # path that are disjoint and close enough would have been merged unless the size cap forbade it
    for a, b in zip(groups, groups[1:]):
        if a.path == b.path and a.end <= b.segments[0].start and b.segments[0].start - a.end <= gap:
            assert b.segments[0].end - a.start > max_bytes


def _events_of_a_run(hot_pieces: int) -> tuple[list[tuple[str, int]], bytes]:
    """Four adjacent 4-byte requests with ``on_complete``, one group: what ran in which order."""
    from concurrent.futures import ThreadPoolExecutor

    from dcp_storage.transports.ranges import RangeRun

    data = bytes(range(16))
    events: list[tuple[str, int]] = []
    out = bytearray(16)
    requests = [
        RangeRequest(
            "f", i, i + 4, into=memoryview(out)[i : i + 4], on_complete=lambda _v, at=i: events.append(("done", at))
        )
        for i in range(0, 16, 4)
    ]
    groups = plan_fetches(requests, coalesce_gap=0, max_request_bytes=1 << 20)
    assert len(groups) == 1

    def fetch(group: FetchGroup, views: list[memoryview]) -> None:
        events.append(("fetch", group.start))
        for seg, view in zip(group.segments, views):
            view[:] = data[seg.start : seg.end]

    with ThreadPoolExecutor(1) as pool:
        RangeRun(requests, groups, fetch, pool, 1 << 20, hot_pieces=hot_pieces).execute()
    return events, bytes(out)


def test_hot_pieces_complete_each_piece_before_reading_the_next() -> None:
    """A check in ``on_complete`` runs on bytes just read (still in cache), not after the whole group."""
    events, out = _events_of_a_run(hot_pieces=8)
    assert out == bytes(range(16))
    assert events == [("fetch", 0), ("done", 0), ("done", 4), ("fetch", 8), ("done", 8), ("done", 12)]
    events, out = _events_of_a_run(hot_pieces=0)  # an object store: one GET for the group
    assert out == bytes(range(16))
    assert events == [("fetch", 0), ("done", 0), ("done", 4), ("done", 8), ("done", 12)]


def _pieces_of_a_run(hot_pieces: int, read_piece: bool) -> tuple[list[tuple[str, int, int]], bytes]:
    """A 20-byte request with ``on_piece`` between two 4-byte ones without: what landed, in which order."""
    from concurrent.futures import ThreadPoolExecutor

    from dcp_storage.transports.ranges import RangeRun

    data = bytes(range(28))
    events: list[tuple[str, int, int]] = []
    out = bytearray(28)
    view = memoryview(out)

    def piece(offset: int, v: memoryview) -> None:
        assert bytes(v) == data[offset : offset + v.nbytes]  # the piece's bytes are there when it is handed over
        events.append(("piece", offset, offset + v.nbytes))

    requests = [
        RangeRequest("f", 0, 4, view[0:4], lambda _v: events.append(("done", 0, 4))),
        RangeRequest("f", 4, 24, view[4:24], lambda _v: events.append(("done", 4, 24)), piece),
        RangeRequest("f", 24, 28, view[24:28]),
    ]
    groups = plan_fetches(requests, coalesce_gap=0, max_request_bytes=1 << 20)

    def fetch(group: FetchGroup, views: list[memoryview]) -> None:
        events.append(("fetch", group.start, group.end))
        for seg, v in zip(group.segments, views):
            v[:] = data[seg.start : seg.end]

    def read(path: str, offset: int, v: memoryview, step: int, on_piece: Callable[[int, memoryview], None]) -> None:
        for at in range(0, v.nbytes, step):
            part = v[at : at + step]
            events.append(("read", offset + at, offset + at + part.nbytes))
            part[:] = data[offset + at : offset + at + part.nbytes]
            on_piece(offset + at, part)

    with ThreadPoolExecutor(1) as pool:
        RangeRun(requests, groups, fetch, pool, 1 << 20, hot_pieces, read if read_piece else None).execute()
    return events, bytes(out)


def test_on_piece_gets_each_hot_piece_as_it_lands_before_the_next_is_read() -> None:
    events, out = _pieces_of_a_run(hot_pieces=8, read_piece=True)
    assert out == bytes(range(28))
    assert events == [
        ("fetch", 0, 4),
        ("done", 0, 4),
        ("read", 4, 12),
        ("piece", 4, 12),
        ("read", 12, 20),
        ("piece", 12, 20),
        ("read", 20, 24),
        ("piece", 20, 24),
        ("done", 4, 24),
        ("fetch", 24, 28),
    ]
    events, out = _pieces_of_a_run(hot_pieces=8, read_piece=False)  # pieces through fetch, one segment each
    assert out == bytes(range(28))
    assert [e for e in events if e[0] != "done"] == [
        ("fetch", 0, 4),
        ("fetch", 4, 12),
        ("piece", 4, 12),
        ("fetch", 12, 20),
        ("piece", 12, 20),
        ("fetch", 20, 24),
        ("piece", 20, 24),
        ("fetch", 24, 28),
    ]
    events, out = _pieces_of_a_run(hot_pieces=0, read_piece=False)  # an object store: one GET, then the piece
    assert out == bytes(range(28))
    assert events == [("fetch", 0, 28), ("done", 0, 4), ("piece", 4, 24), ("done", 4, 24)]


def test_a_request_with_on_piece_is_never_split() -> None:
    """Its pieces must reach ``on_piece`` in order, from one thread: no parts fetched concurrently."""
    plain = RangeRequest("a", 0, 100)
    pieced = RangeRequest("a", 0, 100, on_piece=lambda _o, _v: None)
    assert [seg_tuples(g) for g in plan_fetches([plain], 0, 30)] == [
        [(0, 0, 30)],
        [(0, 30, 60)],
        [(0, 60, 90)],
        [(0, 90, 100)],
    ]
    assert [seg_tuples(g) for g in plan_fetches([pieced], 0, 30)] == [[(0, 0, 100)]]
