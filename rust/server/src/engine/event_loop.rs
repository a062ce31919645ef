//! The engine loop itself (spawned by `super::spawn_engine`): commands in, plans out, step
//! results routed to each request's event channel.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokenspeed_engine::scheduler::{FinishReason, RequestOutput, Scheduler};
use tokenspeed_engine::{Plan, StepResult};
use tokio::sync::mpsc as tokio_mpsc;

use super::grammar::Verdict;
use super::*;
use crate::metrics::Metrics;
mod commands;
mod kv_poll;
mod queue_bound;

pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// What waiting for a command came to.
enum Waited {
    Handled,
    TimedOut,
    /// A command asked the loop to stop, or every sender is gone.
    Stop,
}

pub(super) struct LiveRequest {
    pub(super) events: tokio_mpsc::UnboundedSender<EngineEvent>,
    pub(super) submitted: Instant,
    /// When its first prefill chunk was scheduled.
    pub(super) admitted: Option<Instant>,
    pub(super) first_token: Option<Instant>,
    pub(super) last_token: Option<Instant>,
    pub(super) prompt_tokens: u32,
    pub(super) stop: StopSignal,
    /// `--enable-trace`: its spans so far, recorded when it is dropped (`trace.rs`).
    pub(super) trace: Option<Box<super::trace::EngineSpans>>,
}

pub(super) struct EngineLoop {
    pub(super) scheduler: Scheduler,
    pub(super) link: Box<dyn WorkerLink>,
    pub(super) commands: mpsc::Receiver<Command>,
    pub(super) requests: HashMap<RequestId, LiveRequest>,
    /// Plans sent whose results have not come back, oldest first.
    pub(super) in_flight: VecDeque<Plan>,
    pub(super) healthy: Arc<AtomicBool>,
    pub(super) stats: Arc<Mutex<EngineStats>>,
    pub(super) lifeline: Arc<Lifeline>,
    pub(super) options: EngineOptions,
    pub(super) metrics: Arc<Metrics>,
    pub(super) steps: u64,
    pub(super) max_batch: usize,
    /// Time accounting for `EngineStats::{busy_s, stalled_s}`: the last `mark()`.
    pub(super) marked: Instant,
    pub(super) busy: Duration,
    pub(super) stalled: Duration,
    /// `EngineStats::gpu_idle_s`: the worker's own count, summed from its results.
    pub(super) gpu_idle: Duration,
    /// For the debug trace of first-token latency (`RUST_LOG=tokenspeed_server::engine=debug`):
    /// when the latest request was submitted, and per plan carrying new requests, when it was
    /// sent and how long after that submit.
    pub(super) last_submit: Option<Instant>,
    pub(super) prefill_sent: HashMap<u64, (Instant, Duration)>,
    /// `--enable-trace`: per step in flight, the traced requests it carries prefill chunks of.
    pub(super) traced_steps: HashMap<u64, Vec<RequestId>>,
    /// Matchers of the grammar-constrained requests.
    pub(super) grammars: super::grammar::Grammars,
    /// When the next plan is due (`--schedule-lead-ms`).
    pub(super) plan_clock: super::plan_clock::PlanClock,
    /// `EngineStats::{prefix_cache_queries, prefix_cache_hits}`.
    pub(super) prefix_queries: u64,
    pub(super) prefix_hits: u64,
    /// `/pause_generation`: no step is planned until `/continue_generation`.
    pub(super) paused: bool,
    /// An operation on the worker group waiting to run or for its result (`worker_ops.rs`).
    pub(super) pending_op: Option<super::worker_ops::PendingOp>,
    /// The workers' memory is released (`/release_memory_occupation`): nothing is admitted.
    pub(super) memory_released: bool,
}

impl EngineLoop {
    /// Books the time since the last mark by the state it had: call before every change of
    /// `in_flight` or `requests`, and after every blocking wait.
    fn mark(&mut self) {
        let now = Instant::now();
        let spent = now.saturating_duration_since(self.marked);
        self.marked = now;
        if !self.in_flight.is_empty() {
            self.busy += spent;
        } else if !self.requests.is_empty() {
            self.stalled += spent;
        }
    }

