"""NEXTN under tensor parallelism (CPU, gloo, fp32): the MTP layer's decoder layer is sharded as
the target's (MLA heads and experts split over the ranks, the same layer classes), its own small
tensors (enorm, hnorm, eh_proj, shared_head) replicated; both ranks of `--tp 2` (with or without
`--ep-size 2`) draft exactly what one rank drafts, step after step."""

from __future__ import annotations

import pytest
from deepseek_mtp_model import make_mtp_model
from tp_ranks import eagle3_drafts_on_rank, run_ranks

from tokenspeed.distributed.groups import ParallelSizes

STEPS = 3


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("nextn_tp")
    make_mtp_model(path)
    return str(path)


@pytest.mark.parametrize("ep", [1, 2], ids=["moe_tp2", "ep2"])
def test_tp2_ranks_draft_what_one_rank_drafts(mtp_path: str, ep: int) -> None:
    # `--tp 2` (experts split in two) and `--tp 2 --ep-size 2` (each rank half the experts).
    prompt = [(37 * i) % 250 + 3 for i in range(11)]
    ref, ref_shapes = eagle3_drafts_on_rank(0, mtp_path, None, prompt, STEPS, "NEXTN")
    sizes = ParallelSizes(world_size=2, attn_tp=2, dense_tp=2, moe_tp=2 // ep, ep=ep)
    ranks = run_ranks(eagle3_drafts_on_rank, 2, mtp_path, None, prompt, STEPS, "NEXTN",
                      sizes=sizes)
    for trace, shapes in ranks:
        assert trace == ref
        assert shapes.keys() == ref_shapes.keys()
        for own in ("eh_proj.weight", "enorm.weight", "shared_head.head.weight"):
            assert shapes[own] == ref_shapes[own]  # replicated
        sharded = [n for n in shapes if shapes[n] != ref_shapes[n]]
        assert any("self_attn" in n for n in sharded), sharded  # MLA heads split
        assert any("mlp" in n for n in sharded), sharded  # experts split
    assert all(len(d) == STEPS for _, d in ref)
