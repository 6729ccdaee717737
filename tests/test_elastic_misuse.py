"""``perparam.elastic.State`` misused, in one process: what would lose or corrupt data is refused in one line
naming the fix (a job name outside its folder, a user value hiding State's own, two States writing one
folder, a commit over an earlier start's snapshots before ``restore()``, a commit after ``close()``, a
trainable parameter in none of the optimizers given), the end of a job removes only its own files, and a
list of schedulers is committed and restored."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from perparam.elastic import SnapshotError, State
from perparam.elastic.store import remove

pytestmark = pytest.mark.fast


def make(root, job: str = "j", **kw):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, State(model, opt, root=root, job=job, **kw)


def step(model, opt, state) -> None:
    model(torch.ones(4, 3)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    state.commit()


@pytest.mark.parametrize("job", ["..", ".", "a/b", ""])
def test_a_job_name_that_is_not_one_folder_is_refused_before_anything_is_written(tmp_path, job):
    (tmp_path / "root").mkdir()
    with pytest.raises(SnapshotError, match="is one folder name"):
        make(tmp_path / "root", job)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


def test_the_end_of_a_job_removes_its_slots_and_nothing_else(tmp_path):
    model, opt, state = make(tmp_path, job="mine")
    step(model, opt, state)
    (tmp_path / "mine" / "notes.txt").write_text("the user's")  # a root/job the user pointed at their files
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "r0-own-s0").write_bytes(b"another job's slot")
    state.close()
    assert (tmp_path / "mine" / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]
    assert (tmp_path / "other" / "r0-own-s0").exists()
    remove(tmp_path / "other")
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("name", ["step", "commit", "restore", "folder", "_user"])
def test_a_user_value_named_as_states_own_is_refused(tmp_path, name):
    with pytest.raises(SnapshotError, match=f"'{name}' is State's own"):
        make(tmp_path, **{name: 300})


@pytest.mark.parametrize("every", [0, 1.5, True, "2"])
def test_every_is_a_positive_int(tmp_path, every):
    with pytest.raises(SnapshotError, match="commit every 1 or more steps"):
        make(tmp_path, every=every)


def test_the_attributes_state_sets_are_the_names_a_user_value_cannot_take(tmp_path):
    from perparam.elastic.state import _OWN_NAMES

    model, opt, state = make(tmp_path)
    step(model, opt, state)
    assert {n for n in vars(state) if not n.startswith("_")} == _OWN_NAMES
    state.close()


def test_two_states_writing_one_folder_are_refused_and_a_restore_takes_the_folder_over(tmp_path):
    model, opt, first = make(tmp_path)
    step(model, opt, first)
    other_model, other_opt, second = make(tmp_path)  # another model, the same job: its commits would clobber
    with pytest.raises(SnapshotError, match="another State of this process snapshots into"):
        step(other_model, other_opt, second)
    second.close(remove_snapshots=False)
    again_model, again_opt, again = make(tmp_path)  # a loop restarted in this process: restores, goes on
    assert again.restore() == 1
    step(again_model, again_opt, again)
    with pytest.raises(SnapshotError, match="a later State of this process restored"):
        step(model, opt, first)
    again.close()
    first.close()


def test_a_commit_before_restore_over_an_earlier_starts_snapshots_is_refused(tmp_path):
    model, opt, state = make(tmp_path)
    for _ in range(3):
        step(model, opt, state)
    state.close(remove_snapshots=False)
    model, opt, state = make(tmp_path)
    with pytest.raises(SnapshotError, match=r"commit\(\) before restore\(\): .*newest of step 3"):
        step(model, opt, state)
    state.close(remove_snapshots=False)
    model, opt, state = make(tmp_path)
    assert state.restore() == 3  # nothing was overwritten
    step(model, opt, state)
    state.close()
    with pytest.raises(SnapshotError, match=r"commit\(\) after close\(\)"):
        state.commit()


def test_a_trainable_parameter_in_none_of_the_optimizers_is_refused(tmp_path):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    muon_like = torch.optim.SGD(model[0].parameters(), lr=0.1)  # the other optimizer, left out
    adamw = torch.optim.AdamW(model[1].parameters(), lr=0.1)
    with pytest.raises(SnapshotError, match="parameter '0.weight' requires grad but is in none of the"):
        State(model, adamw, root=tmp_path, job="j")
    State(model, [muon_like, adamw], root=tmp_path, job="j").close()
    model[0].requires_grad_(False)
    State(model, adamw, root=tmp_path, job="j").close()


def test_a_list_of_schedulers_is_committed_and_restored(tmp_path):
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
        a = torch.optim.SGD(model[0].parameters(), lr=0.1)
        b = torch.optim.AdamW(model[1].parameters(), lr=0.01)
        scheds = [torch.optim.lr_scheduler.StepLR(a, 1, gamma=0.5),
                  torch.optim.lr_scheduler.LambdaLR(b, lambda s: 1.0 / (s + 1))]
        return model, [a, b], scheds

    model, opts, scheds = build()
    state = State(model, opts, scheds, root=tmp_path, job="j")
    for _ in range(3):
        model(torch.ones(4, 3)).square().mean().backward()
        for o in opts:
            o.step()
            o.zero_grad()
        for s in scheds:
            s.step()
        state.commit()
    want = [o.param_groups[0]["lr"] for o in opts]
    state.finish()
    model, opts, scheds = build()
    again = State(model, opts, scheds, root=tmp_path, job="j")
    assert again.restore() == 3
    assert [o.param_groups[0]["lr"] for o in opts] == want == [0.1 * 0.5 ** 3, 0.01 / 4]
    assert [s.last_epoch for s in scheds] == [3, 3]
    again.close()
    state.close()
