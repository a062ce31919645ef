//! Building a step: decodes first, then prefill chunks of running requests, then admission;
//! pages come from the pool, the cache, or a retracted younger request.

use super::step_cost::StepShape;
use super::{
    kv_transfer_len, Active, Expected, KvTransfer, Phase, RequestId, Scheduler, Sequence,
    StepBuilder, Work, RESERVE_RATIO_BUMP,
};
use crate::pages::Pages;
use crate::plan::{copy_kind, CopyOp, FinishedSlot, LoraPin, Plan, ScheduledRequest, LAST_SAMPLED};

/// The fewest prompt tokens the time cap leaves a step with decodes: a quarter of the default
/// mixed-step token cap, so that when decodes alone take the whole target a wave of prompts
/// still progresses (at some cost to the gap) instead of waiting for decodes to finish.
const MIN_TIME_CAPPED_PROMPT: usize = 256;
/// The time cap is rounded down to a multiple of this many tokens: steps of fewer distinct
/// sizes, so the worker's eager launches reuse the same cached activation blocks (every new
/// size can make the CUDA allocator free and re-allocate, which waits for the GPU).
const TIME_CAPPED_GRAIN: usize = 64;

impl Scheduler {
    /// Builds the next step, or `None` when there is nothing to run or report.
    ///
    /// May be called again before the last plan's result is `advance`d (one step ahead): see
    /// the module doc. The worker must run plans in order, on one GPU stream.
    pub fn schedule(&mut self) -> Option<Plan> {
        // Before anything is put in the step: a victim must not be both planned and retracted.
        self.preempt_for_waiting();
        if self.spec_waits_for_in_flight() {
            return None;
        }
        let ahead = !self.in_flight.is_empty();
        let mut step = StepBuilder::default();
        self.decide_speculation();
        let full_budget = self.prompt_budget();
        let mut budget = full_budget;
        let mut scheduled = StepShape::default();
        let retracted = self.schedule_running(&mut budget, &mut step, &mut scheduled);
        // Readmitting what was just retracted would only thrash; wait for a step with room.
        if retracted {
            self.reserve_ratio = (self.reserve_ratio + RESERVE_RATIO_BUMP).min(1.0);
        } else if !self.admission_held {
            self.admit(&mut budget, &mut step);
        }
        scheduled.prompt_tokens = full_budget - budget;
        let plan = self.seal(step, scheduled)?;
        if self.config.speculative_algorithm.is_some() {
            self.gate.planned(plan.step_id, self.spec_mode, ahead);
        }
        Some(plan)
    }

    /// Whether speculation is configured and paused: the next step would neither verify
    /// drafts nor draft after itself, and no step that does is in flight. Only then may a step
    /// be planned one step ahead (every paused step yields exactly one token per request, what
    /// a `LAST_SAMPLED` placeholder assumes): the engine overlaps while this holds
    /// (`--disable-overlap-schedule` aside) and drains its steps in flight before the next
    /// speculating one (a probe, or the gate turning speculation back on).
    pub fn spec_paused(&self) -> bool {
        let on_step_in_flight = self
            .gate
            .on_step()
            .is_some_and(|s| self.in_flight.iter().any(|(id, _)| *id == s));
        self.config.speculative_algorithm.is_some()
            && self.gate.peek(self.running.len()) == super::spec_gate::SpecMode::OFF
            && !on_step_in_flight
    }

    /// With speculation configured and a step in flight, nothing is planned unless speculation
    /// is paused (`spec_paused`): drafts, or a step the worker drafts after, never go behind a
    /// step whose accepted tokens are not known yet.
    fn spec_waits_for_in_flight(&self) -> bool {
        self.config.speculative_algorithm.is_some()
            && !self.in_flight.is_empty()
            && !self.spec_paused()
    }

    /// Whether this step speculates (`spec_gate.rs`), from the running batch (the requests
    /// holding a slot; those still in their prompt decode next).
    fn decide_speculation(&mut self) {
        if self.config.speculative_algorithm.is_some() {
            self.spec_mode = self.gate.decide(self.running.len());
        }
    }

