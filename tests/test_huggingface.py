"""Hugging Face models sharded by perparam: a tiny random ``transformers.LlamaForCausalLM`` (no hub access)
and a ``peft`` LoRA model on 2 gloo ranks against one process: training, ``generate`` with ranks stopping
at different lengths, ``save_pretrained``/``from_pretrained``, LoRA merge, QLoRA's dequantized state dict
and the methods refused after sharding. docs/huggingface.md has the recipes these tests prove.

``transformers`` and ``peft`` are imported here only, inside the functions (a test dependency, never one
of ``perparam/``). Every scenario runs in one 2-rank launch (the ``sharded`` fixture): importing
transformers in each rank costs seconds, the models milliseconds.
"""

from __future__ import annotations

import importlib.util
import traceback

import pytest
import torch

from tests.distributed import one_process, run_distributed
from tests.hf_helpers import make_llama

#: found without importing them (collecting this file must not cost transformers' import time)
pytestmark = pytest.mark.skipif(not all(importlib.util.find_spec(n) for n in ("transformers", "peft")),
                                reason="transformers and peft are test dependencies: pip install -e '.[dev]'")

WORLD = 2
STEPS = 3
TARGETS = ["q_proj", "v_proj"]
NF4 = {"self_attn.q_proj.base_layer.weight", "self_attn.v_proj.base_layer.weight"}


def make_lora(model=None):
    from peft import LoraConfig, get_peft_model

    model = make_llama() if model is None else model
    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=TARGETS, lora_dropout=0.0,
                                                  init_lora_weights=False))  # random B: the adapters matter
    return peft_model


def batches(rank: int, world: int) -> list[torch.Tensor]:
    """``STEPS`` global batches of 4 sequences; rank r of ``world`` takes its rows (all of them at world
    0)."""
    g = torch.Generator().manual_seed(7)
    out = [torch.randint(0, 33, (4, 7), generator=g) for _ in range(STEPS)]
    return out if world == 0 else [b.chunk(world)[rank] for b in out]


def shard(model, layers, root=None, param_policy=None) -> None:
    """Each decoder layer, then the root (``model`` unless ``root`` is given)."""
    from perparam import fully_shard

    for layer in layers:
        fully_shard(layer, param_policy=param_policy)
    fully_shard(model if root is None else root)


def train(rank: int, world: int, kind: str, optimizer: str) -> dict:
    """``STEPS`` steps; the losses of this rank and the full state dict (rank 0, or the one process)."""
    from perparam.full_state import full_state_dict

    model = make_llama() if kind == "llama" else make_lora()
    inner = model if kind == "llama" else model.base_model.model
    if world:
        shard(model, inner.model.layers)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.AdamW(params, lr=1e-2) if optimizer == "adamw" else torch.optim.SGD(params, lr=0.5))
    losses, first_grads = [], {}
    for ids in batches(rank, world):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if not world and not losses:  # the one process's first gradients (where Adam's first step is steep)
            first_grads = {n: p.grad.detach().clone()
                           for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = full_state_dict(model) if world else {k: v.detach().clone()
                                                  for k, v in model.state_dict().items()}
    return {"losses": losses, "state": state, "first_grads": first_grads}


def greedy_eos(model, prompts: list[torch.Tensor]) -> int:
    """A token that ends prompt 0's greedy continuation at its third new token at the latest and never
    appears in prompt 1's: the ranks then stop at different lengths."""
    runs = [model.generate(p, max_new_tokens=10, do_sample=False, pad_token_id=0)[0, p.shape[1]:].tolist()
            for p in prompts]
    for token in runs[0][:3]:
        if token not in runs[1]:
            return token
    raise AssertionError(f"no early EOS candidate in {runs}; change the prompts")


def generation(rank: int, world: int) -> dict:
    model = make_llama().eval()
    prompts = [torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5, 6, 7]])]
    eos = greedy_eos(model, prompts)
    expected = [model.generate(p, max_new_tokens=10, do_sample=False, eos_token_id=eos,
                               pad_token_id=0)[0].tolist()
                for p in prompts]
    shard(model, model.model.layers)
    got = model.generate(prompts[rank], max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0)
    # a peft model (its inner model as the root), ranks asking for different numbers of new tokens
    peft_model = make_lora().eval()
    lengths = [3, 8]
    peft_expected = peft_model.generate(input_ids=prompts[rank], max_new_tokens=lengths[rank],
                                        do_sample=False, pad_token_id=0)
    shard(peft_model, peft_model.base_model.model.model.layers, root=peft_model.base_model.model)
    peft_got = peft_model.generate(input_ids=prompts[rank], max_new_tokens=lengths[rank], do_sample=False,
                                   pad_token_id=0)
    return {"expected": expected[rank], "got": got[0].tolist(),
            "peft_expected": peft_expected[0].tolist(), "peft_got": peft_got[0].tolist(),
            "marked": all(getattr(m, "_is_fsdp_managed_module", False) for m in model.modules())}


