//! A fake worker and a step loop for scheduler tests: the worker mirrors page tables and KV.
//!
//! The fake model's next token is a hash of the *whole sequence as read back through the page
//! table*, so a wrong page, a stale cached page or a skipped chunk changes the output, and the
//! tests compare every request's tokens with `reference` (the same model run without a cache).
//!
//! The harness runs either one plan at a time or, like the engine with overlap on, with up to
//! two in flight: the worker runs plans in order as they come (eagerly), and the harness hands
//! each result to `advance` one step late.

#![allow(dead_code)]

use std::collections::{HashMap, VecDeque};

use tokenspeed_engine::{
    copy_kind, FinishReason, KvArrival, KvPairDown, Plan, Request, RequestEvent, RequestId,
    RequestOutput, Scheduler, SchedulerConfig, SchedulerStats, StepResult, LAST_SAMPLED,
};

/// What the fake worker reports a received transfer measured, per page (`KvArrival`).
pub const KV_BYTES_PER_PAGE: usize = 1 << 20;
pub const KV_US_PER_PAGE: usize = 250;

/// A small engine's settings; tests override what they exercise.
pub fn base_config() -> SchedulerConfig {
    SchedulerConfig {
        chunked_prefill_size: 8192,
        max_prefill_tokens: 16384,
        ..SchedulerConfig::small(1, 4096, 256, 4096)
    }
}

pub fn config(num_pages: u32, page_size: u32) -> SchedulerConfig {
    SchedulerConfig {
        chunked_prefill_size: 64,
        ..SchedulerConfig::small(page_size, num_pages, 16, 1024)
    }
}

pub fn request(id: u64, prompt: Vec<u32>, max_new_tokens: u32) -> Request {
    Request {
        id: id.into(),
        prompt,
        max_new_tokens,
        ..Request::default()
    }
}

/// Distinct synthetic prompt tokens for request `seed`.
pub fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| seed * 1000 + i).collect()
}

/// The fake model: the next token after `seq`.
pub fn next_token(seq: &[u32]) -> u32 {
    let h = seq.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
        (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3)
    });
    100_000 + (h % 1000) as u32
}

/// What the fake model generates for `prompt`, ignoring stop tokens.
pub fn reference(prompt: &[u32], max_new_tokens: u32) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    for _ in 0..max_new_tokens {
        seq.push(next_token(&seq));
    }
    seq.split_off(prompt.len())
}

/// What the worker keeps per slot.
#[derive(Default)]
struct SlotState {
    table: Vec<u32>,
    /// Positions computed so far.
    computed: usize,
    /// The token sampled by the slot's latest sampling step (what `LAST_SAMPLED` stands for).
    last_sampled: Option<u32>,
    /// Whether the slot's previous scheduled step sampled.
    prev_sampled: bool,
    /// The request asked for prompt logprobs.
    prompt_logprobs: bool,
    /// Hybrid layout: the sliding-window page table (logical page → page; `pool` 1 rows).
    swa_table: HashMap<usize, u32>,
}

/// Mirrors what the Python worker keeps across steps, and checks each plan against it.
/// A fake model: the next token after a sequence.
pub type Model = fn(&[u32]) -> u32;

pub struct FakeWorker {
    page_size: usize,
    slots: HashMap<u32, SlotState>,
    /// The KV cache: which token's KV sits at `page * page_size + offset`.
    kv: Vec<Option<u32>>,
    /// The host tier's slots, laid out like `kv` (`--enable-hierarchical-cache`).
    host_kv: Vec<Option<u32>>,
    /// Hybrid layout: the sliding-window pool, laid out like `kv`, and the window.
    swa_kv: Vec<Option<u32>>,
    swa_window: usize,
    /// The storage tier's pages by key (`--hicache-storage-backend`).
    store: HashMap<i64, Vec<Option<u32>>>,
    last_step: Option<u64>,
    /// Tokens a slot's sampling steps return: the true continuation, as a perfect drafter
    /// would (speculative decoding accepting several tokens); 1 when absent.
    pub accept: HashMap<u32, usize>,
    /// Sample this token instead of the fake model's: for waves of thousands of long requests,
    /// where reading each sequence back to hash it would take minutes (the plan checks stay).
    pub constant_token: Option<u32>,
    /// The fake model's next token after a sequence (`next_token` unless a test sets one).
    pub model: fn(&[u32]) -> u32,
    /// A worker-side drafter (EAGLE-3): after each sampling step, a chain of this many tokens
    /// from this draft model continues the sequence (`RequestEvent::draft_tokens`).
    pub drafter: Option<(Model, usize)>,
    /// Prefill/decode disaggregation: the pages each transfer (by room) sent, in order
    /// (`KV_SEND`), and those waiting to be received (`KV_RECV` takes them from the front).
    pub kv_sent: HashMap<i64, Vec<Vec<Option<u32>>>>,
    pub kv_inbox: HashMap<i64, VecDeque<Vec<Option<u32>>>>,
    /// Rooms of `kv_inbox` already reported as arrived (`StepResult::kv_arrived`, once each).
    pub kv_reported: std::collections::HashSet<i64>,
    /// The transfer pair is down, for this reason (`StepResult::kv_down`).
    pub kv_down: Option<String>,
}