    pub(super) fn run(&mut self) {
        loop {
            let depth = self.depth();
            // Before any wait: what the last step, result or command did to the cache.
            self.publish_kv_events();
            // Block only when there is nothing to schedule nor to receive (nor an op to send).
            if self.requests.is_empty() && self.in_flight.is_empty() && self.pending_op.is_none() {
                match self.wait_for_command() {
                    Waited::Handled => {}
                    Waited::TimedOut => {
                        if let Err(e) = self.link.check_alive() {
                            self.fail_all(&e);
                        }
                        continue;
                    }
                    Waited::Stop => return,
                }
            }
            if !self.handle_queued_commands() {
                return;
            }
            if !self.healthy.load(Ordering::Acquire) {
                continue;
            }
            self.expire_kv_waits();
            let hold = self.hold_until(depth);
            let plan = self.next_plan(depth, hold);
            let sent = plan.is_some();
            self.note_admitted();
            if let Some(plan) = plan {
                if let Err(e) = self.send(plan) {
                    self.fail_all(&e);
                    continue;
                }
            }
            self.publish_kv_events();
            if self.in_flight.len() >= depth || (!sent && !self.in_flight.is_empty()) {
                match self.recv_oldest(hold) {
                    Ok(Some((plan, result))) => self.deliver(&plan, result),
                    Ok(None) => {}
                    Err(e) => self.fail_all(&e),
                }
            } else if !sent && !self.wait_idle() {
                return;
            }
        }
    }

    /// Plans in flight at most: two with overlap on (one step ahead), except under speculative
    /// decoding while it speculates; while the gate has it paused every step yields one token
    /// per request, so overlap runs then, and the loop drains (depth 1) before the next step
    /// that speculates (the scheduler plans nothing behind a step in flight until then).
    fn depth(&self) -> usize {
        let speculating = self.scheduler.config().speculative_algorithm.is_some()
            && !self.scheduler.spec_paused();
        if self.options.overlap && !speculating {
            2
        } else {
            1
        }
    }

    /// Waits up to the liveness interval for one command and handles it.
    fn wait_for_command(&mut self) -> Waited {
        let cmd = self.commands.recv_timeout(self.options.liveness_interval);
        self.mark();
        match cmd {
            Ok(cmd) => {
                if self.handle(cmd) {
                    Waited::Handled
                } else {
                    Waited::Stop
                }
            }
            Err(RecvTimeoutError::Timeout) => Waited::TimedOut,
            Err(RecvTimeoutError::Disconnected) => Waited::Stop,
        }
    }

    /// Handles every command already queued; false when one stops the loop.
    fn handle_queued_commands(&mut self) -> bool {
        while let Ok(cmd) = self.commands.try_recv() {
            self.mark();
            if !self.handle(cmd) {
                return false;
            }
        }
        true
    }

    /// When the next plan is held for (`--schedule-lead-ms`), if it is held at all.
    ///
    /// With one plan in flight the scheduler plans the next on top of it (the worker runs plans
    /// in order, and resolves `LAST_SAMPLED` inputs on the GPU), at once or, with a lead,
    /// shortly before the running decode step ends. The lead waits for prompts that may arrive;
    /// with prompt work already queued the next step carries some anyway, and holding it would
    /// only shorten the time the worker has to launch it behind the running step: an eager
    /// launch (~20 ms for a 200-request mixed step) then delays the running step's result, a
    /// longer gap for every stream.
    fn hold_until(&self, depth: usize) -> Option<Instant> {
        self.plan_clock.plan_at().filter(|&at| {
            self.in_flight.len() < depth && at > Instant::now() && !self.scheduler.has_prompt_work()
        })
    }

    /// The plan to send now: a worker operation's, or the scheduler's next step (with its
    /// grammar masks) when there is room in flight and nothing holds it.
    fn next_plan(&mut self, depth: usize, hold: Option<Instant>) -> Option<Plan> {
        if let Some(op) = self.op_plan() {
            return Some(op);
        }
        if self.paused || self.op_in_flight() || self.in_flight.len() >= depth || hold.is_some() {
            return None;
        }
        let mut plan = self.scheduler.schedule().filter(|p| !p.is_empty())?;
        if self.options.trace {
            self.trace_prefill_chunks(&plan);
        }
        if !self.grammars.is_empty() {
            let planned: Vec<_> = self.scheduler.last_planned().collect();
            for (id, message) in self.grammars.attach_masks(&mut plan, planned.into_iter()) {
                self.fail_request(id, format!("structured output failed: {message}"));
            }
        }
        Some(plan)
    }

    /// Stamps the requests the scheduler just admitted (their queue time ends here).
    fn note_admitted(&mut self) {
        let now = Instant::now();
        for id in self.scheduler.take_admitted() {
            if let Some(live) = self.requests.get_mut(&id) {
                live.admitted.get_or_insert(now);
            }
        }
    }