def refusals(rank: int, world: int, path: str) -> dict:
    """What the plain calls raise on a sharded model, and the recipe that works."""
    from perparam.full_state import full_state_dict

    model = make_llama()
    shard(model, model.model.layers)
    out = {"save": _error(lambda: model.save_pretrained(f"{path}/plain")),
           "resize": _error(lambda: model.resize_token_embeddings(40))}
    state = full_state_dict(model)
    if rank == 0:
        model.save_pretrained(f"{path}/llama", state_dict=state)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        out["logits"] = model(input_ids=ids).logits
    peft_model = make_lora()
    shard(peft_model, peft_model.base_model.model.model.layers)
    out["peft_save"] = _error(lambda: peft_model.save_pretrained(f"{path}/plain_adapter"))
    out["tie_weights"] = _error(lambda: _tie(model))
    out["peft_after"] = _error(lambda: make_lora(model))
    out["peft_resize"] = _error(lambda: peft_model.resize_token_embeddings(40))
    state = full_state_dict(peft_model)
    if rank == 0:
        peft_model.save_pretrained(f"{path}/adapter", state_dict=state)
    with torch.no_grad():
        out["peft_logits"] = peft_model(input_ids=ids).logits
    return out


def _tie(model) -> None:
    model.config.tie_word_embeddings = True
    model.tie_weights()