impl FakeWorker {
    pub fn new(config: &SchedulerConfig) -> Self {
        FakeWorker {
            page_size: config.page_size as usize,
            slots: HashMap::new(),
            kv: vec![None; (config.num_pages * config.page_size) as usize],
            host_kv: vec![None; (config.num_host_pages * config.page_size) as usize],
            swa_kv: vec![None; (config.num_swa_pages * config.page_size) as usize],
            swa_window: config.swa_window as usize,
            store: HashMap::new(),
            last_step: None,
            accept: HashMap::new(),
            constant_token: None,
            model: next_token,
            drafter: None,
            kv_sent: HashMap::new(),
            kv_inbox: HashMap::new(),
            kv_reported: Default::default(),
            kv_down: None,
        }
    }

    /// The drafter's chain after `seq` (empty without one, or when the plan paused drafting).
    fn propose(&self, mut seq: Vec<u32>, paused: bool) -> Vec<u32> {
        let Some((draft, k)) = self.drafter.filter(|_| !paused) else {
            return Vec::new();
        };
        (0..k)
            .map(|_| {
                let t = draft(&seq);
                seq.push(t);
                t
            })
            .collect()
    }

    /// Runs a plan in the order the worker contract fixes: finished, new, page updates, forward.
    pub fn execute(&mut self, plan: &Plan) -> StepResult {
        let ps = self.page_size;
        if let Some(last) = self.last_step {
            assert_eq!(plan.step_id, last + 1, "step ids increment");
        }
        self.last_step = Some(plan.step_id);
        for f in &plan.finished {
            let slot = &f.slot;
            assert!(
                self.slots.remove(slot).is_some(),
                "finished slot {slot} was live"
            );
        }
        for new in &plan.new_requests {
            let state = SlotState {
                prompt_logprobs: new.prompt_logprobs,
                ..SlotState::default()
            };
            assert!(
                self.slots.insert(new.slot, state).is_none(),
                "slot {} reused while live",
                new.slot
            );
        }
        for u in &plan.page_tables {
            if u.pool == 1 {
                let slot = self
                    .slots
                    .get_mut(&u.slot)
                    .expect("page update for a live slot");
                for (i, &p) in u.pages.iter().enumerate() {
                    slot.swa_table.insert(u.first as usize + i, p);
                }
                continue;
            }
            let table = &mut self
                .slots
                .get_mut(&u.slot)
                .expect("page update for a live slot")
                .table;
            // Updates append, or rewrite a prefix with pages of identical content (the radix
            // tree's copy): the KV checks below catch a rewrite to the wrong pages.
            let first = u.first as usize;
            assert!(first <= table.len(), "page update leaves a hole");
            for (i, &p) in u.pages.iter().enumerate() {
                match table.get_mut(first + i) {
                    Some(slot) => *slot = p,
                    None => table.push(p),
                }
            }
        }
        // Copies run in list order, before the forward.
        for c in &plan.copies {
            let (src, dst) = (c.src as usize * ps, c.dst as usize * ps);
            match c.kind {
                copy_kind::STORE => {
                    let page = self.host_kv[src..src + ps].to_vec();
                    self.store.insert(c.key, page);
                    continue;
                }
                copy_kind::FETCH => {
                    let page = self.store.get(&c.key).expect("a fetched page was stored");
                    self.host_kv[dst..dst + ps].copy_from_slice(page);
                    continue;
                }
                copy_kind::DROP => {
                    assert!(
                        self.store.remove(&c.key).is_some(),
                        "a dropped page was stored"
                    );
                    continue;
                }
                copy_kind::KV_SEND => continue, // after the forward
                copy_kind::KV_RECV => {
                    let page = self
                        .kv_inbox
                        .get_mut(&c.key)
                        .and_then(VecDeque::pop_front)
                        .expect("a received page was sent");
                    self.kv[dst..dst + ps].copy_from_slice(&page);
                    continue;
                }
                _ => {}
            }
            for i in 0..ps {
                match c.kind {
                    copy_kind::WRITEBACK => self.host_kv[dst + i] = self.kv[src + i],
                    copy_kind::LOAD => self.kv[dst + i] = self.host_kv[src + i],
                    _ => self.kv[dst + i] = self.kv[src + i],
                }
            }
        }
        let mut events = Vec::new();
        for r in &plan.scheduled {
            let slot = self.slots.get_mut(&r.slot).expect("scheduled slot is live");
            assert!(!r.tokens.is_empty(), "a scheduled request feeds tokens");
            if slot.computed == 0 {
                // A new request starts after its cached prefix (its KV is in the table).
                slot.computed = r.start_pos as usize;
            }
            // The one overlap allowed: the last position fed again after its sampled token was
            // lost (`Harness::lose_samples_at`).
            let refeed = slot.prev_sampled && r.start_pos as usize + 1 == slot.computed;
            assert!(
                r.start_pos as usize == slot.computed || refeed,
                "no gap or overlap between chunks: start {} after {} computed",
                r.start_pos,
                slot.computed
            );
            let end = r.start_pos as usize + r.tokens.len();
            assert!(
                slot.table.len() * ps >= end,
                "pages cover every position written"
            );
            for (i, &tok) in r.tokens.iter().enumerate() {
                let tok = if tok == LAST_SAMPLED {
                    // Only as a lone decode token right after a sampling step of this slot,
                    // at the position that step's token belongs to (checked above).
                    assert_eq!(r.tokens.len(), 1, "LAST_SAMPLED only in a one-token decode");
                    assert!(
                        slot.prev_sampled,
                        "LAST_SAMPLED right after a sampling step"
                    );
                    slot.last_sampled
                        .expect("LAST_SAMPLED after the slot sampled")
                } else {
                    tok
                };
                let pos = r.start_pos as usize + i;
                self.kv[slot.table[pos / ps] as usize * ps + pos % ps] = Some(tok);
                if self.swa_window > 0 {
                    let page = slot.swa_table.get(&(pos / ps));
                    let page = *page.expect("sliding pages cover every position written");
                    self.swa_kv[page as usize * ps + pos % ps] = Some(tok);
                }
            }
            // Hybrid layout: every key a query of this step sees in its window is still in
            // the sliding pool (not given back, not overwritten by another request).
            for pos in (r.start_pos as usize).saturating_sub(self.swa_window)..end {
                if self.swa_window == 0 {
                    break;
                }
                let full = self.kv[slot.table[pos / ps] as usize * ps + pos % ps];
                let page = slot.swa_table.get(&(pos / ps)).expect("window page held");
                assert_eq!(
                    self.swa_kv[*page as usize * ps + pos % ps],
                    full,
                    "sliding KV of position {pos} intact"
                );
            }
            // Fake prompt logprobs: minus the position of each scored token (position 0 has none).
            let prompt_logprobs: Vec<f32> = if slot.prompt_logprobs {
                (r.start_pos.max(1) as usize..end)
                    .map(|pos| -(pos as f32))
                    .collect()
            } else {
                Vec::new()
            };
            if r.sample {
                slot.prompt_logprobs = false;
            }
            slot.computed = end;
            slot.prev_sampled = r.sample;
            if !r.sample && !prompt_logprobs.is_empty() {
                events.push(RequestEvent {
                    slot: r.slot,
                    prompt_logprobs,
                    ..RequestEvent::default()
                });
            } else if let (true, Some(token)) = (r.sample, self.constant_token) {
                slot.last_sampled = Some(token);
                events.push(RequestEvent {
                    slot: r.slot,
                    logprobs: vec![-0.5],
                    tokens: vec![token],
                    prompt_logprobs,
                    ..RequestEvent::default()
                });
            } else if r.sample && r.num_draft_tokens > 0 {
                // Verify the chain: keep drafts while each is the model's next token, then add
                // the model's own; the KV past that is the rejected drafts' (stale).
                let d = r.num_draft_tokens as usize;
                assert!(r.tokens.len() > d, "drafts follow at least one input token");
                let fed = end - d;
                let mut seq: Vec<u32> = (0..fed)
                    .map(|pos| {
                        self.kv[slot.table[pos / ps] as usize * ps + pos % ps].expect("KV present")
                    })
                    .collect();
                let drafts = &r.tokens[r.tokens.len() - d..];
                let mut tokens = Vec::new();
                loop {
                    let t = (self.model)(&seq);
                    seq.push(t);
                    tokens.push(t);
                    if drafts.get(tokens.len() - 1) != Some(&t) {
                        break;
                    }
                }
                let valid = fed + tokens.len() - 1;
                for pos in valid..end {
                    self.kv[slot.table[pos / ps] as usize * ps + pos % ps] = None;
                }
                slot.computed = valid;
                slot.last_sampled = tokens.last().copied();
                events.push(RequestEvent {
                    slot: r.slot,
                    logprobs: vec![-0.5; tokens.len()],
                    tokens,
                    prompt_logprobs,
                    draft_tokens: self.propose(seq, r.pause_drafts),
                    ..RequestEvent::default()
                });
            } else if r.sample {
                let mut seq: Vec<u32> = (0..end)
                    .map(|pos| {
                        self.kv[slot.table[pos / ps] as usize * ps + pos % ps].expect("KV present")
                    })
                    .collect();
                let n = self.accept.get(&r.slot).copied().unwrap_or(1);
                let mut tokens = Vec::new();
                for _ in 0..n {
                    let t = (self.model)(&seq);
                    seq.push(t);
                    tokens.push(t);
                }
                slot.last_sampled = tokens.last().copied();
                events.push(RequestEvent {
                    slot: r.slot,
                    logprobs: vec![-0.5; tokens.len()],
                    tokens,
                    prompt_logprobs,
                    draft_tokens: self.propose(seq, r.pause_drafts),
                    ..RequestEvent::default()
                });
            }
        }
        // Sends read the KV this step's forward wrote.
        for c in plan.copies.iter().filter(|c| c.kind == copy_kind::KV_SEND) {
            let src = c.src as usize * ps;
            let page = self.kv[src..src + ps].to_vec();
            self.kv_sent.entry(c.key).or_default().push(page);
        }
        let mut arrived: Vec<i64> = self.kv_inbox.keys().copied().collect();
        arrived.retain(|&room| self.kv_reported.insert(room));
        arrived.sort_unstable(); // a HashMap's order would change from run to run
                                 // Each arrival's measure: `KV_BYTES_PER_PAGE` and `KV_US_PER_PAGE` a page.
        let arrival = |room: i64| {
            let pages = self.kv_inbox[&room].len();
            KvArrival {
                room,
                bytes: (pages * KV_BYTES_PER_PAGE) as i64,
                transfer_us: (pages * KV_US_PER_PAGE) as u32,
            }
        };
        StepResult {
            step_id: plan.step_id,
            events,
            kv_arrived: arrived.into_iter().map(arrival).collect(),
            kv_down: self
                .kv_down
                .iter()
                .map(|why| KvPairDown {
                    message: why.as_bytes().to_vec(),
                })
                .collect(),
            ..Default::default()
        }
    }
}

