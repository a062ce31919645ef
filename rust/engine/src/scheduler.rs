//! The scheduler: a synchronous state machine turning submitted requests into step plans.
//!
//! Each `schedule()` builds one continuous-batching step: every running decode feeds one token,
//! then prefill chunks (of running, then newly admitted requests) fill the rest of the token
//! budget. `advance()` takes the worker's sampled tokens back. KV pages come from the radix
//! cache's pool; when they run short the scheduler evicts cached pages and then retracts the
//! youngest running request (its KV is cached and it is recomputed later), so the oldest
//! request always progresses and the system never deadlocks.
//!
//! One-step-ahead ("overlap") scheduling needs nothing from the configuration: the engine may
//! call `schedule()` again before the last plan's result is `advance`d. A request whose only
//! unknown is the token its in-flight step samples is then scheduled with `LAST_SAMPLED` as
//! input (a placeholder the worker resolves on the GPU); a request in the middle of its prompt
//! gets its next chunk. An engine that never schedules with a plan in flight never sees a
//! placeholder: the state at every `schedule()` is then the one-plan-at-a-time state.

use std::collections::{BTreeSet, HashMap, VecDeque};

use crate::pages::{PagePool, Pages};
use crate::plan::{
    NewRequestPlan, PageTableUpdate, Plan, SampledToken, ScheduledRequest, StepResult, LAST_SAMPLED,
};
use crate::radix::{NodeId, RadixCache};

mod admission;
mod request;

pub use request::{
    ConfigError, FinishReason, Request, RequestOutput, SchedulePolicy, SchedulerConfig,
    SchedulerStats, SubmitError,
};

/// Above this many waiting requests `lpm` falls back to arrival order: ranking costs a tree walk
/// per waiting request per step (SGLang makes the same trade).
const LPM_MAX_WAITING: usize = 128;

/// Admission keeps pages back for the tokens running requests are still expected to generate:
/// `min(remaining, RESERVE_CLIP) * ratio` each, where the ratio tracks (moving average) what
/// share of `max_new_tokens` finished requests actually used, and rises on a retraction.
/// Without it, admitting on free pages alone filled the pool with prompts and then thrashed
/// (retract, recompute) once they all decoded.
const RESERVE_CLIP: usize = 4096;
const RESERVE_RATIO_INIT: f64 = 0.7;
const RESERVE_RATIO_MIN: f64 = 0.1;
/// Weight of one finished request in the moving average.
const RESERVE_RATIO_EMA: f64 = 0.1;
const RESERVE_RATIO_BUMP: f64 = 0.2;

/// Where a request is in its life. Resources live in the variants that need them, so a state
/// change moves or drops them and no state can hold pages it should not.
enum Phase {
    /// Submitted, never admitted.
    Waiting,
    /// Was running, gave its pages back under memory pressure; recomputes `tokens` when readmitted.
    Retracted,
    /// Has a slot; the prompt's KV is being computed in chunks.
    Prefilling(Active),
    /// Has a slot; feeds one token per step.
    Decoding(Active),
    /// Done (the reason went out in its last output); it leaves the scheduler right after.
    Finished,
}

/// A request's hold on a worker slot and KV pages.
struct Active {
    slot: u32,
    /// This admission's number, unique over the scheduler's life. A result is applied only to
    /// the admission it was planned for, not to a later one of the same request (retracted and
    /// readmitted while the step was in flight, maybe in the same slot).
    epoch: u64,
    /// The cached prefix it started from, locked in the radix tree (`ROOT` when none).
    prefix_node: NodeId,
    /// Pages of that prefix: owned by the tree, valid while `prefix_node` stays locked.
    prefix_pages: Vec<u32>,
    /// Pages for the positions after the prefix.
    own: Pages,
    /// Positions whose KV is computed or is being computed by a plan already sent. With a
    /// placeholder in flight this is one more than the known tokens (`Sequence::tokens`).
    computed: usize,
    /// Prefix tokens served from the cache at this admission.
    cached_len: u32,
    /// Steps of this admission whose results have not come back.
    in_flight: u32,
    /// Of those, the ones that sample a token. At most 2: the step that feeds the last known
    /// token and one placeholder decode after it. While it is 1 or 2, the known tokens are
    /// exactly `computed + 1 - pending_samples`.
    pending_samples: u32,
    /// Page-table entries 0.. to rewrite in the slot's next plan: set when caching the prompt
    /// found another request's identical pages already in the tree and ours were freed.
    pending_table: Option<Vec<u32>>,
}