    /// Sends a plan to the worker group; it is in flight from now on, even if sending fails
    /// (the caller's `fail_all` closes it).
    fn send(&mut self, plan: Plan) -> Result<(), LinkError> {
        self.mark();
        if !plan.new_requests.is_empty() {
            let waited = self.last_submit.map(|t| t.elapsed()).unwrap_or_default();
            self.prefill_sent
                .insert(plan.step_id, (Instant::now(), waited));
        }
        self.plan_clock.on_sent(
            plan.step_id,
            Instant::now(),
            plan.is_pure_decode() && !plan.scheduled.is_empty(),
        );
        self.in_flight.push_back(plan);
        match self.in_flight.back() {
            Some(plan) => self.link.send_plan(plan),
            None => Ok(()),
        }
    }

    /// Applies a constrained request's new tokens to its grammar: a completed grammar finishes
    /// the request now ("stop"), a failed matcher ends it with an error.
    fn apply_grammar(&mut self, mut out: RequestOutput) -> Option<RequestOutput> {
        if out.tokens.is_empty() || out.error.is_some() {
            return Some(out);
        }
        match self.grammars.advance(out.id, &out.tokens) {
            Verdict::Continue => {}
            Verdict::Complete => {
                if out.finished.is_none() {
                    // The matcher reports it; the scheduler ends the request, and this last
                    // output carries the reason it recorded.
                    out.finished = self
                        .scheduler
                        .finish(out.id, FinishReason::Complete)
                        .map(|f| f.reason);
                }
            }
            Verdict::Failed(message) => {
                self.fail_request(out.id, format!("structured output failed: {message}"));
                return None;
            }
        }
        Some(out)
    }

    /// Waits for the result of the oldest plan in flight (checking that the workers live),
    /// and pops it with its plan. A result older than that plan is stale and dropped; one for
    /// a newer plan in flight means the worker skipped the plans before it: they are dropped
    /// too, and the scheduler counts them as answered with nothing. With `until`, gives up at
    /// that moment (None): the hold of `--schedule-lead-ms` ends there.
    fn recv_oldest(
        &mut self,
        until: Option<Instant>,
    ) -> Result<Option<(Plan, StepResult)>, LinkError> {
        let Some(oldest) = self.in_flight.front().map(|p| p.step_id) else {
            return Ok(None);
        };
        // The watchdog times the wait for each result, a lower bound of the step's run time.
        let waiting_since = Instant::now();
        loop {
            let mut wait = self.options.liveness_interval;
            if let Some(until) = until {
                wait = wait.min(until.saturating_duration_since(Instant::now()));
            }
            let Some(result) = self.link.recv_result(wait)? else {
                if until.is_some_and(|t| Instant::now() >= t) {
                    self.mark();
                    return Ok(None);
                }
                self.link.check_alive()?;
                self.check_watchdog(waiting_since)?;
                continue;
            };
            if result.step_id < oldest
                || !self.in_flight.iter().any(|p| p.step_id == result.step_id)
            {
                tracing::warn!(
                    expected = oldest,
                    got = result.step_id,
                    "stale step result dropped"
                );
                continue;
            }
            self.mark();
            self.plan_clock.on_result(result.step_id, Instant::now());
            while let Some(plan) = self.in_flight.pop_front() {
                if plan.step_id == result.step_id {
                    return Ok(Some((plan, result)));
                }
                tracing::warn!(step = plan.step_id, "the worker skipped a step");
            }
        }
    }

    fn check_watchdog(&self, waiting_since: Instant) -> Result<(), LinkError> {
        let (Some(limit), Some(plan)) = (self.options.watchdog, self.in_flight.front()) else {
            return Ok(());
        };
        if waiting_since.elapsed() <= limit {
            return Ok(());
        }
        tracing::error!(
            step = plan.step_id,
            batch = plan.scheduled.len(),
            tokens = plan.num_tokens(),
            "watchdog: step {} has run for more than {:.1}s (--watchdog-timeout)",
            plan.step_id,
            limit.as_secs_f64()
        );
        Err(LinkError::StepTimeout {
            step: plan.step_id,
            seconds: limit.as_secs_f64(),
        })
    }

