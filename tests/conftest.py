import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch  # noqa: E402

torch.set_num_threads(1)


from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

SONNET = """Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
"""


@pytest.fixture
def fake_mesh():
    """A 1D mesh of 2 ranks over torch's fake process group, in this process as rank 0 (its collectives
    return at once, moving nothing): for what ``fully_shard`` checks and builds before communicating, and
    runs that only need every rank's sizes. The process group is destroyed after the test."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory) -> Path:
    """A small text folder for the main job's tiny runs (the sonnet, and its reverse as held-out text); read
    only, so one folder serves the whole session (and ``plain_tiny_run``)."""
    folder = tmp_path_factory.mktemp("text")
    (folder / "a_sonnets.txt").write_text(SONNET * 60)
    (folder / "b_heldout.txt").write_text(SONNET[::-1] * 20)
    return folder


@pytest.fixture(scope="session")
def plain_tiny_run(tmp_path_factory, text_dir):
    """``(proc, summary)`` of the plain tiny run: ``perparam finetune`` with ``TINY`` on ``text_dir``, 2
    ranks, fp32, no quantization, a 1D mesh, ``--summary-json``. The run the finetune tests compare theirs to
    (``test_finetune_cli``'s variants, ``test_finetune_checkpoint``'s uninterrupted run,
    ``test_finetune_offload``'s run without offload): one launch per session instead of one per file."""
    import json

    from tests.finetune_helpers import TINY, run_finetune

    out = tmp_path_factory.mktemp("plain") / "summary.json"
    proc = run_finetune(*TINY, "--text", str(text_dir), "--nproc", "2", "--summary-json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())