    /// Prompt tokens this step may carry. Decodes always run (one token is the least progress
    /// a request can make); prefill chunks get what is left of the chunk budget, and while any
    /// request decodes, at most the mixed-step cap: running streams wait for the whole step.
    fn prompt_budget(&self) -> usize {
        let (mut decodes, mut decode_context) = (0, 0);
        for id in &self.running {
            if self.decode_work(id).is_some() {
                decodes += 1;
                decode_context += self.context_after_decode(id);
            }
        }
        let budget = (self.config.chunked_prefill_size as usize)
            .saturating_sub(decodes)
            .min(self.config.max_prefill_tokens as usize);
        if decodes > 0 {
            let capped = budget.min(self.mixed_prompt_cap(decode_context));
            self.fill_graph_padding(decodes, capped, budget)
        } else {
            budget
        }
    }

    /// A mixed step of `decodes + prompt` tokens replays the extend graph of the next captured
    /// token count, which costs what a step of that many tokens costs: the padding is raised
    /// into prompt tokens (at most `limit`, the budget before the mixed-step caps), work the
    /// next steps would do anyway. S1 with an fp8 cache: 411 decodes + 1,022 prompt tokens ran
    /// as a 1,536-token graph, 7% slower than the eager step it replaced (session 23).
    fn fill_graph_padding(&self, decodes: usize, prompt: usize, limit: usize) -> usize {
        let sizes = &self.config.extend_graph_tokens;
        let graph = sizes
            .iter()
            .map(|&t| t as usize)
            .find(|&t| t >= decodes + prompt);
        match graph {
            Some(tokens) if tokens - decodes <= limit => tokens - decodes,
            _ => prompt,
        }
    }

    /// Puts every running request's work in the step: its decode (with drafts, as far as
    /// pages reach) or its next prompt chunk (within `budget`). When pages run out even after
    /// eviction, the youngest other request is retracted (or a decode that is itself the
    /// youngest gives way). Returns whether any request was retracted.
    fn schedule_running(
        &mut self,
        budget: &mut usize,
        step: &mut StepBuilder,
        scheduled: &mut StepShape,
    ) -> bool {
        let mut retracted = false;
        let mut i = 0;
        while i < self.running.len() {
            let id = self.running[i];
            let decode = self.decode_work(&id);
            let drafts = match decode {
                Some(1) => self.drafts_for(&id, *budget),
                _ => Vec::new(),
            };
            let want = match (decode, self.requests.get(&id).map(Sequence::work)) {
                (Some(n), _) => n + drafts.len(),
                (None, Some(Work::Known(n))) => n.min(*budget),
                _ => 0,
            };
            if want == 0 {
                i += 1;
                continue;
            }
            let fit = self.fit_tokens(id, want);
            if fit == 0 {
                // Out of pages even after eviction: free the youngest other request's.
                if let Some(victim) = self.youngest_retractable(i) {
                    self.retract(victim);
                    retracted = true;
                    continue;
                }
                // This one is the youngest: a decode gives way itself, a prefill chunk waits.
                if i > 0 && decode.is_some() {
                    self.retract(id);
                    retracted = true;
                    continue;
                }
                i += 1;
                continue;
            }
            // Drafts are verified only as far as pages reach (the first token always runs).
            let drafts = &drafts[..drafts.len().min(fit.saturating_sub(1))];
            if decode.is_none() {
                *budget -= fit;
            } else {
                *budget = budget.saturating_sub(drafts.len());
                scheduled.decodes += 1;
                scheduled.decode_context += self.context_after_decode(&id);
            }
            let fit = if decode.is_some() {
                fit - drafts.len()
            } else {
                fit
            };
            self.schedule_chunk(id, fit, drafts, step);
            i += 1;
        }

        retracted
    }

    /// Completes the step: the slots released since the last plan, the cache's copies, its id;
    /// records its shape for the step-time model. `None` when it holds nothing.
    pub(super) fn seal(&mut self, mut step: StepBuilder, scheduled: StepShape) -> Option<Plan> {
        step.plan.finished = std::mem::take(&mut self.released_slots)
            .into_iter()
            .map(|slot| FinishedSlot { slot })
            .collect();
        // Host-tier copies, in the order the cache decided them: before this step's forward.
        step.plan.copies = self.cache.take_copies();
        // PD transfers after them: a received page may be one the cache just wrote back.
        step.plan.copies.append(&mut step.kv_copies);
        if step.plan.is_empty() && !step.poll {
            return None;
        }
        step.plan.lora_pins = self
            .adapters
            .pins
            .iter()
            .map(|&adapter| LoraPin { adapter })
            .collect();
        step.plan.step_id = self.next_step;
        self.next_step += 1;
        self.step_cost.planned(step.plan.step_id, scheduled);
        self.in_flight.push_back((step.plan.step_id, step.expected));
        Some(step.plan)
    }

