"""The host-side index arrays of chain drafting (worker/draft_chain.py: EAGLE-3, NEXTN), built
with numpy over a whole step (no Python loop over its requests): which positions the head runs
over after a step (`step_rows`) and where its draft chain keeps K/V (`chain_layout`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenspeed.worker.plan import LAST_SAMPLED, StepOutput, StepPlan


@dataclass
class HeadRows:
    """One step's rows for the head, flat over its requests (plan order): each request's
    positions whose next token is now known, contiguous."""

    slots: np.ndarray  # [B]
    start_pos: np.ndarray  # [B] the request's first row's position
    num_tokens: np.ndarray  # [B] its rows
    drafts: np.ndarray  # [B] bool: it sampled (and drafting is not paused): it drafts from its last row
    positions: np.ndarray  # [R]
    next_ids: np.ndarray  # [R] the token at position + 1 (the row's embedding)
    locs: np.ndarray  # [R] flat KV index, through the request's page table
    aux_rows: np.ndarray  # [R] the row of the step's captured hidden states (0 for carried rows)
    carried_at: np.ndarray  # rows whose hidden state was carried over from the slot's last chunk
    carried_slots: np.ndarray  # their slots
    new_carry_slots: np.ndarray  # prompt chunks that end unsampled: their last token's hidden
    new_carry_rows: np.ndarray  # state (this aux row) waits for the next chunk's first token

    @property
    def query_start(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.num_tokens)]).astype(np.int64)


def _accepted(out: StepOutput, max_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Per slot: (accepted tokens this step, -1 for none or a failed event; their offset in
    out.tokens)."""
    slots = np.asarray(out.slots, np.int64)
    counts = np.asarray(out.counts, np.int64)
    errors = np.zeros(len(slots), np.int64)
    if out.errors is not None:  # prompt-only events (appended, no tokens) have none
        errors[:len(out.errors)] = out.errors
    ok = (counts > 0) & (errors == 0)
    count, at = np.full(max_slots, -1, np.int64), np.zeros(max_slots, np.int64)
    count[slots[ok]] = counts[ok]
    at[slots[ok]] = (np.cumsum(counts) - counts)[ok]
    return count, at


