"""`megapkl plot` draws a run's timeline from the timing fields of its rows (the Timers' spans)."""
import json
import time

from megapkl.analysis.plot import plot_runs
from megapkl.analysis.timeline import busy_fraction, spans
from megapkl.train.timers import Timers


def test_timers_give_each_row_its_spans_and_absorb_work_timed_elsewhere():
    timers = Timers()
    timers.start()
    with timers("generate"):
        time.sleep(0.01)
    ahead = Timers()  # generation on another thread, absorbed into the row that uses it
    with ahead("generate"):
        time.sleep(0.01)
    with timers("train"):
        time.sleep(0.01)
    timers.absorb(ahead)
    row = timers.lap()
    assert 0 <= row["time/generate_from_s"] < row["time/generate_to_s"] <= row["time/train_from_s"]
    assert row["time/train_to_s"] - row["time/train_from_s"] >= 0.01
    assert row["time/generate_s"] >= 0.02  # both generations
    with timers("train"):
        pass
    again = timers.lap()  # the origin stays the run's start; the spans are the new update's
    assert "time/generate_from_s" not in again and again["time/train_from_s"] > row["time/train_to_s"]


def test_timeline_png_and_busy_fractions(tmp_path):
    # generation of update u+1 during training of update u: both lanes busy 3 of 4 seconds
    rows = [{"step": u, "time/generate_from_s": float(u), "time/generate_to_s": u + 1.0,
             "time/train_from_s": u + 1.0, "time/train_to_s": u + 2.0} for u in range(3)]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert spans(rows, "train") == [(0, 1.0, 2.0), (1, 2.0, 3.0), (2, 3.0, 4.0)]
    assert busy_fraction(rows, "generate") == busy_fraction(rows, "train") == 0.75
    files = plot_runs([run], tmp_path / "plots")
    png = tmp_path / "plots" / "timeline_run.png"
    assert png in files and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