    /// Most prompt tokens a step that carries decodes may take: `max_mixed_prefill_tokens`, and
    /// while the batch is full, what fits in `max_mixed_step_ms` by the measured run times (at
    /// least `MIN_TIME_CAPPED_PROMPT`, so a wave of prompts still moves when decodes alone fill
    /// it).
    ///
    /// Why not while the batch has room: a full batch of B requests finishes B / output-length
    /// requests a step, and refilling their places costs B x prompt-length / output-length
    /// prompt tokens a step (S1, 1k in / 1k out: B tokens, 400-500 with an fp8 cache). Once
    /// decodes alone fill the target the time cap leaves 256, so admission fell behind
    /// completion and the batch shrank to ~256 with the pool half empty (issue 29). A longer
    /// gap costs the streams less than a batch that cannot refill.
    fn mixed_prompt_cap(&self, decode_context: usize) -> usize {
        let tokens = match self.config.max_mixed_prefill_tokens {
            0 => usize::MAX,
            cap => cap as usize,
        };
        let ms = self.config.max_mixed_step_ms;
        if ms <= 0.0 || self.next_admission_fits() {
            return tokens;
        }
        let timed = self
            .step_cost
            .prompt_tokens_within(ms, decode_context)
            .map_or(usize::MAX, |n| {
                (n / TIME_CAPPED_GRAIN * TIME_CAPPED_GRAIN).max(MIN_TIME_CAPPED_PROMPT)
            });
        tokens.min(timed)
    }

    /// Context a decode of `id` attends to (its KV read, what the decode's time grows with).
    fn context_after_decode(&self, id: &RequestId) -> usize {
        self.requests
            .get(id)
            .and_then(Sequence::active)
            .map_or(0, |a| a.computed + 1)
    }

    /// Tokens `id` feeds in the next step if that is a decode (one token: the last sampled one,
    /// or the placeholder for the one in flight). Decodes always run; prefill shares the budget.
    fn decode_work(&self, id: &RequestId) -> Option<usize> {
        let seq = self.requests.get(id)?;
        match (seq.work(), &seq.phase) {
            (Work::Placeholder, _) => Some(1),
            (Work::Known(n), Phase::Decoding(_)) => Some(n),
            _ => None,
        }
    }

    /// How many of `want` next tokens of `id` can get KV pages now (evicting cache if needed).
    fn fit_tokens(&mut self, id: RequestId, want: usize) -> usize {
        let ps = self.config.page_size as usize;
        let Some(a) = self.requests[&id].active() else {
            return 0;
        };
        let have = a.num_pages() * ps - a.computed;
        let spare = self.pool.free_count() + self.cache.evictable_pages();
        want.min(have + spare * ps).min(self.swa_fit(a))
    }

    /// Makes `n` pages free, evicting cached ones if needed, and takes them.
    pub(super) fn take_pages(&mut self, n: usize) -> Option<Pages> {
        let free = self.pool.free_count();
        if free < n {
            self.cache.evict(n - free);
        }
        self.pool.alloc(n)
    }

    /// Draft tokens to verify after `id`'s next decode token: NGRAM's proposal or the worker's
    /// (EAGLE-3, NEXTN), cut to what the request may still generate (drafts past
    /// `max_new_tokens` or the context could never be kept) and to the step's token budget.
    /// Empty without speculative decoding.
    fn drafts_for(&self, id: &RequestId, budget: usize) -> Vec<u32> {
        let c = &self.config;
        let (Some(k), Some(seq)) = (c.speculative_num_draft_tokens, self.requests.get(id)) else {
            return Vec::new();
        };
        if !self.spec_mode.verify
            || !seq.drafts_allowed
            || !matches!(seq.work(), super::Work::Known(1))
        {
            return Vec::new();
        }
        // The decode yields one token whatever happens; each accepted draft one more.
        let room = (seq.req.max_new_tokens as usize).saturating_sub(seq.completion_tokens() + 1);
        let context_room = (c.context_length as usize).saturating_sub(seq.tokens.len() + 1);
        let k = (k as usize).min(room).min(context_room).min(budget);
        if c.worker_drafts() {
            // Drafted by the worker after the step that produced the last token.
            return seq.proposed[..k.min(seq.proposed.len())].to_vec();
        }
        super::ngram::propose(
            &seq.tokens,
            c.speculative_ngram_min_match_window_size as usize,
            c.speculative_ngram_max_match_window_size as usize,
            k,
        )
    }

