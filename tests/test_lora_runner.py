"""LoRA through ModelRunner on CPU (a tiny random Llama, fp32): one batch mixing two adapters
and the base model gives HF PEFT's logits at every generated token (prefill in chunks, then
decode), with one pool slot per adapter and a host cache of one adapter (the other is read
from disk again); with --quantization fp8 the base rows are exactly the fp8 model's and the
adapters' rows track PEFT as closely as the fp8 model tracks HF."""

from __future__ import annotations

import pytest
import torch
from test_fp8_kv_cache import compare, save_tiny_llama

from tokenspeed.worker.model_runner import ModelRunner
from tokenspeed.worker.offline_scheduler import OfflineScheduler
from tokenspeed.worker.plan import StepPlan

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

PROMPTS = [[(11 * i + 7 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([13, 6, 21])]
NEW = 8
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, alpha, rsLoRA, modules): q/v only (the fused qkv's k rows stay zero), everything.
ADAPTERS = {"qv": (4, 8, False, ["q_proj", "v_proj"]), "all": (8, 8, True, ALL)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    path = save_tiny_llama(tmp_path_factory, "tiny_llama_lora", seed=5)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    root = tmp_path_factory.mktemp("tiny_adapters")
    for seed, (name, (rank, alpha, rslora, modules)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=modules)
        wrapped = peft.get_peft_model(model, cfg)
        with torch.no_grad():
            for pname, p in wrapped.named_parameters():
                if "lora_" in pname:
                    p.normal_(0.0, 0.3)
        wrapped.save_pretrained(str(root / name))
        model = wrapped.unload()
    return path, {name: str(root / name) for name in ADAPTERS}


def _peft_logits(path: str, adapters: dict[str, str], runs: list[str | None],
                 tokens: list[list[int]]) -> list[torch.Tensor]:
    """PEFT's logits at each generated position of prompt + `tokens` (teacher forced)."""
    model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32),
        adapters["qv"], adapter_name="qv")
    model.load_adapter(adapters["all"], adapter_name="all")
    out = []
    for prompt, gen, name in zip(PROMPTS, tokens, runs):
        ids = torch.tensor([prompt + gen[:-1]])
        with torch.no_grad():
            if name is None:
                with model.disable_adapter():
                    logits = model(ids).logits[0]
            else:
                model.set_adapter(name)
                logits = model(ids).logits[0]
        out.append(logits[len(prompt) - 1:])
    return out


def _run(path: str, adapters: dict[str, str], runs: list[str | None], teacher=None,
         **kw: object) -> tuple[list[list[int]], list[torch.Tensor]]:
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    lora = {"targets": ALL, "max_rank": 8, "pool_slots": 2, "max_loaded": 1, "eviction": "lru"}
    runner = ModelRunner(path, page_size=4, max_slots=8, max_context_len=128, lora=lora, **kw)  # type: ignore[arg-type]
    sampling = {"lora_id": [ids[r] if r else 0 for r in runs],
                "lora_path": [list(adapters[r].encode()) if r else [] for r in runs]}
    res = OfflineScheduler(runner).generate(PROMPTS, NEW, chunk_size=8, keep_logits=True,
                                            teacher=teacher, sampling=sampling)  # type: ignore[arg-type]
    return res.tokens, [torch.stack(lg) for lg in res.logits]


def test_mixed_batch_matches_peft(tiny: tuple[str, dict[str, str]]) -> None:
    path, adapters = tiny
    runs = ["qv", None, "all"]
    tokens, logits = _run(path, adapters, runs)
    want = _peft_logits(path, adapters, runs, tokens)
    for got, ref, name in zip(logits, want, runs):
        assert (got - ref).abs().max().item() < 1e-3, name
        assert got.argmax(-1).tolist() == ref.argmax(-1).tolist(), name
    plain = _run(path, adapters, [None, None, None])
    assert plain[0][1] == tokens[1] and plain[0][0] != tokens[0] and plain[0][2] != tokens[2], \
        "the adapters change the output, the base row does not"


def test_fp8_base_weights(tiny: tuple[str, dict[str, str]]) -> None:
    path, adapters = tiny
    runs = ["all", None, "qv"]
    ref_tokens, _ = _run(path, adapters, runs)
    ref = (ref_tokens, _peft_logits(path, adapters, runs, ref_tokens))
    got = _run(path, adapters, runs, teacher=ref_tokens, quantization="fp8")
    base_fp8 = _run(path, adapters, [None] * 3, teacher=ref_tokens, quantization="fp8")
    assert torch.equal(got[1][1], base_fp8[1][1]), "a base-model row is the fp8 model's exactly"
    agree, cos, margin = compare(ref, got)
    assert agree >= 0.85 and cos >= 0.99 and margin < 0.3, (agree, cos, margin)
    assert not torch.allclose(got[1][0], base_fp8[1][0]), "the adapter is applied under fp8"


def test_an_unreadable_adapter_fails_its_request_only(tiny: tuple[str, dict[str, str]],
                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    """An adapter deleted after the server checked it: its request's events carry FAILED, the
    request beside it on another adapter runs, and so does the worker."""
    path, adapters = tiny
    lora = {"targets": ALL, "max_rank": 8, "pool_slots": 2, "max_loaded": None, "eviction": "lru"}
    runner = ModelRunner(path, page_size=4, max_slots=4, max_context_len=64, lora=lora)
    gone = str(tmp_path_factory.mktemp("gone"))
    new = [{"slot": 0, "temperature": 0.0, "lora_id": 7, "lora_path": list(gone.encode())},
           {"slot": 1, "temperature": 0.0, "lora_id": 1, "lora_path": list(adapters["qv"].encode())}]
    plan = StepPlan.build(1, new=new, page_tables=[(0, 0, [0, 1]), (1, 0, [2, 3])],
                          scheduled=[(0, 0, PROMPTS[1], True), (1, 0, PROMPTS[1], True)])
    out = runner.step(plan)
    assert out.errors is not None and out.errors.tolist() == [1, 0]
    assert runner.lora is not None and runner.lora.failed == {0}


@pytest.mark.parametrize("policy, kept", [("lru", [1, 3]), ("fifo", [2, 3])])
def test_eviction_policy_picks_the_adapter_that_leaves_the_pool(
        tiny: tuple[str, dict[str, str]], policy: str, kept: list[int]) -> None:
    """Two pool slots; adapters 1 and 2 loaded, 1 used again, then 3 needs a slot: lru gives
    up 2 (least recently used), fifo gives up 1 (loaded first)."""
    path, adapters = tiny
    lora = {"targets": ALL, "max_rank": 8, "pool_slots": 2, "max_loaded": None, "eviction": policy}
    runner = ModelRunner(path, page_size=4, max_slots=4, max_context_len=64, lora=lora)
    pool = runner.lora
    assert pool is not None
    pool.paths.update({1: adapters["qv"], 2: adapters["all"], 3: adapters["qv"]})
    for aid in (1, 2, 1, 3):
        pool._resident(aid, {aid})
    assert sorted(pool.resident) == kept


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_a_pinned_adapter_never_leaves_the_pool(tiny: tuple[str, dict[str, str]],
                                                policy: str) -> None:
    """Two pool slots, adapter 1 pinned (the plan lists it): 2, then 3, then 2 again each take
    the other slot, whichever adapter the policy would give up first."""
    path, adapters = tiny
    lora = {"targets": ALL, "max_rank": 8, "pool_slots": 2, "max_loaded": None, "eviction": policy}
    runner = ModelRunner(path, page_size=4, max_slots=4, max_context_len=64, lora=lora)
    pool = runner.lora
    assert pool is not None
    for slot, (aid, name) in enumerate([(1, "qv"), (2, "all"), (3, "qv")]):
        pool.admit(slot, aid, adapters[name])
    def step(slot: int, pins: list[int]) -> StepPlan:
        return StepPlan.of(sched_slot=[slot], sched_tokens_len=[1], lora_pin_adapter=pins)

    pool.prepare(step(0, [1]), per_token=False)
    first = pool.resident[1]
    for slot in (1, 2, 1):
        pool.prepare(step(slot, [1]), per_token=False)
        assert 1 in pool.resident and pool.resident[1] == first
    assert sorted(pool.resident) == [1, 2]
    # Unpinned, 1 goes: it is both the least recently used and the earliest loaded.
    pool.prepare(step(2, []), per_token=False)
    assert sorted(pool.resident) == [2, 3]
