"""The MLflow outbox on its own (no mlflow): order, delivery cursor, torn last line, one sender at a time."""

import json

from flows.tracking.outbox import Outbox, sending_lock

URI = "sqlite:////x/mlflow.db"


def _deliver(box: Outbox, upto_seq: int) -> None:
    """What the sender does after the store accepted records up to `upto_seq`."""
    state = box.load_state(URI)
    pending = box.pending(state)
    end = next(end for end, r in pending if r["seq"] == upto_seq)
    box.save_state({**state, "sent": upto_seq, "offset": end})


def test_records_are_delivered_in_order_each_once(tmp_path):
    box = Outbox(tmp_path)
    seqs = [box.append("metrics", step=s, metrics={"reward/mean": s / 10}) for s in range(1, 6)]
    assert seqs == [0, 1, 2, 3, 4]
    state = box.load_state(URI)
    assert [r["step"] for _, r in box.pending(state)] == [1, 2, 3, 4, 5]

    _deliver(box, 2)  # steps 1-3 accepted
    box.append("metrics", step=6, metrics={"reward/mean": 0.6})
    pending = box.pending(box.load_state(URI))
    assert [r["step"] for _, r in pending] == [4, 5, 6]  # nothing lost, nothing delivered twice
    _deliver(box, 5)
    assert box.pending(box.load_state(URI)) == []
    # a new Outbox object (another process, e.g. `forgeweave sync`) sees the same cursor and numbering
    again = Outbox(tmp_path)
    assert again.pending(again.load_state(URI)) == []
    assert again.append("end", status="FINISHED") == 6
    assert [r["op"] for _, r in again.pending(again.load_state(URI))] == ["end"]


def test_torn_last_line_is_ignored_then_cut(tmp_path):
    box = Outbox(tmp_path)
    for s in range(3):
        box.append("metrics", step=s, metrics={"m": float(s)})
    with box.path.open("a") as f:  # a process killed in the middle of writing record 3
        f.write('{"seq": 3, "op": "metrics", "step": 3, "metr')
    reader = Outbox(tmp_path)
    assert [r["seq"] for _, r in reader.pending(reader.load_state(URI))] == [0, 1, 2]
    assert reader.max_step("metrics") == 2

    writer = Outbox(tmp_path)  # the resumed run appends: the torn tail is cut, numbering continues
    assert writer.append("metrics", step=3, metrics={"m": 3.0}) == 3
    lines = box.path.read_text().splitlines()
    assert [json.loads(line)["seq"] for line in lines] == [0, 1, 2, 3]
    assert [r["step"] for _, r in writer.pending(writer.load_state(URI))] == [0, 1, 2, 3]


def test_state_for_another_store_means_nothing_sent_there(tmp_path):
    box = Outbox(tmp_path)
    box.append("params", params={"a": "1"})
    box.append("metrics", step=1, metrics={"m": 1.0})
    _deliver(box, 1)
    assert box.pending(box.load_state(URI)) == []
    other = box.load_state("http://127.0.0.1:5000")
    assert "run_id" not in other and other["sent"] == -1
    assert [r["op"] for _, r in box.pending(other)] == ["params", "metrics"]


def test_only_one_sender_at_a_time(tmp_path):
    with sending_lock(tmp_path) as first:
        assert first
        with sending_lock(tmp_path) as second:
            assert not second
    with sending_lock(tmp_path) as after:
        assert after
