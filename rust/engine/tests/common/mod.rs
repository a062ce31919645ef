//! A fake worker and a step loop for scheduler tests: the worker mirrors page tables and KV.
//!
//! The fake model's next token is a hash of the *whole sequence as read back through the page
//! table*, so a wrong page, a stale cached page or a skipped chunk changes the output, and the
//! tests compare every request's tokens with `reference` (the same model run without a cache).

#![allow(dead_code)]

use std::collections::HashMap;

use tokenspeed_engine::{
    FinishReason, Plan, Request, RequestOutput, SampledToken, Scheduler, SchedulerConfig,
    StepResult,
};

pub fn config(num_pages: u32, page_size: u32) -> SchedulerConfig {
    SchedulerConfig {
        page_size,
        num_pages,
        max_running_requests: 16,
        chunked_prefill_size: 64,
        max_prefill_tokens: 1024,
        enable_radix_cache: true,
        max_context_len: 1024,
        ..SchedulerConfig::default()
    }
}

pub fn request(id: u64, prompt: Vec<u32>, max_new_tokens: u32) -> Request {
    Request {
        id,
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

/// Mirrors what the Python worker keeps across steps, and checks each plan against it.
pub struct FakeWorker {
    page_size: usize,
    /// Slot -> page table row and tokens computed so far.
    slots: HashMap<u32, (Vec<u32>, usize)>,
    /// The KV cache: which token's KV sits at `page * page_size + offset`.
    kv: Vec<Option<u32>>,
    last_step: Option<u64>,
}

impl FakeWorker {
    pub fn new(config: &SchedulerConfig) -> Self {
        FakeWorker {
            page_size: config.page_size as usize,
            slots: HashMap::new(),
            kv: vec![None; (config.num_pages * config.page_size) as usize],
            last_step: None,
        }
    }

    /// Runs a plan in the order the worker contract fixes: finished, new, page updates, forward.
    pub fn execute(&mut self, plan: &Plan) -> StepResult {
        let ps = self.page_size;
        if let Some(last) = self.last_step {
            assert_eq!(plan.step_id, last + 1, "step ids increment");
        }
        self.last_step = Some(plan.step_id);
        for slot in &plan.finished_slots {
            assert!(
                self.slots.remove(slot).is_some(),
                "finished slot {slot} was live"
            );
        }
        for new in &plan.new_requests {
            assert!(
                self.slots.insert(new.slot, (Vec::new(), 0)).is_none(),
                "slot {} reused while live",
                new.slot
            );
        }
        for u in &plan.page_table_updates {
            let (table, _) = self
                .slots
                .get_mut(&u.slot)
                .expect("page update for a live slot");
            // Updates append, or rewrite a prefix with pages of identical content (the radix
            // tree's copy): the KV checks below catch a rewrite to the wrong pages.
            let first = u.first_index as usize;
            assert!(first <= table.len(), "page update leaves a hole");
            for (i, &p) in u.pages.iter().enumerate() {
                match table.get_mut(first + i) {
                    Some(slot) => *slot = p,
                    None => table.push(p),
                }
            }
        }
        let total: u32 = plan.scheduled.iter().map(|r| r.num_tokens).sum();
        assert_eq!(
            total as usize,
            plan.input_ids.len(),
            "input ids are the scheduled tokens"
        );
        let mut sampled = Vec::new();
        let mut offset = 0;
        for r in &plan.scheduled {
            let (table, computed) = self.slots.get_mut(&r.slot).expect("scheduled slot is live");
            if *computed == 0 {
                assert_eq!(
                    r.start_pos, r.cached_len,
                    "a new request starts after its cached prefix"
                );
                *computed = r.start_pos as usize;
            }
            assert_eq!(
                r.start_pos as usize, *computed,
                "no gap or overlap between chunks"
            );
            let end = (r.start_pos + r.num_tokens) as usize;
            assert!(
                table.len() * ps >= end,
                "pages cover every position written"
            );
            for (i, &tok) in plan.input_ids[offset..offset + r.num_tokens as usize]
                .iter()
                .enumerate()
            {
                let pos = r.start_pos as usize + i;
                self.kv[table[pos / ps] as usize * ps + pos % ps] = Some(tok);
            }
            offset += r.num_tokens as usize;
            *computed = end;
            if r.sample {
                let seq: Vec<u32> = (0..end)
                    .map(|pos| {
                        self.kv[table[pos / ps] as usize * ps + pos % ps].expect("KV present")
                    })
                    .collect();
                let token = next_token(&seq);
                sampled.push(SampledToken {
                    slot: r.slot,
                    token,
                    logprob: -0.5,
                    top_logprobs: vec![],
                });
            }
        }
        StepResult {
            step_id: plan.step_id,
            sampled,
        }
    }
}

/// A scheduler driven by a fake worker, collecting outputs per request.
pub struct Harness {
    pub sched: Scheduler,
    pub worker: FakeWorker,
    pub outputs: HashMap<u64, Vec<RequestOutput>>,
    pub plans: Vec<Plan>,
}

impl Harness {
    pub fn new(config: SchedulerConfig) -> Self {
        Harness {
            worker: FakeWorker::new(&config),
            sched: Scheduler::new(config).expect("valid config"),
            outputs: HashMap::new(),
            plans: Vec::new(),
        }
    }

    pub fn submit(&mut self, req: Request) {
        self.sched.submit(req).expect("request accepted");
    }

    /// One schedule → execute → advance round; false when there was nothing to schedule.
    pub fn step(&mut self) -> bool {
        let Some(plan) = self.sched.schedule() else {
            return false;
        };
        let result = self.worker.execute(&plan);
        for out in self.sched.advance(&result) {
            self.outputs.entry(out.id).or_default().push(out);
        }
        self.plans.push(plan);
        true
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

    pub fn tokens(&self, id: u64) -> Vec<u32> {
        self.outputs
            .get(&id)
            .map(|o| o.iter().map(|o| o.token).collect())
            .unwrap_or_default()
    }

    pub fn finish_reason(&self, id: u64) -> Option<FinishReason> {
        self.outputs.get(&id)?.last()?.finished
    }

    pub fn last_output(&self, id: u64) -> &RequestOutput {
        self.outputs[&id].last().expect("request produced output")
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
    }
}
