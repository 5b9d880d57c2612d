"""progress.Reporter: decoded audio that moves during a batch, never back, never past the total."""

from __future__ import annotations

from whisper_cli.progress import ENCODING, FINDING_SPEECH, TRANSCRIBING, Progress, Reporter


def test_rows_move_the_figure_within_a_batch_and_it_never_goes_back() -> None:
    seen: list[Progress] = []
    final = [0.0]
    reporter = Reporter(seen.append, 100.0, lambda: final[0])
    reporter.enter(FINDING_SPEECH)
    reporter.encoding()
    reporter.encoding()  # a stage once: later batches' encoder passes are not stages
    assert [p.stage for p in seen] == [FINDING_SPEECH, ENCODING]
    # Three windows of 30 s; the last is a retry already counted when it was first decoded.
    reporter.batch([30.0, 30.0, None])
    reporter.rows(0, {0: 4.0, 1: 2.0, 2: 20.0})
    reporter.rows(0, {0: 12.0, 1: 40.0})  # a timestamp past the window counts as its end
    reporter.rows(1, {0: None})  # a chunk from row 1: row 1 finished
    assert [p.audio_done for p in seen[2:]] == [6.0, 42.0, 42.0]
    assert all(p.stage == TRANSCRIBING for p in seen[2:])
    final[0] = 40.0  # the scheduler's figure, lower than what the rows said
    reporter.settled()
    assert seen[-1].audio_done == 42.0
    final[0] = 250.0
    reporter.settled()
    assert seen[-1].audio_done == 100.0  # clamped to the known total


def test_unknown_total_is_not_a_clamp() -> None:
    seen: list[Progress] = []
    reporter = Reporter(seen.append, 0.0, lambda: 0.0)
    reporter.batch([30.0])
    reporter.rows(0, {0: 25.0})
    assert seen[-1].audio_done == 25.0 and seen[-1].audio_total == 0.0