impl Active {
    fn num_pages(&self) -> usize {
        self.prefix_pages.len() + self.own.len()
    }
}

/// What a running request can feed in the next step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Work {
    /// Nothing until a result comes back.
    Idle,
    /// This many known tokens are not scheduled yet: the rest of the prompt, or the last
    /// sampled token. A prompt chunk may follow one still in flight: the worker runs plans in
    /// order on one stream, so the earlier chunk's KV is written before the later one reads it.
    Known(usize),
    /// A decode of the token the in-flight step samples, as `LAST_SAMPLED`.
    Placeholder,
}

struct Sequence {
    req: Request,
    /// Prompt, then every generated token. A retracted request recomputes all of it.
    tokens: Vec<u32>,
    /// Prompt tokens served from the cache at first admission (what usage reports).
    cached_tokens: Option<u32>,
    phase: Phase,
}

impl Sequence {
    fn completion_tokens(&self) -> usize {
        self.tokens.len() - self.req.prompt.len()
    }

    fn active(&self) -> Option<&Active> {
        match &self.phase {
            Phase::Prefilling(a) | Phase::Decoding(a) => Some(a),
            _ => None,
        }
    }

    fn active_mut(&mut self) -> Option<&mut Active> {
        match &mut self.phase {
            Phase::Prefilling(a) | Phase::Decoding(a) => Some(a),
            _ => None,
        }
    }

    fn work(&self) -> Work {
        let Some(a) = self.active() else {
            return Work::Idle;
        };
        if a.computed < self.tokens.len() {
            return Work::Known(self.tokens.len() - a.computed);
        }
        // Every known token is scheduled. At most one unknown token ahead, and none when the
        // sample in flight will be the last one anyway (`max_new_tokens`): that decode would be
        // wasted. A stop token can only be seen when it comes back, so a request that stops
        // computes one token too many; that token is never reported.
        let pending = a.pending_samples as usize;
        if pending == 1 && self.completion_tokens() + pending < self.req.max_new_tokens as usize {
            Work::Placeholder
        } else {
            Work::Idle
        }
    }
}

/// What a step expects back for one scheduled request.
struct Expected {
    id: u64,
    /// The admission the step was planned for (`Active::epoch`).
    epoch: u64,
    slot: u32,
    sample: bool,
}

/// The plan being built by one `schedule()` call.
#[derive(Default)]
struct StepBuilder {
    plan: Plan,
    expected: Vec<Expected>,
}

impl StepBuilder {
    fn add_pages(&mut self, slot: u32, first_index: usize, pages: &[u32]) {
        if !pages.is_empty() {
            self.plan.page_table_updates.push(PageTableUpdate {
                slot,
                first_index: first_index as u32,
                pages: pages.to_vec(),
            });
        }
    }
}