def step_rows(plan: StepPlan, out: StepOutput, carry_pos: np.ndarray, page_table: np.ndarray,
              page_size: int) -> HeadRows:
    """The head's rows after step `plan` with result `out`. A request's rows: its tokens'
    positions whose next token is known (a prompt chunk's but its last; a sampled request's
    verified ones, up to the last accepted token's predecessor), led by its previous chunk's
    last position if that one waited (`carry_pos[slot]`, -1: none; updated here: popped for
    every scheduled slot, set for chunks that end unsampled)."""
    slot = plan.sched_slot.astype(np.int64)
    n = plan.sched_tokens_len.astype(np.int64)
    s = plan.sched_start_pos.astype(np.int64)
    d = plan.sched_num_draft_tokens.astype(np.int64)
    sampled = plan.sched_sample.astype(bool)
    # Speculation paused by the scheduler (spec_gate.rs): the head's KV only, no chain.
    drafting = sampled & ~plan.sched_pause_drafts.astype(bool)
    ids = plan.sched_tokens.astype(np.int64)
    b = len(slot)
    q0 = np.cumsum(n) - n
    acc_n, acc_at = _accepted(out, len(carry_pos))
    acc_n, acc_at = acc_n[slot], acc_at[slot]
    # Overlap scheduling's placeholder inputs (`LAST_SAMPLED`, resolved on the device by the
    # target's forward): only while speculation is paused, as a one-token decode, whose row's
    # next token is the one it sampled (out.tokens), never the placeholder. It draws no chain.
    placeholder = np.bincount(np.repeat(np.arange(b), n)[ids == LAST_SAMPLED], minlength=b) > 0
    drafting &= ~placeholder
    keep = ~sampled | (acc_n >= 0)
    known = n - d - 1  # this step's tokens whose next token is an input of the step
    own = known + np.where(sampled, acc_n, 0)  # plus the accepted ones (the bonus's is not)
    carried = (carry_pos[slot] >= 0) & (carry_pos[slot] == s - 1) & keep
    carry_pos[slot] = -1
    chunk = keep & ~sampled
    carry_pos[slot[chunk]] = (s + n - 1)[chunk]
    count = np.where(keep, own + carried, 0)
    req = np.flatnonzero(count > 0)
    cnt = count[req]
    r = int(cnt.sum())
    ri = np.repeat(req, cnt)  # each row's request
    t = np.arange(r, dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    first = s - carried
    positions = first[ri] + t
    u = t - carried[ri]  # the row's token among this step's (-1: the carried row)
    # The next token: the carried row's is the step's first input, then the step's inputs, then
    # the accepted tokens (out.tokens, after the inputs in `pool`).
    pool = np.concatenate([ids, np.asarray(out.tokens, np.int64)])
    src = np.where(u < 0, q0[ri], np.where(u < known[ri], q0[ri] + 1 + u,
                                           len(ids) + acc_at[ri] + u - known[ri]))
    pages = page_table[slot[ri], positions // page_size].astype(np.int64)
    at = np.flatnonzero(u < 0)
    return HeadRows(
        slots=slot[req], start_pos=first[req], num_tokens=cnt, drafts=drafting[req],
        positions=positions, next_ids=pool[src], locs=pages * page_size + positions % page_size,
        aux_rows=np.maximum(q0[ri] + u, 0), carried_at=at, carried_slots=slot[ri[at]],
        new_carry_slots=slot[chunk], new_carry_rows=(q0 + n - 1)[chunk])


def scratch_pages(steps: int, page_size: int) -> int:
    """Scratch pages a chain row needs: its draft positions p + 1 ... p + steps - 1 from any
    offset of the page holding p + 1."""
    return 0 if steps <= 1 else -(-(page_size - 1 + steps - 1) // page_size)


@dataclass
class ChainLayout:
    """Where the draft chain of the step's drafting requests runs: chain row i (the i-th
    drafting request) reads its verified K/V through its own pages up to the page holding
    p + 1 (p: its last verified position), then scratch pages base + i * S ... (S per row);
    the verified entries of that page are copied into the first scratch page first."""

    rows: np.ndarray  # [C] the drafting requests (indices into HeadRows' requests)
    slots: np.ndarray  # [C] their slots
    last_row: np.ndarray  # [C] their last verified row (flat row index)
    last_pos: np.ndarray  # [C] p
    positions: np.ndarray  # [(steps - 1) * C] step-major: p + j for j = 1 ... steps - 1
    locs: np.ndarray  # [(steps - 1) * C] flat scratch index of each
    table_rows: np.ndarray  # [C * S] head page-table entries to point at scratch pages
    table_cols: np.ndarray
    table_pages: np.ndarray
    copy_src: np.ndarray  # pool page → first scratch page, where p + 1 is not page-aligned
    copy_dst: np.ndarray
    width: int  # page-table columns copied from the requests' rows (those before the scratch)


def chain_layout(rows: HeadRows, steps: int, page_size: int, base: int,
                 page_table: np.ndarray) -> ChainLayout:
    """The chain's layout (see ChainLayout) for `steps` drafts per request; `base`: the first
    scratch page; `page_table`: the target's host page table."""
    per = scratch_pages(steps, page_size)
    rows_i = np.flatnonzero(rows.drafts)
    c = len(rows_i)
    last_row = rows.query_start[rows_i + 1] - 1
    p = rows.positions[last_row]
    first_col = (p + 1) // page_size
    j = np.arange(1, steps, dtype=np.int64)[:, None]
    pos = p[None, :] + j  # [steps - 1, C]
    scratch = base + np.arange(c, dtype=np.int64) * per  # each row's first scratch page
    locs = (scratch[None, :] + pos // page_size - first_col[None, :]) * page_size + pos % page_size
    partial = (p + 1) % page_size != 0
    cols = page_table.shape[1]
    src = page_table[rows.slots[rows_i[partial]], np.minimum(first_col[partial], cols - 1)]
    return ChainLayout(
        rows=rows_i, slots=rows.slots[rows_i], last_row=last_row, last_pos=p, positions=pos.reshape(-1),
        locs=locs.reshape(-1), table_rows=np.repeat(np.arange(c, dtype=np.int64), per),
        table_cols=(first_col[:, None] + np.arange(per)).reshape(-1),
        table_pages=(scratch[:, None] + np.arange(per)).reshape(-1),
        copy_src=src.astype(np.int64), copy_dst=scratch[partial],
        width=int(min(first_col.max(initial=0), cols)))