/// A scheduler driven by a fake worker, collecting outputs per request.
pub struct Harness {
    pub sched: Scheduler,
    pub worker: FakeWorker,
    pub outputs: HashMap<RequestId, Vec<RequestOutput>>,
    /// Every plan, in order, as scheduled.
    pub plans: Vec<Plan>,
    /// The scheduler's stats right after each plan was made (same index as `plans`).
    pub stats: Vec<SchedulerStats>,
    /// Keep up to two plans in flight, as the engine does with overlap on.
    pub overlap: bool,
    /// Plans executed whose results `advance` has not seen yet, oldest first.
    pub in_flight: VecDeque<StepResult>,
    /// Steps whose first sampled token is lost on its way back (as if the worker sent nothing
    /// for that request).
    pub lose_samples_at: Vec<u64>,
    /// `max_new_tokens` of each submitted request.
    max_new: HashMap<RequestId, u32>,
    /// The run time of a plan, in ms: when set, each advanced step's is reported to the
    /// scheduler (`observe_run_time`), as the engine measures it.
    pub step_ms: Option<fn(&Plan) -> f64>,
}

impl Harness {
    /// One plan at a time: each result is advanced before the next plan is built.
    pub fn new(config: SchedulerConfig) -> Self {
        Self::with_overlap(config, false)
    }