    /// Allocates pages for `n` more tokens of running request `id` (plus its `drafts`, which
    /// follow the last known token), emits its share of the step.
    pub(super) fn schedule_chunk(
        &mut self,
        id: RequestId,
        n: usize,
        drafts: &[u32],
        step: &mut StepBuilder,
    ) {
        let ps = self.config.page_size as usize;
        let Some(a) = self.requests[&id].active() else {
            return;
        };
        let need = (a.computed + n + drafts.len())
            .div_ceil(ps)
            .saturating_sub(a.num_pages());
        let Some(new_pages) = self.take_pages(need) else {
            // `fit_tokens` counted these pages as free or evictable; nothing to do but skip.
            return;
        };
        let Some(seq) = self.requests.get_mut(&id) else {
            return;
        };
        let tokens = &seq.tokens;
        let Some(a) = (match &mut seq.phase {
            Phase::Prefilling(a) | Phase::Decoding(a) => Some(a),
            _ => None,
        }) else {
            return;
        };
        if !super::swa::swa_advance(&self.config, &self.swa_pool, a, n + drafts.len(), step) {
            return; // `fit_tokens` counted the sliding pages as free; nothing to do but skip
        }
        if let Some(table) = a.pending_table.take() {
            step.add_pages(a.slot, 0, &table);
        }
        step.add_pages(a.slot, a.num_pages(), new_pages.ids());
        a.own.append(new_pages);
        // Past the known tokens only by one placeholder decode (`Work::Placeholder`).
        let (mut input, sample) = match tokens.get(a.computed..a.computed + n) {
            Some(known) => (known.to_vec(), a.computed + n == tokens.len()),
            None => (vec![LAST_SAMPLED], true),
        };
        // Drafts only ever follow the last known token (`drafts_for`).
        let drafts = if sample && input.last() != Some(&LAST_SAMPLED) {
            drafts
        } else {
            &[]
        };
        input.extend_from_slice(drafts);
        let n = input.len();
        let prompt_done = sample
            && tokens.len() == seq.req.prompt.len()
            && seq.req.kv_transfer.crosses(&seq.req.sampling);
        if let (KvTransfer::Send { room }, true) = (seq.req.kv_transfer, prompt_done) {
            let pages = kv_transfer_len(seq.req.prompt.len(), ps) / ps;
            self.transfers.sent_requests += u64::from(pages > 0);
            self.transfers.sent_pages += pages as u64;
            step.kv_copies.extend(prompt_kv_sends(a, room, pages));
        }
        step.plan.scheduled.push(ScheduledRequest {
            slot: a.slot,
            start_pos: a.computed as u32,
            sample,
            num_draft_tokens: drafts.len() as u32,
            pause_drafts: !self.spec_mode.draft_after,
            tokens: input,
        });
        step.expected.push(Expected {
            id,
            epoch: a.epoch,
            slot: a.slot,
            sample,
            drafts: drafts.len() as u32,
        });
        a.computed += n;
        a.in_flight += 1;
        a.drafting = !drafts.is_empty();
    }

    /// The youngest running request after position `i`. One with steps in flight qualifies
    /// too (with overlap nearly every request has one when the next plan is built): their
    /// results are dropped as stale (`Active::epoch`), their pages are safe to hand out again
    /// (see `release`). Only younger requests give way, so the oldest always progresses.
    fn youngest_retractable(&self, i: usize) -> Option<RequestId> {
        self.running.get(i + 1..)?.last().copied()
    }
}

/// The prompt's last chunk on a prefill server (the request samples once, `max_new_tokens` 1):
/// its first `pages` pages go to the decode server after this step's forward, one `KV_SEND`
/// copy each.
fn prompt_kv_sends(a: &Active, room: u64, pages: usize) -> impl Iterator<Item = CopyOp> + '_ {
    let table = a.prefix_pages.iter().chain(a.own.ids()).take(pages);
    table.map(move |&src| CopyOp {
        src,
        dst: a.slot,
        kind: copy_kind::KV_SEND,
        key: room as i64,
    })
}
