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


def test_a_commit_returns_before_its_copy_and_the_next_optimizer_step_waits_for_it(tmp_path, monkeypatch):
    import threading

    from perparam.elastic import copier

    model, opt, state = make(tmp_path)
    release, block_sum = threading.Event(), copier.block_sum

    def slow_block_sum(block):
        assert release.wait(30)
        return block_sum(block)

    monkeypatch.setattr(copier, "block_sum", slow_block_sum)
    train(model, opt, state, 1)  # commit() returned while its copy waits in the background
    committed = model.weight.detach().clone()
    assert read_header(tmp_path / "j" / "r0-own-s1") is None  # not yet readable: the header comes last
    second = threading.Thread(target=train, args=(model, opt, state, 2))
    second.start()
    second.join(0.5)
    assert second.is_alive() and torch.equal(model.weight, committed)  # its optimizer step waits for the copy
    release.set()
    second.join(30)
    state.finish()
    assert not torch.equal(model.weight, committed)
    fresh_model, _, fresh = make(tmp_path)
    (tmp_path / "j" / "r0-own-s0").write_bytes(b"\0" * 64)  # step 2's slot torn: step 1's is what was copied
    assert fresh.restore() == 1 and torch.equal(fresh_model.weight, committed)


def test_the_device_copy_orders_its_streams_and_seals_after_the_host_sees_the_copy(tmp_path):
    from perparam.elastic.copier import DeviceCopier, plan

    class Streams:  # the CUDA stream, event and pinning calls, recorded; copies done at once on the CPU
        def __init__(self):
            self.log = []

        def side_waits_for_compute(self):
            self.log.append("side waits for compute")

        def copy_on_side(self, dst, src):
            self.log.append("copy")
            dst.copy_(src)

        def record_on_side(self):
            self.log.append("record")
            return "event"

        def compute_waits(self, event):
            self.log.append(f"compute waits for {event}")

        def host_waits(self, event):
            self.log.append(f"host waits for {event}")

        def pin(self, slot):
            self.log.append("pin")

        def release(self):
            self.log.append("release")

    streams = Streams()
    sources = [torch.arange(300_000, dtype=torch.float32), torch.ones(5, dtype=torch.float64)]
    spans = [(0, 1_200_000), (1_200_000, 40)]
    slot = SlotFile(tmp_path / "r0-own-s0")
    slot.begin(1_200_040)
    sizes = Header(3, 1_200_040, 0, (0, 0), 0, 1)
    in_flight = DeviceCopier(streams).start(slot, plan(spans, 1_200_040), sources, sizes)
    header = in_flight.result()
    in_flight.wait_copied()
    assert streams.log == ["pin", "side waits for compute", "copy", "copy", "copy", "record",
                           "host waits for event", "compute waits for event"]  # the first tensor: two blocks
    assert read_header(slot.path) == header and Slot(slot.path, header).verify()
    assert torch.equal(slot.payload(1_200_000).view(torch.float32), sources[0])
    slot.close()


def test_the_blockwise_checksum_equals_the_vectorized_one_and_refuses_a_flipped_bit():
    from perparam.elastic.checksum import BLOCK, Running, block_sum, checksum

    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (3 * BLOCK + 13,), dtype=torch.uint8, generator=generator)
    running = Running()
    for start in range(0, data.numel(), BLOCK):
        running.add(block_sum(data[start:start + BLOCK]))
    assert running.value == checksum(data)
    for at in (0, BLOCK - 1, 2 * BLOCK + 7, data.numel() - 1):  # a flipped bit anywhere, the padded tail too
        flipped = data.clone()
        flipped[at] ^= 0x80
        assert checksum(flipped) != checksum(data), at
    swapped = torch.cat([data[BLOCK:2 * BLOCK], data[:BLOCK], data[2 * BLOCK:]])  # blocks out of order
    assert checksum(swapped) != checksum(data)


def test_an_unknown_replica_placement_is_refused_in_one_line(tmp_path):
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(SnapshotError, match=r"State\(replica='twice'\): pass 'auto'"):
        State(model, opt, root=tmp_path, job="j", replica="twice")
