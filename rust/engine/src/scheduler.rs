//! The scheduler: a synchronous state machine turning submitted requests into step plans.
//!
//! Each `schedule()` (`step.rs`) builds one continuous-batching step: every running decode
//! feeds one token, then prefill chunks (of running, then newly admitted requests) fill the
//! rest of the token budget. `advance()` (`reconcile.rs`) takes the worker's accepted tokens
//! back; `finish.rs` says when they end a request. KV pages come from the radix
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
use crate::plan::{PageTableUpdate, Plan};
use crate::radix::{NodeId, RadixCache};

mod adapters;
mod admission;
mod finish;
mod kv_wait;
mod ngram;
mod ops;
mod preemption;
mod reconcile;
mod request;
mod spec_gate;
mod step;
mod step_cost;
mod swa;

pub use request::{
    kv_transfer_len, ConfigError, FinishReason, Finished, KvTransfer, KvTransferStats, Request,
    RequestId, RequestOutput, SchedulePolicy, SchedulerConfig, SchedulerStats, SubmitError,
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
    /// Steps of this admission whose results have not come back.
    in_flight: u32,
    /// Whether the latest scheduled step proposes draft tokens: its accepted count is unknown
    /// until it returns, so no placeholder decode may follow it.
    drafting: bool,
    /// Page-table entries 0.. to rewrite in the slot's next plan: set when caching the prompt
    /// found another request's identical pages already in the tree and ours were freed.
    pending_table: Option<Vec<u32>>,
    /// The radix-cache namespace of its KV: its LoRA adapter (0: the base model).
    ns: u32,
    /// Hybrid layout: its sliding-window pages, logical pages `swa_released..` (`swa.rs`).
    swa: Pages,
    /// Leading logical sliding-window pages given back (out of the window).
    swa_released: usize,
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
    /// Whether speculative drafts may be verified for it: not when sampling reads a history
    /// or state that changes token by token inside one step (penalties, `min_tokens`, a
    /// grammar: `Scheduler::forbid_drafts`).
    drafts_allowed: bool,
    /// The worker's proposal (EAGLE-3's draft head, `RequestEvent::draft_tokens`) for the
    /// tokens after the last known one; replaced by every result.
    proposed: Vec<u32>,
    /// Times it was sent back to the queue (vLLM's per-request preemptions).
    retractions: u32,
}

impl Sequence {
    fn completion_tokens(&self) -> usize {
        self.tokens.len() - self.req.prompt.len()
    }