    fn deliver(&mut self, plan: &Plan, result: StepResult) {
        let started = Instant::now();
        if self.options.trace {
            self.trace_step_done(plan.step_id, started);
        }
        self.gpu_idle += Duration::from_micros(result.gpu_idle_us());
        if let Some(run) = result.gpu_busy() {
            self.scheduler.observe_run_time(plan.step_id, run);
        }
        self.metrics.observe_kv_arrivals(&result.kv_arrived);
        let mut outputs = self.scheduler.advance(&result);
        if !plan.ops.is_empty() {
            self.finish_op(plan, &result);
        }
        if !self.grammars.is_empty() {
            outputs = outputs
                .into_iter()
                .filter_map(|out| self.apply_grammar(out))
                .collect();
            // The next plan's pending masks depend on the tokens just applied, and the worker
            // waits for them to sample: they go out before the outputs are routed.
            let oldest = self.in_flight.front().map(|p| p.step_id);
            if let Some((completion, failed)) = self.grammars.complete(oldest) {
                if let Err(e) = self.link.send_plan(&completion) {
                    self.fail_all(&e);
                }
                for (id, message) in failed {
                    self.fail_request(id, format!("structured output failed: {message}"));
                }
            }
        }
        for out in outputs {
            self.route(out);
        }
        if let Some((sent, waited)) = self.prefill_sent.remove(&plan.step_id) {
            // Where a first token's time goes on the engine's side (the worker's side:
            // TOKENSPEED_STEP_TRACE); plans dropped as skipped leave entries behind: drop them.
            self.prefill_sent.retain(|&step, _| step > plan.step_id);
            tracing::debug!(
                step = plan.step_id,
                new = plan.new_requests.len(),
                tokens = plan.num_tokens(),
                submit_to_sent_us = waited.as_micros() as u64,
                sent_to_result_us = started.saturating_duration_since(sent).as_micros() as u64,
                route_us = started.elapsed().as_micros() as u64,
                "prefill step"
            );
        }
        self.steps += 1;
        let batch = plan.scheduled.len();
        self.max_batch = self.max_batch.max(batch);
        self.metrics
            .observe_step(batch, plan.num_tokens(), started.elapsed());
        self.publish_stats(batch, plan.num_tokens());
        // The first step, then every interval-th (`% == 1` never held for an interval of 1).
        let interval = self.options.step_log_interval;
        if interval > 0 && (self.steps - 1).is_multiple_of(interval) {
            let s = self.scheduler.stats();
            tracing::info!(
                step = plan.step_id,
                batch,
                tokens = plan.num_tokens(),
                running = s.running,
                waiting = s.waiting,
                free_pages = s.free_pages,
                cached_pages = s.cached_pages,
                "step"
            );
        }
    }

    fn route(&mut self, out: RequestOutput) {
        let id = out.id;
        let Some(live) = self.requests.get_mut(&id) else {
            return;
        };
        let now = Instant::now();
        if !out.tokens.is_empty() {
            if live.first_token.is_none() {
                live.first_token = Some(now);
                self.metrics.observe_first_token(
                    now - live.submitted,
                    out.prompt_tokens,
                    out.cached_tokens,
                );
                self.prefix_queries += u64::from(out.prompt_tokens);
                self.prefix_hits += u64::from(out.cached_tokens);
            } else if let Some(last) = live.last_token {
                self.metrics.observe_token_gap(now - last);
            }
            live.last_token = Some(now);
        }
        if let Some(message) = out.error {
            // The scheduler has dropped it already.
            self.grammars.remove(id);
            if let Some(live) = self.requests.remove(&id) {
                let _ = live.events.send(EngineEvent::Error {
                    message,
                    kind: EngineErrorKind::Unavailable,
                });
            }
            return;
        }
        let (finish, completion_tokens, preemptions) =
            (out.finished, out.completion_tokens, out.preemptions);
        self.metrics
            .counters
            .generation_tokens
            .inc_by(out.tokens.len() as u64);
        let event = EngineEvent::Token(TokenEvent {
            tokens: out.tokens,
            logprobs: out.logprobs,
            top_logprobs: out.top_logprobs,
            prompt_logprobs: out.prompt_logprobs,
            prompt_top_logprobs: out.prompt_top_logprobs,
            prompt_ranks: out.prompt_ranks,
            pooled: out.pooled,
            finish: out.finished,
            usage: TokenUsage {
                prompt_tokens: out.prompt_tokens,
                completion_tokens: out.completion_tokens,
                cached_tokens: out.cached_tokens,
            },
        });
        let delivered = live.events.send(event).is_ok();
        if finish.is_some() || !delivered {
            self.grammars.remove(id);
        }
        if let Some(reason) = finish {
            if let Some(live) = self.requests.remove(&id) {
                self.record_finish(live, reason, completion_tokens, preemptions);
            }
        } else if !delivered {
            // A stop string ended it (the front end said so before dropping the channel), or
            // the client went away: free its slot and pages now.
            if let Some(live) = self.requests.remove(&id) {
                if live.stop.get().is_some() {
                    self.end_stopped(id, live);
                } else {
                    self.scheduler.finish(id, FinishReason::Abort);
                    self.count_abort();
                }
            }
        }
    }
}
