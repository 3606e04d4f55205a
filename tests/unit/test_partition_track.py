"""The stage consumer's offset bookkeeping: records of a partition finish in any order (one chain per
user), and the committed offset never passes a record that has not finished."""

from __future__ import annotations

from mars.bus.offsets import PartitionTrack


def test_nothing_fetched_commits_nothing() -> None:
    assert PartitionTrack().committable() is None


def test_commit_stops_at_the_first_unfinished_record() -> None:
    track = PartitionTrack()
    for offset in (10, 11, 12, 13):
        track.fetched(offset)
    assert track.committable() == 10
    track.finished(11)
    track.finished(13)
    assert track.committable() == 10  # 10 is still running: 11 and 13 wait behind it
    track.finished(10)
    assert track.committable() == 12
    track.finished(12)
    assert track.committable() == 14  # all done: past the last fetched record


def test_offsets_with_gaps_commit_past_the_last_fetched() -> None:
    # Compacted or transactional topics skip offsets: the commit goes by what was fetched.
    track = PartitionTrack()
    track.fetched(5)
    track.fetched(9)
    track.finished(9)
    assert track.committable() == 5
    track.finished(5)
    assert track.committable() == 10
    assert not track.finished_set  # nothing left behind once the open records are gone