    /// The output reporting `tokens` (accepted and kept) from worker event `ev`.
    fn output(
        &self,
        tokens: Vec<u32>,
        ev: &crate::plan::RequestEvent,
        finished: Option<FinishReason>,
    ) -> RequestOutput {
        let n = tokens.len();
        RequestOutput {
            id: self.req.id,
            logprobs: ev.logprobs.iter().copied().take(n).collect(),
            top_logprobs: (0..n).map(|i| ev.top(i)).collect(),
            prompt_logprobs: ev.prompt_logprobs.clone(),
            prompt_top_logprobs: (0..ev.prompt_logprobs.len())
                .map(|i| ev.prompt_top(i))
                .collect(),
            prompt_ranks: ev.prompt_ranks.clone(),
            pooled: ev.pooled.clone(),
            tokens,
            finished,
            error: None,
            prompt_tokens: self.req.prompt.len() as u32,
            cached_tokens: self.cached_tokens.unwrap_or(0),
            completion_tokens: self.completion_tokens() as u32,
            preemptions: self.retractions,
        }
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

    /// Computed vs known: positions `< computed` have (or are getting) KV; `tokens` are known.
    /// `computed < known`: known tokens wait to be fed. `computed == known`: the last known
    /// token is fed and its step, in flight, samples the next. `computed == known + 1`: a
    /// placeholder decode of that next token is in flight too.
    fn work(&self) -> Work {
        let Some(a) = self.active() else {
            return Work::Idle;
        };
        let known = self.tokens.len();
        if a.computed < known {
            return Work::Known(known - a.computed);
        }
        // At most one unknown token ahead, and none when the sample in flight will be the last
        // one anyway (`max_new_tokens`): that decode would be wasted. A stop token is only
        // seen when it comes back, so a request that stops computes one token too many; that
        // token is never reported.
        let unknown_ahead = a.computed + 1 - known;
        if unknown_ahead == 1
            && !a.drafting
            && self.completion_tokens() + 1 < self.req.max_new_tokens as usize
        {
            Work::Placeholder
        } else {
            Work::Idle
        }
    }
}

/// What a step expects back for one scheduled request.
struct Expected {
    id: RequestId,
    /// The admission the step was planned for (`Active::epoch`).
    epoch: u64,
    slot: u32,
    sample: bool,
    /// Draft tokens the step verifies for it (speculative decoding).
    drafts: u32,
}

/// The plan being built by one `schedule()` call.
#[derive(Default)]
struct StepBuilder {
    plan: Plan,
    expected: Vec<Expected>,
    /// Prefill/decode disaggregation's page transfers (`KvTransfer`), after the cache's copies.
    kv_copies: Vec<crate::plan::CopyOp>,
    /// Sent even with nothing in it (`Scheduler::poll_kv`).
    poll: bool,
}

impl StepBuilder {
    fn add_pages(&mut self, slot: u32, first: usize, pages: &[u32]) {
        if !pages.is_empty() {
            self.plan.page_tables.push(PageTableUpdate {
                slot,
                first: first as u32,
                pool: 0,
                pages: pages.to_vec(),
            });
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct SpecCounts {
    drafted: u64,
    accepted: u64,
    steps: u64,
}

pub struct Scheduler {
    config: SchedulerConfig,
    pool: PagePool,
    /// The sliding-window layers' pool (hybrid layout, `swa.rs`); empty with the single one.
    swa_pool: PagePool,
    cache: RadixCache,
    requests: HashMap<RequestId, Sequence>,
    /// Ids not admitted yet, in arrival order (retracted ones pushed to the front).
    waiting: VecDeque<RequestId>,
    /// Ids holding a slot, oldest admission first: retraction takes from the back.
    running: Vec<RequestId>,
    free_slots: BTreeSet<u32>,
    /// Slots released since the last plan.
    released_slots: Vec<u32>,
    next_step: u64,
    next_epoch: u64,
    /// Share of running requests' remaining tokens that admission keeps pages back for.
    reserve_ratio: f64,
    /// Requests ended so far, by reason (`finish`).
    finished_by_reason: HashMap<FinishReason, u64>,
    in_flight: VecDeque<(u64, Vec<Expected>)>,
    /// Requests admitted for the first time since the last `take_admitted` (queue-time metrics).
    admitted: Vec<RequestId>,
    /// Requests sent back to the queue so far (`SchedulerStats::retractions`).
    retractions: u64,
    /// Speculative decoding counts (`SchedulerStats::spec_*`).
    spec: SpecCounts,
    /// Whether speculation pays now (`spec_gate.rs`), and what the step being built does.
    gate: spec_gate::SpecGate,
    spec_mode: spec_gate::SpecMode,
    /// PD transfers planned so far (`SchedulerStats::kv_transfer`).
    transfers: KvTransferStats,
    /// PD decode server: requests parked until their KV arrives (`kv_wait.rs`).
    kv_wait: kv_wait::KvWait,
    /// Run times of past steps, for `max_mixed_step_ms`.
    step_cost: step_cost::StepCost,
    /// The worker's LoRA adapter pool slots: how many, and which are pinned.
    adapters: adapters::AdapterSlots,
    /// No request is admitted (nor preempts) while set: the engine drains the running ones
    /// before an operation on the worker group (`ops.rs`).
    admission_held: bool,
}

impl Scheduler {
    /// Ids of the requests admitted for the first time (their first prefill chunk scheduled)
    /// since the last call.
    pub fn take_admitted(&mut self) -> Vec<RequestId> {
        std::mem::take(&mut self.admitted)
    }

    /// The requests of the plan `schedule` returned last, as (id, slot, samples this step), in
    /// the plan's order (the server attaches grammar masks to that plan before sending it).
    pub fn last_planned(&self) -> impl Iterator<Item = (RequestId, u32, bool)> + '_ {
        self.in_flight
            .back()
            .into_iter()
            .flat_map(|(_, expected)| expected.iter().map(|e| (e.id, e.slot, e.sample)))
    }

    pub fn new(config: SchedulerConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let pool = PagePool::new(config.num_pages);
        // Hybrid layout: no prefix reuse (a match would need its window's sliding pages,
        // which the tree does not keep; docs/models.md).
        let caching = !config.disable_radix_cache && config.num_swa_pages == 0;
        let mut cache = RadixCache::new(pool.clone(), config.page_size as usize, caching)
            .with_policy(config.radix_eviction_policy);
        if config.num_host_pages > 0 && caching {
            let host = PagePool::new(config.num_host_pages);
            cache = cache
                .with_host(host, config.hicache_write_policy)
                .with_storage(config.num_storage_pages as usize);
        }
        let gate = spec_gate::SpecGate::new(&config);
        Ok(Scheduler {
            free_slots: (0..config.max_running_requests).collect(),
            swa_pool: PagePool::new(config.num_swa_pages),
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
            finished_by_reason: HashMap::new(),
            in_flight: VecDeque::new(),
            admitted: Vec::new(),
            retractions: 0,
            spec: SpecCounts::default(),
            gate,
            spec_mode: spec_gate::SpecMode::ON,
            transfers: KvTransferStats::default(),
            kv_wait: kv_wait::KvWait::default(),
            step_cost: step_cost::StepCost::default(),
            adapters: adapters::AdapterSlots::unlimited(),
            admission_held: false,
        })
    }

    /// At most `n` distinct LoRA adapters (the base model not counted) run at once; a waiting
    /// request for another one waits until a running adapter has no request left.
    pub fn limit_adapters(&mut self, n: usize) {
        self.adapters.max = n;
    }

    /// The pinned LoRA adapters, all of them (the server's registry, after a load or an unload
    /// changed them): each keeps a pool slot, and every step plan lists them so the worker
    /// never evicts them.
    pub fn pin_adapters(&mut self, mut pins: Vec<u32>) {
        pins.sort_unstable();
        pins.dedup();
        self.adapters.pins = pins;
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Step `step_id` ran for `run` on the GPU (the worker's `StepTiming::gpu_busy_us`): what
    /// `max_mixed_step_ms` learns from. Steps never timed are simply not learned from.
    pub fn observe_run_time(&mut self, step_id: u64, run: std::time::Duration) {
        self.step_cost.ran(step_id, run.as_secs_f64() * 1e3);
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
        if total > u64::from(self.config.context_length) {
            return Err(SubmitError::ContextTooLong {
                id,
                prompt_tokens: req.prompt.len(),
                max_new_tokens: req.max_new_tokens,
                max_context_len: self.config.context_length,
            });
        }
        // Prefill-only: the whole prompt in one step (a bidirectional encoder, and pooling over
        // every position, need it all at once).
        let step_tokens = self
            .config
            .chunked_prefill_size
            .min(self.config.max_prefill_tokens);
        if req.sampling.pooling && req.prompt.len() > step_tokens as usize {
            return Err(SubmitError::PoolingPromptTooLong {
                id,
                prompt_tokens: req.prompt.len(),
                max_step_tokens: step_tokens,
            });
        }
        // The last sampled token is never fed back, so it needs no KV.
        let pages = (total - 1).div_ceil(u64::from(self.config.page_size));
        let swa_pages = if self.hybrid() {
            self.swa_peak_for((total - 1) as usize) as u64
        } else {
            0
        };
        // The sliding-window pool's bound first, then the full pool's (one error, either pool).
        for (pages_needed, total_pages) in [
            (swa_pages, self.config.num_swa_pages),
            (pages, self.config.num_pages),
        ] {
            if pages_needed > u64::from(total_pages) {
                return Err(SubmitError::ExceedsKvPool {
                    id,
                    tokens: total - 1,
                    pages_needed,
                    total_pages,
                });
            }
        }
        let tokens = req.prompt.clone();
        let drafts_allowed = self.config.speculative_algorithm.is_some()
            && !req.sampling.penalized()
            && req.min_new_tokens == 0;
        self.requests.insert(
            id,
            Sequence {
                req,
                tokens,
                cached_tokens: None,
                phase: Phase::Waiting,
                drafts_allowed,
                proposed: Vec::new(),
                retractions: 0,
            },
        );
        self.enqueue(id);
        Ok(())
    }

    /// Ends a request the client abandoned: `finish(id, FinishReason::Abort)`. Returns false
    /// for an unknown (or already finished) id.
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.finish(id, FinishReason::Abort).is_some()
    }

    /// Verifies no draft tokens for request `id` (its sampling is constrained by a grammar the
    /// server or the worker advances one token at a time).
    pub fn forbid_drafts(&mut self, id: RequestId) {
        if let Some(seq) = self.requests.get_mut(&id) {
            seq.drafts_allowed = false;
        }
    }

    /// Records the radix cache's KV events (`--kv-events-config`) from now on; call before
    /// the first request.
    pub fn enable_kv_events(&mut self) {
        self.cache.enable_events();
    }

    /// The KV events since the last call (empty when off): the engine loop publishes them.
    pub fn take_kv_events(&mut self) -> Vec<crate::radix::KvEvent> {
        self.cache.take_events()
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
            waiting: self.waiting.len() + self.kv_wait.parked(),
            retractions: self.retractions,
            spec_draft_tokens: self.spec.drafted,
            spec_accepted_tokens: self.spec.accepted,
            spec_verify_steps: self.spec.steps,
            spec_enabled: self.config.speculative_algorithm.is_some() && self.gate.is_on(),
            spec_off_steps: self.gate.off_steps(),
            spec_ahead_steps: self.gate.ahead_steps(),
            host: self.cache.host_stats(),
            storage: self.cache.storage_stats(),
            kv_transfer: self.transfers,
        }
    }

    /// Whether prompt tokens wait to be scheduled: a request in the queue, or a running one
    /// with prompt chunks still to come.
    pub fn has_prompt_work(&self) -> bool {
        !self.waiting.is_empty()
            || self.running.iter().any(|id| {
                self.requests.get(id).is_some_and(|seq| {
                    matches!(seq.phase, Phase::Prefilling(_))
                        && matches!(seq.work(), Work::Known(_))
                })
            })
    }

    /// True when no request is waiting or running and no plan awaits its result.
    pub fn is_idle(&self) -> bool {
        self.requests.is_empty() && self.in_flight.is_empty() && self.released_slots.is_empty()
    }

    /// Length of the longest cached prefix of `tokens` under LoRA adapter `lora_id` (0: the
    /// base model), for a cache-aware router.
    pub fn cached_prefix_len(&self, lora_id: u32, tokens: &[u32]) -> usize {
        self.cache.peek_prefix_len_in(lora_id, tokens)
    }

    /// Sends a running request back to the front of the queue; its computed KV goes to the
    /// cache (evictable), so readmission may find part of it still there.
    fn retract(&mut self, id: RequestId) {
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
        seq.retractions += 1;
        self.requests.insert(id, seq);
        self.retractions += 1;
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
        self.cache.insert_in(active.ns, &tokens[..full * ps], own);
        self.cache.unlock(active.prefix_node);
        self.free_slots.insert(active.slot);
        self.released_slots.push(active.slot);
    }
}
