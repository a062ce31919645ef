//! Admission: which waiting requests get a slot and their first prefill chunk in this step.
//!
//! A request is admitted only if the pages left over after what running requests are still
//! expected to need (their unprefilled prompt and expected growth, see `RESERVE_*`) hold its
//! uncached prompt and expected growth too; an idle engine always admits.

use super::{
    kv_transfer_len, Active, KvTransfer, Phase, RequestId, SchedulePolicy, Scheduler, Sequence,
    StepBuilder, LPM_MAX_WAITING, RESERVE_CLIP,
};
use crate::plan::{copy_kind, CopyOp};

/// How many of a request's tokens may come from the prefix cache. Never the whole sequence: the
/// last token must be computed to get logits. Prompt logprobs need every prompt position
/// computed, and penalties every token fed to the worker (its history): no cached prefix then.
/// Nor for pooling: the model pools over every position (and an encoder's attention is
/// bidirectional, so its KV is no prefix of anything).
pub(super) fn matchable_len(seq: &Sequence) -> usize {
    let sampling = &seq.req.sampling;
    if (sampling.prompt_logprobs && seq.completion_tokens() == 0)
        || sampling.penalized()
        || sampling.pooling
        || received_room(seq).is_some()
    {
        0
    } else {
        seq.tokens.len() - 1
    }
}

/// The transfer a decode server's request receives its prompt KV from (`KvTransfer::Recv`),
/// at its first admission only: readmitted after a retraction, it computes its prompt.
pub(super) fn received_room(seq: &Sequence) -> Option<u64> {
    match seq.req.kv_transfer {
        KvTransfer::Recv { room }
            if seq.cached_tokens.is_none() && seq.req.kv_transfer.crosses(&seq.req.sampling) =>
        {
            Some(room)
        }
        _ => None,
    }
}

impl Scheduler {
    /// Prompt tokens whose KV `seq` receives at this admission instead of computing them.
    pub(super) fn received_len(&self, seq: &Sequence) -> usize {
        received_room(seq).map_or(0, |_| {
            kv_transfer_len(seq.req.prompt.len(), self.config.page_size as usize)
        })
    }

    /// Gives admitted request `id` fresh pages for its first `tokens` tokens and plans their
    /// transfer from the prefill server into them (before the step's forward): their KV then
    /// counts as computed.
    fn receive_kv(&mut self, id: RequestId, tokens: usize, step: &mut StepBuilder) {
        let ps = self.config.page_size as usize;
        let Some(pages) = self.take_pages(tokens / ps) else {
            return; // admission counted them as free or evictable; the prompt is computed
        };
        let Some(seq) = self.requests.get_mut(&id) else {
            return;
        };
        let KvTransfer::Recv { room } = seq.req.kv_transfer else {
            return;
        };
        let Phase::Prefilling(a) = &mut seq.phase else {
            return;
        };
        step.add_pages(a.slot, a.num_pages(), pages.ids());
        step.kv_copies
            .extend(pages.ids().iter().map(|&page| CopyOp {
                src: a.slot,
                dst: page,
                kind: copy_kind::KV_RECV,
                key: room as i64,
            }));
        self.transfers.received_requests += 1;
        self.transfers.received_pages += pages.ids().len() as u64;
        a.own.append(pages);
        a.computed = tokens;
    }

    /// Tokens a request is still expected to generate, as admission budgets them.
    pub(super) fn expected_growth(&self, seq: &Sequence) -> usize {
        let remaining = (seq.req.max_new_tokens as usize).saturating_sub(seq.completion_tokens());
        // A request that ignores EOS runs to max_new_tokens (barring an abort): no guessing.
        let ratio = if seq.req.ignore_eos {
            1.0
        } else {
            self.reserve_ratio
        };
        (remaining.min(RESERVE_CLIP) as f64 * ratio).ceil() as usize
    }

