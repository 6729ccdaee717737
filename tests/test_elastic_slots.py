"""perparam.elastic's slots in one process: a slot is readable only once its header is written last, a
flipped bit in the payload or header is refused, and a State restores the newest slot that passes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from perparam.elastic import SnapshotError, State
from perparam.elastic.slots import Header, Slot, SlotFile, read_header

pytestmark = pytest.mark.fast


def test_a_slot_is_taken_only_after_its_header_and_only_while_its_checksum_holds(tmp_path):
    slot = SlotFile(tmp_path / "r0-own-s0")
    payload = bytes(range(256)) * 10
    slot.begin(len(payload))
    slot.payload(len(payload)).copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    assert read_header(slot.path) is None  # payload written, header not yet: a torn slot
    header = Header(7, len(payload), 0, slot.checksum(len(payload)), 0, 1)
    slot.finish(header)
    assert read_header(slot.path) == header and Slot(slot.path, header).verify()
    slot.map[4096 + 100] ^= 1  # one flipped bit in the payload
    assert not Slot(slot.path, header).verify()
    slot.map[4096 + 100] ^= 1
    slot.map[9] ^= 1  # ... in the header
    assert read_header(slot.path) is None
    slot.close()


def train(model, opt, state, steps: int) -> list[float]:
    torch.manual_seed(1)
    xs = torch.randn(steps, 4, 3)
    out = []
    for x in xs[state.step:]:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        state.commit()
        out.append(loss.item())
    return out


def make(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, State(model, opt, root=tmp_path, job="j")


def test_one_process_state_restores_the_newest_slot_that_passes(tmp_path):
    model, opt, state = make(tmp_path)
    want = train(model, opt, state, 5)
    final = model.weight.detach().clone()
    state.finish()
    fresh_model, fresh_opt, fresh = make(tmp_path)
    assert fresh.restore() == 5 and torch.equal(fresh_model.weight, final)
    (tmp_path / "j" / "r0-own-s1").write_bytes(b"\0" * 64)  # step 5's slot torn
    fresh_model, fresh_opt, fresh = make(tmp_path)
    assert fresh.restore() == 4
    assert train(fresh_model, fresh_opt, fresh, 5) == want[4:] and torch.equal(fresh_model.weight, final)
    fresh.finish()  # its last checksum is computed in the background: done before the files are overwritten
    for slot in ("s0", "s1"):  # both torn (as after a kill inside the first commit): a fresh start
        (tmp_path / "j" / f"r0-own-{slot}").write_bytes(b"\0" * 64)
    assert make(tmp_path)[2].restore() == 0
    (tmp_path / "j" / "r0-own-s0").write_bytes(b"\1" * 64)  # a damaged header: never a silent fresh start
    with pytest.raises(SnapshotError, match="the headers of r0-own-s0 in .* are damaged"):
        make(tmp_path)[2].restore()


def test_a_commit_returns_before_its_checksum_and_the_slot_is_readable_only_after(tmp_path, monkeypatch):
    import threading

    model, opt, state = make(tmp_path)
    release, checksum = threading.Event(), SlotFile.checksum

    def slow_checksum(self, n):
        assert release.wait(30)
        return checksum(self, n)

    monkeypatch.setattr(SlotFile, "checksum", slow_checksum)
    train(model, opt, state, 1)  # commit() returned while its checksum waits in the background
    assert read_header(tmp_path / "j" / "r0-own-s1") is None  # not yet readable: the header comes last
    release.set()
    state.finish()
    header = read_header(tmp_path / "j" / "r0-own-s1")
    assert header is not None and header.generation == 1 and Slot(tmp_path / "j" / "r0-own-s1", header).verify()


def test_an_unknown_replica_placement_is_refused_in_one_line(tmp_path):
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(SnapshotError, match=r"State\(replica='twice'\): pass 'auto'"):
        State(model, opt, root=tmp_path, job="j", replica="twice")