    pub fn with_overlap(config: SchedulerConfig, overlap: bool) -> Self {
        Harness {
            worker: FakeWorker::new(&config),
            sched: Scheduler::new(config).expect("valid config"),
            outputs: HashMap::new(),
            plans: Vec::new(),
            stats: Vec::new(),
            overlap,
            in_flight: VecDeque::new(),
            lose_samples_at: Vec::new(),
            max_new: HashMap::new(),
            step_ms: None,
        }
    }

    pub fn submit(&mut self, req: Request) {
        self.max_new.insert(req.id, req.max_new_tokens);
        self.sched.submit(req).expect("request accepted");
    }

    /// One round of the engine loop: schedule and execute a plan, then hand the oldest result
    /// to `advance` if as many plans are in flight as the mode allows (or no plan was made).
    /// False when nothing was scheduled nor advanced.
    pub fn step(&mut self) -> bool {
        // As the engine does: with only requests parked for their KV, an empty plan polls.
        let plan = self.sched.schedule().or_else(|| self.sched.poll_kv());
        let made = plan.is_some();
        if let Some(plan) = plan {
            self.stats.push(self.sched.stats());
            let mut result = self.worker.execute(&plan);
            if self.lose_samples_at.contains(&plan.step_id) && !result.events.is_empty() {
                result.events.remove(0);
            }
            self.in_flight.push_back(result);
            self.plans.push(plan);
        }
        let depth = if self.overlap { 2 } else { 1 };
        if self.in_flight.len() >= depth || (!made && !self.in_flight.is_empty()) {
            self.advance_oldest();
            return true;
        }
        made
    }

