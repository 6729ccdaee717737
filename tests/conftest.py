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


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    """A small text folder for the main job's tiny runs (the sonnet, and its reverse as held-out text)."""
    folder = tmp_path_factory.mktemp("text")
    (folder / "a_sonnets.txt").write_text(SONNET * 60)
    (folder / "b_heldout.txt").write_text(SONNET[::-1] * 20)
    return folder