pub struct Scheduler {
    config: SchedulerConfig,
    pool: PagePool,
    cache: RadixCache,
    requests: HashMap<u64, Sequence>,
    /// Ids not admitted yet, in arrival order (retracted ones pushed to the front).
    waiting: VecDeque<u64>,
    /// Ids holding a slot, oldest admission first: retraction takes from the back.
    running: Vec<u64>,
    free_slots: BTreeSet<u32>,
    /// Slots released since the last plan.
    released_slots: Vec<u32>,
    next_step: u64,
    next_epoch: u64,
    /// Share of running requests' remaining tokens that admission keeps pages back for.
    reserve_ratio: f64,
    in_flight: VecDeque<(u64, Vec<Expected>)>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let pool = PagePool::new(config.num_pages);
        let cache = RadixCache::new(
            pool.clone(),
            config.page_size as usize,
            config.enable_radix_cache,
        );
        Ok(Scheduler {
            free_slots: (0..config.max_running_requests).collect(),
            config,
            pool,
            cache,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            released_slots: Vec::new(),
            next_step: 0,
            next_epoch: 0,
            reserve_ratio: RESERVE_RATIO_INIT,
            in_flight: VecDeque::new(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Queues a request, or says why it can never be served.
    pub fn submit(&mut self, req: Request) -> Result<(), SubmitError> {
        let id = req.id;
        if self.requests.contains_key(&id) {
            return Err(SubmitError::DuplicateId { id });
        }
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt { id });
        }
        if req.max_new_tokens == 0 {
            return Err(SubmitError::ZeroMaxNewTokens { id });
        }
        let total = req.prompt.len() as u64 + u64::from(req.max_new_tokens);
        if total > u64::from(self.config.max_context_len) {
            return Err(SubmitError::ContextTooLong {
                id,
                prompt_tokens: req.prompt.len(),
                max_new_tokens: req.max_new_tokens,
                max_context_len: self.config.max_context_len,
            });
        }
        // The last sampled token is never fed back, so it needs no KV.
        let pages = (total - 1).div_ceil(u64::from(self.config.page_size));
        if pages > u64::from(self.config.num_pages) {
            return Err(SubmitError::ExceedsKvPool {
                id,
                tokens: total - 1,
                pages_needed: pages,
                total_pages: self.config.num_pages,
            });
        }
        let tokens = req.prompt.clone();
        self.requests.insert(
            id,
            Sequence {
                req,
                tokens,
                cached_tokens: None,
                phase: Phase::Waiting,
            },
        );
        self.waiting.push_back(id);
        Ok(())
    }

    /// Drops a request wherever it is; a running one's slot is reported in the next plan.
    /// Returns false for an unknown (or already finished) id.
    pub fn abort(&mut self, id: u64) -> bool {
        let Some(mut seq) = self.requests.remove(&id) else {
            return false;
        };
        self.waiting.retain(|&w| w != id);
        self.running.retain(|&r| r != id);
        if let Phase::Prefilling(active) | Phase::Decoding(active) =
            std::mem::replace(&mut seq.phase, Phase::Waiting)
        {
            self.release(&seq.tokens, active);
        }
        true
    }

    /// Builds the next step, or `None` when there is nothing to run or report.
    ///
    /// May be called again before the last plan's result is `advance`d (one step ahead): see
    /// the module doc. The worker must run plans in order, on one GPU stream.
    pub fn schedule(&mut self) -> Option<Plan> {
        let mut step = StepBuilder::default();
        let decodes = self
            .running
            .iter()
            .filter(|id| self.decode_work(id).is_some())
            .count();
        // Decodes always run (one token is the least progress a request can make); prefill
        // chunks get what is left of the budget.
        let mut budget = (self.config.chunked_prefill_size as usize)
            .saturating_sub(decodes)
            .min(self.config.max_prefill_tokens as usize);
        let mut retracted = false;

        let mut i = 0;
        while i < self.running.len() {
            let id = self.running[i];
            let decode = self.decode_work(&id);
            let want = match (decode, self.requests.get(&id).map(Sequence::work)) {
                (Some(n), _) => n,
                (None, Some(Work::Known(n))) => n.min(budget),
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
            if decode.is_none() {
                budget -= fit;
            }
            self.schedule_chunk(id, fit, &mut step);
            i += 1;
        }

        // Readmitting what was just retracted would only thrash; wait for a step with room.
        if retracted {
            self.reserve_ratio = (self.reserve_ratio + RESERVE_RATIO_BUMP).min(1.0);
        } else {
            self.admit(&mut budget, &mut step);
        }

        step.plan.finished_slots = std::mem::take(&mut self.released_slots);
        if step.plan.is_empty() {
            return None;
        }
        step.plan.step_id = self.next_step;
        self.next_step += 1;
        self.in_flight.push_back((step.plan.step_id, step.expected));
        Some(step.plan)
    }

    /// Applies a step's sampled tokens. Tokens for requests aborted since the plan are ignored.
    pub fn advance(&mut self, result: &StepResult) -> Vec<RequestOutput> {
        let mut outputs = Vec::new();
        // Steps are answered in order; an older unanswered step counts as answered with nothing.
        while self
            .in_flight
            .front()
            .is_some_and(|(step_id, _)| *step_id <= result.step_id)
        {
            let Some((step_id, expected)) = self.in_flight.pop_front() else {
                break;
            };
            let sampled: HashMap<u32, &SampledToken> = if step_id == result.step_id {
                result.sampled.iter().map(|s| (s.slot, s)).collect()
            } else {
                HashMap::new()
            };
            for e in &expected {
                if let Some(out) = self.apply(e, sampled.get(&e.slot).copied()) {
                    outputs.push(out);
                }
            }
        }
        outputs
    }

    /// Drops every unlocked cached page. Only when idle (nothing waiting or running), as SGLang.
    pub fn flush_cache(&mut self) -> bool {
        if !self.running.is_empty() || !self.waiting.is_empty() {
            return false;
        }
        self.cache.flush();
        true
    }

    pub fn stats(&self) -> SchedulerStats {
        let free = self.pool.free_count();
        let cached = self.cache.cached_pages();
        SchedulerStats {
            total_pages: self.pool.total(),
            free_pages: free,
            used_pages: self.pool.total() - free - cached,
            cached_pages: cached,
            evictable_pages: self.cache.evictable_pages(),
            running: self.running.len(),
            waiting: self.waiting.len(),
        }
    }

    /// True when no request is waiting or running and no plan awaits its result.
    pub fn is_idle(&self) -> bool {
        self.requests.is_empty() && self.in_flight.is_empty() && self.released_slots.is_empty()
    }

    /// Length of the longest cached prefix of `tokens` (for a cache-aware router).
    pub fn cached_prefix_len(&self, tokens: &[u32]) -> usize {
        self.cache.peek_prefix_len(tokens)
    }

    /// Tokens `id` feeds in the next step if that is a decode (one token: the last sampled one,
    /// or the placeholder for the one in flight). Decodes always run; prefill shares the budget.
    fn decode_work(&self, id: &u64) -> Option<usize> {
        let seq = self.requests.get(id)?;
        match (seq.work(), &seq.phase) {
            (Work::Placeholder, _) => Some(1),
            (Work::Known(n), Phase::Decoding(_)) => Some(n),
            _ => None,
        }
    }

    /// How many of `want` next tokens of `id` can get KV pages now (evicting cache if needed).
    fn fit_tokens(&mut self, id: u64, want: usize) -> usize {
        let ps = self.config.page_size as usize;
        let Some(a) = self.requests[&id].active() else {
            return 0;
        };
        let have = a.num_pages() * ps - a.computed;
        let spare = self.pool.free_count() + self.cache.evictable_pages();
        want.min(have + spare * ps)
    }

    /// Makes `n` pages free, evicting cached ones if needed, and takes them.
    fn take_pages(&mut self, n: usize) -> Option<Pages> {
        let free = self.pool.free_count();
        if free < n {
            self.cache.evict(n - free);
        }
        self.pool.alloc(n)
    }

    /// Allocates pages for `n` more tokens of running request `id`, emits its share of the step.
    fn schedule_chunk(&mut self, id: u64, n: usize, step: &mut StepBuilder) {
        let ps = self.config.page_size as usize;
        let Some(a) = self.requests[&id].active() else {
            return;
        };
        let need = (a.computed + n).div_ceil(ps).saturating_sub(a.num_pages());
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
        if let Some(table) = a.pending_table.take() {
            step.add_pages(a.slot, 0, &table);
        }
        step.add_pages(a.slot, a.num_pages(), new_pages.ids());
        a.own.append(new_pages);
        // Past the known tokens only by one placeholder decode (`Work::Placeholder`).
        let (n, sample) = match tokens.get(a.computed..a.computed + n) {
            Some(known) => {
                step.plan.input_ids.extend_from_slice(known);
                (n, a.computed + n == tokens.len())
            }
            None => {
                step.plan.input_ids.push(LAST_SAMPLED);
                (1, true)
            }
        };
        step.plan.scheduled.push(ScheduledRequest {
            slot: a.slot,
            num_tokens: n as u32,
            start_pos: a.computed as u32,
            cached_len: a.cached_len,
            sample,
        });
        step.expected.push(Expected {
            id,
            epoch: a.epoch,
            slot: a.slot,
            sample,
        });
        a.computed += n;
        a.in_flight += 1;
        a.pending_samples += u32::from(sample);
    }

    /// The youngest running request after position `i`. One with steps in flight qualifies
    /// too (with overlap nearly every request has one when the next plan is built): their
    /// results are dropped as stale (`Active::epoch`), their pages are safe to hand out again
    /// (see `release`). Only younger requests give way, so the oldest always progresses.
    fn youngest_retractable(&self, i: usize) -> Option<u64> {
        self.running.get(i + 1..)?.last().copied()
    }

    /// Sends a running request back to the front of the queue; its computed KV goes to the
    /// cache (evictable), so readmission may find part of it still there.
    fn retract(&mut self, id: u64) {
        let Some(mut seq) = self.requests.remove(&id) else {
            return;
        };
        if let Phase::Prefilling(active) | Phase::Decoding(active) =
            std::mem::replace(&mut seq.phase, Phase::Retracted)
        {
            self.release(&seq.tokens, active);
        }
        self.running.retain(|&r| r != id);
        self.waiting.push_front(id);
        self.requests.insert(id, seq);
    }

    /// Gives up a slot and pages: full pages of computed KV go to the cache, the rest are freed.
    ///
    /// Only pages of *known* tokens are cached: a placeholder's token is not known yet. Steps
    /// still in flight may be writing KV into these pages; caching or freeing them now is safe
    /// because the worker runs plans in order on one stream, so a later plan that reads them (a
    /// prefix hit) or reuses them (another request's new pages) runs after those writes.
    fn release(&mut self, tokens: &[u32], active: Active) {
        let ps = self.config.page_size as usize;
        let full = active.computed.min(tokens.len()) / ps;
        let mut own = active.own;
        drop(own.split_off(full.saturating_sub(active.prefix_pages.len())));
        self.cache.insert(&tokens[..full * ps], own);
        self.cache.unlock(active.prefix_node);
        self.free_slots.insert(active.slot);
        self.released_slots.push(active.slot);
    }

    /// Applies one expected result; returns the output if a token was sampled for a live request.
    fn apply(&mut self, e: &Expected, sampled: Option<&SampledToken>) -> Option<RequestOutput> {
        let seq = self.requests.get_mut(&e.id)?;
        // A step planned for an earlier admission (retracted since) is stale.
        let a = seq
            .active_mut()
            .filter(|a| a.epoch == e.epoch && a.slot == e.slot)?;
        a.in_flight = a.in_flight.saturating_sub(1);
        if !e.sample {
            return None;
        }
        a.pending_samples = a.pending_samples.saturating_sub(1);
        let Some(s) = sampled else {
            if a.in_flight == 0 {
                // The worker sent no token: feed the last position again (its KV is rewritten
                // as is).
                a.computed -= 1;
            } else {
                // A later step (a placeholder decode: only those follow a sampling step) fed
                // the token that never came, so its KV is wrong: recompute from known tokens.
                self.retract(e.id);
            }
            return None;
        };
        seq.tokens.push(s.token);
        if let Phase::Prefilling(_) = seq.phase {
            if let Phase::Prefilling(a) = std::mem::replace(&mut seq.phase, Phase::Waiting) {
                seq.phase = Phase::Decoding(a);
            }
            self.cache_prompt(e.id);
        }
        let seq = self.requests.get_mut(&e.id)?;
        let completion = seq.completion_tokens();
        let req = &seq.req;
        let finished = if !req.ignore_eos
            && completion >= req.min_new_tokens as usize
            && req.stop_token_ids.contains(&s.token)
        {
            Some(FinishReason::Stop)
        } else if completion >= req.max_new_tokens as usize {
            Some(FinishReason::Length)
        } else {
            None
        };
        let out = RequestOutput {
            id: e.id,
            token: s.token,
            logprob: s.logprob,
            top_logprobs: s.top_logprobs.clone(),
            finished,
            prompt_tokens: req.prompt.len() as u32,
            cached_tokens: seq.cached_tokens.unwrap_or(0),
            completion_tokens: completion as u32,
        };
        if finished.is_some() {
            let used = completion as f64 / f64::from(req.max_new_tokens.max(1));
            self.reserve_ratio = ((1.0 - RESERVE_RATIO_EMA) * self.reserve_ratio
                + RESERVE_RATIO_EMA * used)
                .clamp(RESERVE_RATIO_MIN, 1.0);
            self.finish(e.id);
        }
        Some(out)
    }

    /// Puts a request's freshly prefilled full pages into the radix tree while it keeps decoding,
    /// so requests arriving meanwhile with the same prefix (a shared system prompt) hit the cache
    /// without waiting for this one to finish. The request then holds them through a lock.
    fn cache_prompt(&mut self, id: u64) {
        if !self.config.enable_radix_cache {
            return;
        }
        let ps = self.config.page_size as usize;
        let Some(seq) = self.requests.get_mut(&id) else {
            return;
        };
        let Some(a) = (match &mut seq.phase {
            Phase::Prefilling(a) | Phase::Decoding(a) => Some(a),
            _ => None,
        }) else {
            return;
        };
        // A placeholder's position may be computed already; its token is known only now.
        let full = a.computed.min(seq.tokens.len()) / ps;
        let cached = a.prefix_pages.len();
        if full <= cached || a.own.len() < full - cached {
            return;
        }
        let rest = a.own.split_off(full - cached);
        let to_tree = std::mem::replace(&mut a.own, rest);
        let ours = to_tree.ids().to_vec();
        let tokens = &seq.tokens[..full * ps];
        self.cache.insert(tokens, to_tree);
        let m = self.cache.match_prefix(tokens);
        debug_assert_eq!(
            m.len,
            full * ps,
            "a just-inserted prefix must match in full"
        );
        self.cache.lock(m.node);
        self.cache.unlock(a.prefix_node);
        let held: Vec<u32> = a.prefix_pages.iter().chain(&ours).copied().collect();
        if m.pages != held {
            // Another request cached the same tokens first: ours were freed as duplicates,
            // so the slot must read the tree's pages from its next step on.
            a.pending_table = Some(m.pages.clone());
        }
        a.prefix_node = m.node;
        a.prefix_pages = m.pages;
    }

    fn finish(&mut self, id: u64) {
        let Some(mut seq) = self.requests.remove(&id) else {
            return;
        };
        self.running.retain(|&r| r != id);
        if let Phase::Prefilling(active) | Phase::Decoding(active) =
            std::mem::replace(&mut seq.phase, Phase::Finished)
        {
            self.release(&seq.tokens, active);
        }
    }
}