    /// Hands the oldest in-flight result to the scheduler.
    pub fn advance_oldest(&mut self) {
        let Some(result) = self.in_flight.pop_front() else {
            return;
        };
        if let Some(step_ms) = self.step_ms {
            if let Some(plan) = self
                .plans
                .iter()
                .rev()
                .find(|p| p.step_id == result.step_id)
            {
                let run = std::time::Duration::from_secs_f64(step_ms(plan) / 1e3);
                self.sched.observe_run_time(result.step_id, run);
            }
        }
        for out in self.sched.advance(&result) {
            self.record(out);
        }
    }

    /// Keeps an output, checking what every request's stream must satisfy.
    pub fn record(&mut self, out: RequestOutput) {
        let outs = self.outputs.entry(out.id).or_default();
        assert!(
            outs.last().is_none_or(|o| o.finished.is_none()),
            "request {}: output after its last",
            out.id
        );
        let before: usize = outs.iter().map(|o| o.tokens.len()).sum();
        assert!(
            !out.tokens.is_empty() || !out.prompt_logprobs.is_empty() || out.error.is_some(),
            "request {}: an output has tokens (or prompt logprobs)",
            out.id
        );
        assert_eq!(
            out.completion_tokens as usize,
            before + out.tokens.len(),
            "request {}: each token counted once",
            out.id
        );
        if let Some(&max) = self.max_new.get(&out.id) {
            assert!(
                out.completion_tokens <= max,
                "request {}: over max_new_tokens",
                out.id
            );
        }
        outs.push(out);
    }

    /// Steps until idle; panics if that takes more than `max_steps` (a deadlock or livelock).
    pub fn run(&mut self, max_steps: usize) {
        for _ in 0..max_steps {
            if !self.step() {
                assert!(
                    self.sched.is_idle(),
                    "nothing scheduled but requests remain: deadlock"
                );
                return;
            }
        }
        panic!("not idle after {max_steps} steps");
    }

    pub fn tokens(&self, id: impl Into<RequestId>) -> Vec<u32> {
        self.outputs
            .get(&id.into())
            .map(|o| o.iter().flat_map(|o| o.tokens.iter().copied()).collect())
            .unwrap_or_default()
    }

    pub fn finish_reason(&self, id: impl Into<RequestId>) -> Option<FinishReason> {
        self.outputs.get(&id.into())?.last()?.finished
    }

    pub fn last_output(&self, id: impl Into<RequestId>) -> &RequestOutput {
        self.outputs[&id.into()]
            .last()
            .expect("request produced output")
    }

    /// After everything finished and the cache is flushed, every page is back in the pool.
    pub fn assert_no_leak(&mut self) {
        assert!(self.sched.flush_cache(), "flush allowed when idle");
        let stats = self.sched.stats();
        assert_eq!(
            stats.free_pages, stats.total_pages,
            "all pages free: {stats:?}"
        );
        assert_eq!((stats.used_pages, stats.cached_pages), (0, 0));
        assert_eq!(stats.host.used_pages, 0, "all host slots free: {stats:?}");
        assert_eq!(self.sched.swa_pool_usage().0, 0, "all sliding pages free");
    }
}