def merging(rank: int, world: int) -> dict:
    """LoRA trained one SGD step, then ``merge_and_unload()``: sharded with the inner model as the root."""
    from perparam.full_state import full_state_dict

    peft_model = make_lora()
    inner = peft_model.base_model.model
    if world:
        shard(peft_model, inner.model.layers, root=inner)
    opt = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=0.5)
    ids = batches(rank, world)[0]
    peft_model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    merged = peft_model.merge_and_unload()
    with torch.no_grad():
        logits = merged(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
    state = full_state_dict(merged) if world else {k: v.detach().clone()
                                                   for k, v in merged.state_dict().items()}
    return {"logits": logits, "state": state}


def qlora(rank: int, world: int) -> dict:
    """The adapted projections' base weights stored in NF4: the dequantized full state dict."""
    from perparam import ParamPolicy, QuantPolicy
    from perparam.full_state import dequantized_full_state_dict

    peft_model = make_lora()
    nf4 = ParamPolicy(requires_grad=False, quant=QuantPolicy("nf4", block_size=64, store_quantized=True))
    shard(peft_model, peft_model.base_model.model.model.layers, param_policy=dict.fromkeys(NF4, nf4))
    return {"state": dequantized_full_state_dict(peft_model)}


def _error(call) -> tuple[str, str] | None:
    try:
        call()
    except Exception as e:  # the test reads the type and the message
        return type(e).__name__, str(e)
    return None


def scenarios(rank: int, world: int, path: str) -> dict:
    """Every scenario on the sharded model, each result or the traceback that ended it."""
    out = {}
    for name, call in [("llama_adamw", lambda: train(rank, world, "llama", "adamw")),
                       ("llama_sgd", lambda: train(rank, world, "llama", "sgd")),
                       ("lora_adamw", lambda: train(rank, world, "lora", "adamw")),
                       ("lora_sgd", lambda: train(rank, world, "lora", "sgd")),
                       ("generation", lambda: generation(rank, world)),
                       ("refusals", lambda: refusals(rank, world, path)),
                       ("merging", lambda: merging(rank, world)),
                       ("qlora", lambda: qlora(rank, world))]:
        try:
            out[name] = call()
        except Exception:  # reported by the test that reads this scenario
            out[name] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hf"))
    return run_distributed(scenarios, WORLD, path, timeout=150), path


def result(sharded, name: str, rank: int = 0):
    value = sharded[0][rank][name]
    assert not isinstance(value, str), f"rank {rank} failed in {name}:\n{value}"
    return value


def assert_states_close(got: dict, want: dict, atol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    worst = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
    assert worst <= atol, worst


@pytest.mark.parametrize("name", ["llama_adamw", "llama_sgd", "lora_adamw", "lora_sgd"])
def test_llama_and_lora_sharded_per_layer_train_like_one_process(sharded, name):
    kind, optimizer = name.split("_")
    want = one_process(train, kind, optimizer)
    got = [result(sharded, name, r) for r in range(WORLD)]
    steep = {}
    if name == "lora_adamw":
        # Adam's first update of an element is lr g / (|g| + eps) (bias-corrected m / sqrt(v) = g / |g|),
        # whose slope in g, lr eps / (|g| + eps)^2, reaches lr / eps = 1e6 at g = 0. One element has a first
        # gradient that near zero: layer 0's q_proj lora_B[1, 0], g = 1.32e-8 (eps 1e-8), the sum of the two
        # ranks' halves +1.9354e-4 and -1.9352e-4 that cancel. Their fp32 rounding (1.2e-10 and 1.5e-10 off
        # float64, about 5 ulp of the halves) makes the sum 1.19e-10 apart added in another order (one process
        # 1.0e-10 off float64, the 2 ranks 1.7e-11: neither wrong), and the slope 1.85e5 there turns that into
        # 2.2e-5 after the first step, carried unchanged to the last (on an Intel Xeon host; 1e-5 on an AMD
        # EPYC one). So: elements whose first gradient is within 100 eps of zero (that one) at 5e-5, the slope
        # times 2.7e-10 (both halves' rounding in one direction); every other element at the project's 1e-5
        # (measured 5.4e-7); SGD, whose update is linear in g, at 1e-5 everywhere
        steep = {k: g.abs() < 100 * 1e-8 for k, g in want["first_grads"].items()}
        assert (sum(int(m.sum()) for m in steep.values())
                == 1), "the steep elements changed: measure them again"
        for k, m in steep.items():
            diff = (got[0]["state"][k] - want["state"][k]).abs()
            assert diff.where(m, 0).max() <= 5e-5 and diff.where(~m, 0).max() <= 1e-5, (k, diff.max())
    assert_states_close(*({k: v for k, v in st.items() if k not in steep}
                          for st in (got[0]["state"], want["state"])))
    mean = [sum(r["losses"][s] for r in got) / WORLD for s in range(STEPS)]
    assert mean == pytest.approx(want["losses"], abs=1e-5)
    if kind == "lora":  # the adapters trained, the frozen base did not move
        reference = make_lora().state_dict()
        assert not torch.equal(got[0]["state"][_a_lora_key(reference)], reference[_a_lora_key(reference)])
        base = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
        assert torch.equal(got[0]["state"][base], reference[base])


def _a_lora_key(state: dict) -> str:
    return next(k for k in state if "lora_A" in k)


def test_generate_finishes_when_ranks_stop_at_different_steps_with_one_process_tokens(sharded):
    runs = [result(sharded, "generation", r) for r in range(WORLD)]
    for run in runs:
        assert run["marked"]
        assert run["got"] == run["expected"]
        assert run["peft_got"] == run["peft_expected"]
    assert len(runs[0]["got"]) - 3 < len(runs[1]["got"]) - 4  # rank 0 stopped first
    assert [len(r["peft_got"]) for r in runs] == [3 + 3, 4 + 8]


def test_save_pretrained_without_state_dict_and_tree_changes_after_sharding_are_refused_with_the_recipe(
        sharded):
    for rank in range(WORLD):
        out = result(sharded, "refusals", rank)
        for key, cls in [("save", "LlamaForCausalLM"), ("peft_save", "PeftModel")]:
            kind, message = out[key]
            assert kind == "CheckpointError" and f"{cls}.save_pretrained" in message
            assert "state_dict=state" in message and "full_state_dict(model)" in message
        for key in ("resize", "peft_resize"):
            kind, message = out[key]
            assert kind == "ShardedTreeChangeError"
            assert "LlamaForCausalLM.resize_token_embeddings" in message and "before fully_shard" in message
        for key in ("tie_weights", "peft_after"):  # the same kind, caught by perparam's registration hooks
            kind, message = out[key]
            assert kind == "ShardedTreeChangeError" and "before fully_shard" in message, message


def test_save_pretrained_with_the_full_state_dict_loads_back_with_from_pretrained(sharded):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    out, path = result(sharded, "refusals"), sharded[1]
    ids = torch.tensor([[1, 2, 3, 4]])
    loaded = LlamaForCausalLM.from_pretrained(f"{path}/llama")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, out["logits"], atol=1e-5, rtol=0)
        adapted = PeftModel.from_pretrained(make_llama(), f"{path}/adapter")
        torch.testing.assert_close(adapted(input_ids=ids).logits, out["peft_logits"], atol=1e-5, rtol=0)


def test_merge_and_unload_with_the_inner_model_as_root_matches_one_process(sharded):
    want = one_process(merging)
    got = result(sharded, "merging")
    torch.testing.assert_close(got["logits"], want["logits"], atol=1e-5, rtol=0)
    assert_states_close(got["state"], want["state"])
    assert not any("lora" in k for k in got["state"])


def test_qlora_dequantized_full_state_dict_loads_into_peft_and_merges(sharded):
    from perparam.quant import get

    state = result(sharded, "qlora")["state"]
    reference = make_lora()
    want = reference.state_dict()
    assert state.keys() == want.keys()  # no _qscale, the original names and shapes
    for key in want:
        if any(key.endswith(n.replace("self_attn.", "")) for n in NF4):
            assert state[key].dtype == torch.float32
            # one block per row (16 < 64)
            bound = get("nf4").error_bound(want[key].abs().amax(dim=1, keepdim=True))
            assert ((state[key] - want[key]).abs() <= bound + 1e-7).all(), key
        else:
            assert torch.equal(state[key], want[key]), key
    reference.load_state_dict(state)
    merged = reference.merge_and_unload()
    assert not any("lora" in k for k in merged.state_dict())
