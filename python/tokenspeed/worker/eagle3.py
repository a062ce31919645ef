"""EAGLE-3 drafting in the worker: after a step, the draft head (models/eagle3.py) proposes
each sampled request's next `k` tokens, which ride back in the step's result
(`RequestEvent::draft_tokens`) and become the request's drafts in its next step, verified by
spec_verify.py like NGRAM's (the scheduler's path: exactness, KV rewind, radix cache).

The head's KV. The head is one attention layer over all earlier positions of the request, so
it keeps K/V per position. They live in one extra "layer" beside the target's KV pool: a
[pages * page_size, kv_heads, head_dim] pair addressed by the request's own page table, so
position p of a request sits at the same flat index as its target KV. Pages, their
allocation, release and the radix cache's sharing then hold for the head as they do for the
target, with no second allocator (a cached prefix reused by another request brings the head's
KV with it; only its last position's entry was computed with the first request's next token,
which can cost a draft, never a wrong output). Only *verified* positions are written there:
the entry of position p needs the token at p + 1, so after each step the head runs over the
step's positions whose next token is now known (the prompt's, the accepted ones; a prompt
chunk's last position waits for the next chunk, its target hidden state carried meanwhile).
The chain's own speculative positions keep their K/V in a small per-request list, never in
the pool, so a rejected draft leaves nothing behind.

It runs eagerly in plain torch (SDPA over the request's gathered KV), once per step, after the
step's tokens reach the host: no CUDA graphs, no overlap (the launcher turns overlap off).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenspeed.layers.kv_cache import PagedKVCache
from tokenspeed.models.eagle3 import Eagle3Config, Eagle3Head, attend
from tokenspeed.models.weights import init_dummy_weights
from tokenspeed.worker.pending_step import PendingStep
from tokenspeed.worker.plan import LAST_SAMPLED, StepOutput, StepPlan

logger = logging.getLogger(__name__)


def read_head_tensors(path: str | Path) -> dict[str, torch.Tensor] | None:
    """The head's tensors (*.safetensors, else pytorch_model.bin); None: the directory has
    only a config (a dummy head)."""
    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    if (root / "pytorch_model.bin").exists():
        return torch.load(root / "pytorch_model.bin", map_location="cpu", weights_only=True)
    return None


def load_drafter(runner: Any, eagle3: tuple[str, int] | None, load_format: str,
                 seed: int) -> Eagle3Drafter | None:
    """The runner's EAGLE-3 drafter (`eagle3`: the head's path and its drafts per step), or
    None. Built before the runner's memory profile, which then counts the head's weights, the
    captured hidden states and (`runner.draft_page_bytes`) its KV per page; the runner runs
    eagerly with it (no graph captures the hidden states) and attaches its KV pool later."""
    runner.draft_page_bytes = 0
    if eagle3 is None:
        return None
    drafter = Eagle3Drafter(eagle3[0], runner.model, num_steps=eagle3[1], dtype=runner.dtype,
                            device=runner.device, max_positions=runner.max_context_len,
                            dummy=load_format == "dummy", seed=seed)
    kv_dtype = runner.dtype if runner.kv_dtype.itemsize == 1 else runner.kv_dtype
    runner.draft_page_bytes = Eagle3Drafter.bytes_per_page(drafter.cfg, runner.page_size, kv_dtype)
    return drafter


class _Rows:
    """One step's rows for the head, flat over its requests: each request's positions whose
    next token is known."""

    def __init__(self) -> None:
        self.aux: list[torch.Tensor] = []  # target hidden rows [n, 3 * target_hidden]
        self.next_ids: list[int] = []
        self.positions: list[int] = []
        self.locs: list[int] = []
        # per request: (slot, its rows' span in the flat lists, whether it drafts)
        self.requests: list[tuple[int, int, int, bool]] = []


class Eagle3Drafter:
    """The head, its KV beside the target's pool, and the drafting after each step."""

    def __init__(self, path: str, target: torch.nn.Module, *, num_steps: int,
                 dtype: torch.dtype, device: torch.device, max_positions: int, dummy: bool,
                 seed: int) -> None:
        """Loads the head and sets the target's capture; `attach` gives it its KV once the
        pool is sized (the head's weights and captured states count in the memory profile)."""
        self.cfg = cfg = Eagle3Config.load(path)
        self.num_steps = num_steps
        self.target = target
        self.max_positions = max_positions
        with torch.device(device):
            head = Eagle3Head(cfg, max_positions + num_steps + 1)
        tensors = read_head_tensors(path)
        if tensors is None:
            if not dummy:
                raise ValueError(f"--speculative-draft-model-path {path}: no *.safetensors or "
                                 "pytorch_model.bin (a config alone needs --load-format dummy)")
            init_dummy_weights(head, seed + 1)
        else:
            head.load(tensors)
        for name, module in head.named_children():
            if name != "rotary":  # RoPE tables stay float32
                module.to(dtype)
        self.head = head.eval().requires_grad_(False)
        layers = cfg.capture_layers(len(target.model.layers))
        target.model.capture_layers = layers  # models/llama.py: the residual stream there
        self.kv_cache: PagedKVCache | None = None
        self.aux: torch.Tensor | None = None  # the last forward's captured hidden states
        self.k = self.v = torch.zeros(0, device=device)
        # slot → (position, target hidden row) of a prompt chunk's last token, whose next
        # token is the next chunk's first.
        self._carry: dict[int, tuple[int, torch.Tensor]] = {}
        logger.info("EAGLE-3 head %s: %d draft tokens per step (chain), draft vocabulary %d, "
                    "target layers %s", path, num_steps, cfg.draft_vocab_size, layers)

    def attach(self, kv_cache: PagedKVCache) -> None:
        """The head's K/V: one entry per flat index of the target's pool."""
        c, size = self.cfg, kv_cache.num_pages * kv_cache.page_size
        self.kv_cache = kv_cache
        self.k = torch.zeros(size, c.num_kv_heads, c.head_dim, dtype=kv_cache.k[0].dtype
                             if kv_cache.k[0].element_size() > 1 else self.head.fc.weight.dtype,
                             device=self.head.fc.weight.device)
        self.v = torch.zeros_like(self.k)

    @staticmethod
    def bytes_per_page(cfg: Eagle3Config, page_size: int, dtype: torch.dtype) -> int:
        """The head's share of one KV page (its one layer's K and V)."""
        elem = torch.empty(0, dtype=dtype).element_size()
        return 2 * page_size * cfg.num_kv_heads * cfg.head_dim * elem

    def _pool(self) -> PagedKVCache:
        if self.kv_cache is None:
            raise RuntimeError("EAGLE-3 drafter used before attach(kv_cache)")
        return self.kv_cache

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.head.embed_tokens
        return e(ids) if e is not None else self.target.model.embed_tokens(ids)

    def after(self, plan: StepPlan, step: PendingStep) -> PendingStep:
        """Waits for the step's tokens, then proposes each request's next drafts, which go
        back in the step's result."""
        out, aux = step.wait(), self.aux
        self.aux = None
        if aux is not None:
            out.draft_tokens = self.propose(plan, aux, out)
        return PendingStep.done(out)

    @torch.inference_mode()
    def propose(self, plan: StepPlan, aux: torch.Tensor, out: StepOutput) -> list[np.ndarray]:
        """Draft tokens per event of `out` (its order), after the step `plan` whose target
        forward captured `aux` [tokens, 3 * target_hidden]; writes the head's KV of every
        position whose next token is now known."""
        for slot in plan.finished_slot.tolist():
            self._carry.pop(slot, None)
        rows = self._rows(plan, aux, out)
        drafts: dict[int, np.ndarray] = {}
        if rows.positions:
            drafts = self._run(rows)
        none = np.zeros(0, np.int64)
        return [drafts.get(s, none) for s in np.asarray(out.slots).tolist()]

    def _rows(self, plan: StepPlan, aux: torch.Tensor, out: StepOutput) -> _Rows:
        accepted: dict[int, list[int]] = {}
        ends = np.cumsum(out.counts)
        errors = out.errors if out.errors is not None else np.zeros(len(out.slots))
        for slot, end, n, err in zip(np.asarray(out.slots).tolist(), ends.tolist(),
                                     out.counts.tolist(), errors.tolist()):
            if not err and n:
                accepted[slot] = np.asarray(out.tokens[end - n:end]).tolist()
        rows, start = _Rows(), 0
        ids_all = plan.sched_tokens.astype(np.int64)
        for i, slot in enumerate(plan.sched_slot.tolist()):
            n, s = int(plan.sched_tokens_len[i]), int(plan.sched_start_pos[i])
            d = int(plan.sched_num_draft_tokens[i])
            ids, q0 = ids_all[start:start + n].tolist(), start
            start += n
            carry = self._carry.pop(slot, None)
            if LAST_SAMPLED in ids:  # overlap scheduling: never with EAGLE-3; nothing to do
                continue
            sampled = bool(plan.sched_sample[i])
            if sampled and slot not in accepted:
                continue
            nxt = ids[1:n - d] + (accepted[slot] if sampled else [])
            first = len(rows.positions)
            if carry is not None and carry[0] == s - 1:
                rows.aux.append(carry[1][None])
                rows.next_ids.append(ids[0])
                rows.positions.append(s - 1)
            rows.aux.append(aux[q0:q0 + len(nxt)])
            rows.next_ids += nxt
            rows.positions += range(s, s + len(nxt))
            if not sampled:
                self._carry[slot] = (s + n - 1, aux[q0 + n - 1].clone())
            if len(rows.positions) > first:
                lo, hi = rows.positions[first], rows.positions[-1] + 1
                rows.locs += self._pool().cache_locs(slot, lo, hi).tolist()
                rows.requests.append((slot, first, len(rows.positions), sampled))
        return rows

    def _run(self, rows: _Rows) -> dict[int, np.ndarray]:
        head, dev = self.head, self.k.device
        pos = torch.tensor(rows.positions, dtype=torch.int64, device=dev)
        locs = torch.tensor(rows.locs, dtype=torch.int64, device=dev)
        hidden = head.fc(torch.cat(rows.aux).to(head.fc.weight.dtype))
        q, k, v = head.qkv(self.embed(torch.tensor(rows.next_ids, device=dev)), hidden, pos)
        self.k[locs], self.v[locs] = k.to(self.k.dtype), v.to(self.v.dtype)
        attn = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=dev)
        for slot, a, b, _ in rows.requests:
            last = rows.positions[b - 1]
            kv_loc, kv_pos = self._history(slot, last)
            attn[a:b] = attend(q[a:b], self.k[kv_loc], self.v[kv_loc], pos[a:b], kv_pos)
        outs = head.finish(attn, hidden)
        chains = [(slot, b - 1) for slot, _, b, sampled in rows.requests if sampled]
        if not chains:
            return {}
        return self._chain([s for s, _ in chains], outs[[r for _, r in chains]],
                           [rows.positions[r] for _, r in chains])

    def _history(self, slot: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat KV indices and positions of a request's positions 0..last."""
        locs = self._pool().cache_locs(slot, 0, last + 1)
        dev = self.k.device
        return (torch.from_numpy(locs).to(dev),
                torch.arange(last + 1, device=dev, dtype=torch.int64))

    def _chain(self, slots: list[int], outs: torch.Tensor,
               last: list[int]) -> dict[int, np.ndarray]:
        """`num_steps` greedy drafts per request: the first from the layer output at its last
        verified position, each next one by running the head one position further on the
        draft before it and that output (the chain's K/V kept here, not in the pool)."""
        head, dev = self.head, self.k.device
        tokens = [head.draft_ids(outs)]
        hist = [self._history(s, p) for s, p in zip(slots, last)]
        chain_k: list[list[torch.Tensor]] = [[] for _ in slots]
        chain_v: list[list[torch.Tensor]] = [[] for _ in slots]
        steps = self.num_steps  # the scheduler cuts drafts past the context
        for j in range(1, steps):
            pos = torch.tensor([p + j for p in last], dtype=torch.int64, device=dev)
            q, k, v = head.qkv(self.embed(tokens[-1]), outs, pos)
            attn = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=dev)
            for i, (loc, kv_pos) in enumerate(hist):
                chain_k[i].append(k[i:i + 1])
                chain_v[i].append(v[i:i + 1])
                ks = torch.cat([self.k[loc].to(k.dtype), *chain_k[i]])
                vs = torch.cat([self.v[loc].to(v.dtype), *chain_v[i]])
                ps = torch.cat([kv_pos, pos[i:i + 1] - torch.arange(j - 1, -1, -1, device=dev)])
                attn[i] = attend(q[i:i + 1], ks, vs, pos[i:i + 1], ps)[0]
            outs = head.finish(attn, outs)
            tokens.append(head.draft_ids(outs))
        ids = torch.stack(tokens, dim=1).cpu().numpy()
        return {s: ids[i] for i, s in enumerate(slots)}