    /// Pages kept back for the running requests: the rest of their prompts and their
    /// expected growth.
    fn reserved_pages(&self) -> usize {
        self.reserved_pages_of(self.running.iter())
    }

    /// Pages kept back for running requests `ids` (`reserved_pages` of a subset).
    pub(super) fn reserved_pages_of<'a>(&self, ids: impl Iterator<Item = &'a RequestId>) -> usize {
        let ps = self.config.page_size as usize;
        let tokens: usize = ids
            .filter_map(|id| self.requests.get(id))
            .map(|seq| {
                // A placeholder in flight puts `computed` one past the known tokens.
                let unprefilled = seq
                    .active()
                    .map_or(0, |a| seq.tokens.len().saturating_sub(a.computed));
                unprefilled + self.expected_growth(seq)
            })
            .sum();
        tokens.div_ceil(ps)
    }

    /// Admits waiting requests in policy order while slots, budget and pages last.
    pub(super) fn admit(&mut self, budget: &mut usize, step: &mut StepBuilder) {
        let ps = self.config.page_size as usize;
        let mut reserved = self.reserved_pages();
        let mut adapters = self.running_adapters();
        for id in self.admission_order() {
            if *budget == 0 || self.free_slots.is_empty() {
                break;
            }
            let Some(seq) = self.requests.get(&id) else {
                continue;
            };
            let adapter = seq.req.sampling.lora_id;
            if !self.adapters.admits(&adapters, adapter) {
                continue; // waits for a pool slot; requests on running adapters go ahead
            }
            if adapter != 0 {
                adapters.insert(adapter);
            }
            let ns = seq.req.sampling.lora_id;
            let m = self
                .cache
                .match_prefix_in(ns, &seq.tokens[..matchable_len(seq)]);
            self.cache.lock(m.node);
            let spare = self.pool.free_count() + self.cache.evictable_pages();
            let (growth, uncached) = (self.expected_growth(seq), seq.tokens.len() - m.len);
            if !self.fits_beside_running(uncached + growth, reserved) || !self.swa_fits(seq) {
                self.cache.unlock(m.node);
                break;
            }
            // Received pages need room but no compute (PD decode server; 0 otherwise).
            let received = self.received_len(seq);
            let n = (uncached - received)
                .min(*budget)
                .min((spare * ps).saturating_sub(received));
            // A pooling prompt runs whole or waits (no chunks), in arrival order like any other.
            if n == 0 || (seq.req.sampling.pooling && n < uncached) {
                // Head-of-line blocking is deliberate: skipping ahead would starve long prompts.
                self.cache.unlock(m.node);
                break;
            }
            let Some(slot) = self.free_slots.pop_first() else {
                self.cache.unlock(m.node);
                break;
            };
            let own = self.pool.empty();
            let Some(seq) = self.requests.get_mut(&id) else {
                continue;
            };
            if seq.cached_tokens.is_none() {
                // Received KV (PD) counts as cached: this server computed none of it.
                seq.cached_tokens = Some((m.len + received).min(seq.req.prompt.len()) as u32);
                self.admitted.push(id);
            }
            step.plan.new_requests.push(seq.worker_params(slot));
            step.add_pages(slot, 0, &m.pages);
            seq.phase = Phase::Prefilling(Active {
                slot,
                epoch: self.next_epoch,
                prefix_node: m.node,
                prefix_pages: m.pages,
                own,
                computed: m.len,
                in_flight: 0,
                drafting: false,
                pending_table: None,
                ns,
                swa: self.swa_pool.empty(),
                swa_released: 0,
            });
            self.next_epoch += 1;
            self.waiting.retain(|&w| w != id);
            self.running.push(id);
            if received > 0 {
                self.receive_kv(id, received, step);
            }
            self.schedule_chunk(id, n, &[], step);
            *budget -= n;
            reserved += (uncached - received - n + growth).div_ceil(ps);
        }
    }

    /// The LoRA adapters of the running requests (the base model, 0, left out).
    fn running_adapters(&self) -> std::collections::HashSet<u32> {
        self.running
            .iter()
            .filter_map(|id| self.requests.get(id))
            .map(|seq| seq.req.sampling.lora_id)
            .filter(|&a| a != 0)
            .collect()
    }

    /// Whether a request that needs pages for `tokens` more tokens (its uncached prompt and
    /// expected growth) fits beside what running requests still need (`reserved` pages): the
    /// test admission applies. An idle engine always admits (the request fits the pool:
    /// `submit` checked).
    fn fits_beside_running(&self, tokens: usize, reserved: usize) -> bool {
        let spare = self.pool.free_count() + self.cache.evictable_pages();
        self.running.is_empty()
            || spare >= reserved + tokens.div_ceil(self.config.page_size as usize)
    }

    /// Whether the next request in admission order would be admitted if the step had the
    /// prompt tokens for it: a slot is free and its pages fit beside the running requests'.
    /// While this holds the batch is not full and a mixed step's prompt share is not capped
    /// by time (`Scheduler::mixed_prompt_cap`).
    pub(super) fn next_admission_fits(&self) -> bool {
        if self.free_slots.is_empty() {
            return false;
        }
        // The queue's head, without copying the queue (S1: ~2,000 ids) when nothing reorders it.
        let next = if self.reorders() {
            self.admission_order().first().copied()
        } else {
            self.waiting.front().copied()
        };
        let Some(seq) = next.and_then(|id| self.requests.get(&id)) else {
            return false;
        };
        let cached = self
            .cache
            .peek_prefix_len_in(seq.req.sampling.lora_id, &seq.tokens[..matchable_len(seq)]);
        let tokens = seq.tokens.len() - cached + self.expected_growth(seq);
        self.fits_beside_running(tokens, self.reserved_pages()) && self.swa_fits(seq)
    }

    pub(super) fn admission_order(&self) -> Vec<RequestId> {
        let mut order: Vec<RequestId> = self.waiting.iter().copied().collect();
        let lpm = self.lpm_reorders();
        if lpm || self.config.enable_priority_scheduling {
            let mut keyed: Vec<(i64, bool, usize, RequestId)> = order
                .iter()
                .map(|id| {
                    let seq = &self.requests[id];
                    let retracted = matches!(seq.phase, Phase::Retracted);
                    let matched = if lpm {
                        self.cache.peek_prefix_len_in(
                            seq.req.sampling.lora_id,
                            &seq.tokens[..seq.tokens.len() - 1],
                        )
                    } else {
                        0
                    };
                    (self.urgency(&seq.req), retracted, matched, *id)
                })
                .collect();
            // Stable: ties keep arrival order (FCFS within a priority). Most urgent first;
            // within a priority, retracted requests keep their place at the front, so the
            // oldest request still progresses; then the longest cached prefix (lpm).
            keyed.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2)));
            order = keyed.into_iter().map(|k| k.3).collect();
        }
        order
    }

    /// A request's rank in admission order, smallest first: its priority, negated when larger
    /// values are the urgent ones; 0 for all when priority scheduling is off.
    pub(super) fn urgency(&self, req: &crate::Request) -> i64 {
        match (
            self.config.enable_priority_scheduling,
            self.config.schedule_low_priority_values_first,
        ) {
            (false, _) => 0,
            (true, true) => req.priority,
            (true, false) => req.priority.saturating_neg(),
        }
    }

    /// Whether admission order differs from arrival order: priority scheduling, or `lpm` while
    /// few enough wait that ranking them is cheap.
    fn reorders(&self) -> bool {
        self.config.enable_priority_scheduling || self.lpm_reorders()
    }

    /// Whether `lpm` ranks the queue: while few enough wait that ranking them is cheap.
    fn lpm_reorders(&self) -> bool {
        self.config.schedule_policy == SchedulePolicy::Lpm && self.waiting.len() <= LPM_MAX_WAITING
    }
}
