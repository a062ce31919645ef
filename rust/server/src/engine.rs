//! The engine thread: the single owner of the scheduler. HTTP tasks talk to it through
//! `EngineHandle` (a command channel); it talks to the worker group through a `WorkerLink`.
//!
//! One loop: take commands → schedule a plan → send it → wait for the oldest step result →
//! advance the scheduler → route each token to its request's event channel. With overlap on
//! (the default) up to two plans are in flight: plan N+1 is scheduled and sent while the
//! worker runs plan N, so the GPU does not idle while the host schedules and detokenizes.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokenspeed_engine::scheduler::{
    FinishReason, Request, RequestOutput, Scheduler, SchedulerConfig, SchedulerStats,
};
use tokenspeed_engine::{Plan, StepResult};
use tokio::sync::{mpsc as tokio_mpsc, oneshot};

use crate::metrics::{Metrics, RequestTimes};

/// Why the worker group cannot serve any more.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("worker process {pid} exited")]
    WorkerDied { pid: i32 },
    #[error("worker channel failed: {0}")]
    Channel(String),
    #[error("step {step} ran longer than --watchdog-timeout {seconds}s")]
    StepTimeout { step: u64, seconds: f64 },
}

/// The engine's view of its worker group (shared memory in production, a fake in tests).
pub trait WorkerLink: Send + 'static {
    fn send_plan(&mut self, plan: &Plan) -> Result<(), LinkError>;
    /// Waits up to `timeout` for the next step result (results come back in plan order).
    fn recv_result(&mut self, timeout: Duration) -> Result<Option<StepResult>, LinkError>;
    /// Err if any worker is gone.
    fn check_alive(&mut self) -> Result<(), LinkError>;
}

/// Token counts of a request so far.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct TokenUsage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
}

/// The tokens one step produced for a request (usually one), possibly its last.
#[derive(Debug, Clone)]
pub struct TokenEvent {
    pub tokens: Vec<u32>,
    /// One per token.
    pub logprobs: Vec<f32>,
    /// One list per token; empty unless asked for.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    /// Logprobs of prompt tokens computed in this step (prompt logprobs requests only).
    pub prompt_logprobs: Vec<f32>,
    pub prompt_top_logprobs: Vec<Vec<(u32, f32)>>,
    pub finish: Option<FinishReason>,
    pub usage: TokenUsage,
}

#[derive(Debug, Clone)]
pub enum EngineEvent {
    Token(TokenEvent),
    /// The request cannot complete (rejected by the scheduler, or the worker group died).
    Error {
        message: String,
        kind: EngineErrorKind,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineErrorKind {
    BadRequest,
    Overloaded,
    Unavailable,
}

/// What the HTTP side can read about the engine without a round trip.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EngineStats {
    pub total_pages: usize,
    pub free_pages: usize,
    pub used_pages: usize,
    pub cached_pages: usize,
    pub evictable_pages: usize,
    pub running_requests: usize,
    pub waiting_requests: usize,
    pub steps: u64,
    /// The largest number of requests that shared one step so far.
    pub max_batch_size: usize,
    pub last_batch_size: usize,
    pub last_step_tokens: usize,
    /// Seconds with at least one plan in flight (the worker has work queued).
    pub busy_s: f64,
    /// Seconds with requests to serve but no plan in flight: the worker, and so the GPU, waits
    /// for the engine (scheduling, the result path). `stalled_s / (busy_s + stalled_s)` is the
    /// share of serving time the GPU sat idle between steps, as far as the engine can see (the
    /// worker's own host time before its first kernel is not in it).
    pub stalled_s: f64,
}

enum Command {
    Submit {
        id: u64,
        request: Box<Request>,
        events: tokio_mpsc::UnboundedSender<EngineEvent>,
    },
    Abort {
        id: u64,
    },
    FlushCache {
        reply: oneshot::Sender<bool>,
    },
    /// Ends every live request with an error (the shutdown drain ran out of time).
    AbortAll {
        message: String,
    },
    Shutdown,
}

/// How the engine thread tells the server it can no longer serve (worker death, a step over
/// the watchdog, a panic), and that it has stopped.
#[derive(Default)]
struct Lifeline {
    failure: Mutex<Option<String>>,
    failed: tokio::sync::Notify,
    stopped: AtomicBool,
}

impl Lifeline {
    fn fail(&self, message: String) {
        if let Ok(mut f) = self.failure.lock() {
            if f.is_none() {
                *f = Some(message);
                // notify_one keeps a permit, so a waiter that comes later still wakes.
                self.failed.notify_one();
            }
        }
    }
}

/// Marks the engine stopped when its thread ends, however it ends.
struct StoppedOnDrop(Arc<Lifeline>);

impl Drop for StoppedOnDrop {
    fn drop(&mut self) {
        self.0.stopped.store(true, Ordering::Release);
    }
}

/// Cheap to clone; every HTTP task holds one.
#[derive(Clone)]
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
    next_id: Arc<AtomicU64>,
    healthy: Arc<AtomicBool>,
    stats: Arc<Mutex<EngineStats>>,
    lifeline: Arc<Lifeline>,
}

impl EngineHandle {
    /// Queues a tokenized, validated request under a new id (its `id` is ignored); its tokens
    /// arrive on the returned channel.
    pub fn submit(
        &self,
        mut request: Request,
    ) -> (u64, tokio_mpsc::UnboundedReceiver<EngineEvent>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        request.id = id;
        let (events, rx) = tokio_mpsc::unbounded_channel();
        let sent = self.commands.send(Command::Submit {
            id,
            request: Box::new(request),
            events: events.clone(),
        });
        if sent.is_err() {
            let _ = events.send(EngineEvent::Error {
                message: "the engine has stopped".into(),
                kind: EngineErrorKind::Unavailable,
            });
        }
        (id, rx)
    }

    pub fn abort(&self, id: u64) {
        let _ = self.commands.send(Command::Abort { id });
    }

    /// Drops every cached prefix; false when requests are running (as in SGLang).
    pub async fn flush_cache(&self) -> bool {
        let (reply, rx) = oneshot::channel();
        if self.commands.send(Command::FlushCache { reply }).is_err() {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    pub fn stats(&self) -> EngineStats {
        self.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
    }

    /// Ends every live request with an error carrying `message`.
    pub fn abort_all(&self, message: impl Into<String>) {
        let _ = self.commands.send(Command::AbortAll {
            message: message.into(),
        });
    }

    /// Resolves once the engine can no longer serve, with the reason.
    pub async fn failed(&self) -> String {
        loop {
            if let Some(m) = self.lifeline.failure.lock().ok().and_then(|f| f.clone()) {
                return m;
            }
            self.lifeline.failed.notified().await;
        }
    }

    /// Waits up to `timeout` for the engine thread to end (after `shutdown`); true if it did.
    /// Its end drops the worker link, which closes and unlinks the shared-memory channel.
    pub fn wait_stopped(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while !self.lifeline.stopped.load(Ordering::Acquire) {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }
}

/// Tunables of the loop itself (not of scheduling).
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub max_queued_requests: usize,
    pub step_log_interval: u64,
    /// How often an idle or waiting engine checks that its workers are alive.
    pub liveness_interval: Duration,
    /// Keep two plans in flight (schedule step N+1 while the worker runs step N); off for
    /// `--disable-overlap-schedule`: one plan at a time.
    pub overlap: bool,
    /// A step whose result takes longer than this fails the worker group (`--watchdog-timeout`).
    pub watchdog: Option<Duration>,
}

/// Starts the engine thread.
pub fn spawn_engine(
    config: SchedulerConfig,
    link: Box<dyn WorkerLink>,
    options: EngineOptions,
    metrics: Arc<Metrics>,
) -> Result<(EngineHandle, JoinHandle<()>), String> {
    let (tx, rx) = mpsc::channel();
    let handle = EngineHandle {
        commands: tx,
        next_id: Arc::new(AtomicU64::new(1)),
        healthy: Arc::new(AtomicBool::new(true)),
        stats: Arc::new(Mutex::new(EngineStats::default())),
        lifeline: Arc::new(Lifeline::default()),
    };
    let (healthy, stats) = (handle.healthy.clone(), handle.stats.clone());
    let lifeline = handle.lifeline.clone();
    // The scheduler is single-threaded by design (it shares pages through Rc), so it is built
    // on the engine thread and never leaves it.
    let (started_tx, started_rx) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("tokenspeed-engine".into())
        .spawn(move || {
            let _stopped = StoppedOnDrop(lifeline.clone());
            let scheduler = match Scheduler::new(config) {
                Ok(s) => s,
                Err(e) => {
                    let _ = started_tx.send(Err(e.to_string()));
                    return;
                }
            };
            let _ = started_tx.send(Ok(()));
            let mut engine = EngineLoop {
                scheduler,
                link,
                commands: rx,
                requests: HashMap::new(),
                in_flight: VecDeque::new(),
                healthy,
                stats,
                lifeline,
                options,
                metrics,
                steps: 0,
                max_batch: 0,
                marked: Instant::now(),
                busy: Duration::ZERO,
                stalled: Duration::ZERO,
                last_submit: None,
                prefill_sent: HashMap::new(),
            };
            engine.publish_stats(0, 0);
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.run()));
            if let Err(panic) = run {
                engine.after_panic(panic_message(panic.as_ref()));
            }
        })
        .map_err(|e| format!("spawning the engine thread: {e}"))?;
    started_rx
        .recv()
        .map_err(|_| "the engine thread died at start".to_string())??;
    Ok((handle, thread))
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

struct LiveRequest {
    events: tokio_mpsc::UnboundedSender<EngineEvent>,
    submitted: Instant,
    /// When its first prefill chunk was scheduled.
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
}

struct EngineLoop {
    scheduler: Scheduler,
    link: Box<dyn WorkerLink>,
    commands: mpsc::Receiver<Command>,
    requests: HashMap<u64, LiveRequest>,
    /// Plans sent whose results have not come back, oldest first.
    in_flight: VecDeque<Plan>,
    healthy: Arc<AtomicBool>,
    stats: Arc<Mutex<EngineStats>>,
    lifeline: Arc<Lifeline>,
    options: EngineOptions,
    metrics: Arc<Metrics>,
    steps: u64,
    max_batch: usize,
    /// Time accounting for `EngineStats::{busy_s, stalled_s}`: the last `mark()`.
    marked: Instant,
    busy: Duration,
    stalled: Duration,
    /// For the debug trace of first-token latency (`RUST_LOG=tokenspeed_server::engine=debug`):
    /// when the latest request was submitted, and per plan carrying new requests, when it was
    /// sent and how long after that submit.
    last_submit: Option<Instant>,
    prefill_sent: HashMap<u64, (Instant, Duration)>,
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

    fn run(&mut self) {
        let depth = if self.options.overlap { 2 } else { 1 };
        loop {
            // Block only when there is nothing to schedule nor to receive.
            if self.requests.is_empty() && self.in_flight.is_empty() {
                let cmd = self.commands.recv_timeout(self.options.liveness_interval);
                self.mark();
                match cmd {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            return;
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {
                        if let Err(e) = self.link.check_alive() {
                            self.fail_all(&e);
                        }
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            while let Ok(cmd) = self.commands.try_recv() {
                self.mark();
                if !self.handle(cmd) {
                    return;
                }
            }
            if !self.healthy.load(Ordering::Acquire) {
                continue;
            }
            // With one plan in flight the scheduler plans the next on top of it (the worker
            // runs plans in order, and resolves `LAST_SAMPLED` inputs on the GPU).
            let plan = if self.in_flight.len() < depth {
                self.scheduler.schedule().filter(|p| !p.is_empty())
            } else {
                None
            };
            let sent = plan.is_some();
            let now = Instant::now();
            for id in self.scheduler.take_admitted() {
                if let Some(live) = self.requests.get_mut(&id) {
                    live.admitted.get_or_insert(now);
                }
            }
            if let Some(plan) = plan {
                // In flight from now on, even if sending fails (`fail_all` closes it).
                self.mark();
                if !plan.new_requests.is_empty() {
                    let waited = self.last_submit.map(|t| t.elapsed()).unwrap_or_default();
                    self.prefill_sent
                        .insert(plan.step_id, (Instant::now(), waited));
                }
                self.in_flight.push_back(plan);
                let sending = self.in_flight.back().map(|p| self.link.send_plan(p));
                if let Some(Err(e)) = sending {
                    self.fail_all(&e);
                    continue;
                }
            }
            if self.in_flight.len() >= depth || (!sent && !self.in_flight.is_empty()) {
                match self.recv_oldest() {
                    Ok(Some((plan, result))) => self.deliver(&plan, result),
                    Ok(None) => {}
                    Err(e) => self.fail_all(&e),
                }
            } else if !sent {
                // Nothing runnable and nothing in flight: wait for a command rather than spin.
                let cmd = self.commands.recv_timeout(self.options.liveness_interval);
                self.mark();
                match cmd {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            return;
                        }
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
        }
    }

    /// Returns false on shutdown.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Submit {
                id,
                request,
                events,
            } => self.submit(id, *request, events),
            Command::Abort { id } => {
                if self.requests.remove(&id).is_some() {
                    self.scheduler.abort(id);
                    self.count_abort();
                }
            }
            Command::FlushCache { reply } => {
                let flushed = self.scheduler.flush_cache();
                // Publish first: the caller may read the stats as soon as it has the reply.
                self.publish_stats(0, 0);
                let _ = reply.send(flushed);
            }
            Command::AbortAll { message } => {
                for (id, live) in self.requests.drain() {
                    self.scheduler.abort(id);
                    self.metrics
                        .request_success
                        .with_label_values(&["abort"])
                        .inc();
                    let _ = live.events.send(EngineEvent::Error {
                        message: message.clone(),
                        kind: EngineErrorKind::Unavailable,
                    });
                }
            }
            Command::Shutdown => return false,
        }
        true
    }

    fn submit(&mut self, id: u64, req: Request, events: tokio_mpsc::UnboundedSender<EngineEvent>) {
        let reject = |message: String, kind| {
            let _ = events.send(EngineEvent::Error { message, kind });
        };
        if !self.healthy.load(Ordering::Acquire) {
            return reject(
                "the model worker is not running".into(),
                EngineErrorKind::Unavailable,
            );
        }
        if self.scheduler.stats().waiting >= self.options.max_queued_requests {
            return reject(
                format!(
                    "server overloaded: {} requests already waiting",
                    self.options.max_queued_requests
                ),
                EngineErrorKind::Overloaded,
            );
        }
        match self.scheduler.submit(req) {
            Ok(()) => {
                self.last_submit = Some(Instant::now());
                self.requests.insert(
                    id,
                    LiveRequest {
                        events,
                        submitted: Instant::now(),
                        admitted: None,
                        first_token: None,
                        last_token: None,
                    },
                );
            }
            Err(e) => reject(e.to_string(), EngineErrorKind::BadRequest),
        }
    }

    /// Waits for the result of the oldest plan in flight (checking that the workers live),
    /// and pops it with its plan. A result older than that plan is stale and dropped; one for
    /// a newer plan in flight means the worker skipped the plans before it: they are dropped
    /// too, and the scheduler counts them as answered with nothing.
    fn recv_oldest(&mut self) -> Result<Option<(Plan, StepResult)>, LinkError> {
        let Some(oldest) = self.in_flight.front().map(|p| p.step_id) else {
            return Ok(None);
        };
        // The watchdog times the wait for each result, a lower bound of the step's run time.
        let waiting_since = Instant::now();
        loop {
            let Some(result) = self.link.recv_result(self.options.liveness_interval)? else {
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
        let outputs = self.scheduler.advance(&result);
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
                let m = &self.metrics;
                m.time_to_first_token
                    .observe((now - live.submitted).as_secs_f64());
                m.prefix_cache_queries.inc_by(u64::from(out.prompt_tokens));
                m.prefix_cache_hits.inc_by(u64::from(out.cached_tokens));
            } else if let Some(last) = live.last_token {
                self.metrics
                    .inter_token_latency
                    .observe((now - last).as_secs_f64());
            }
            live.last_token = Some(now);
        }
        if let Some(message) = out.error {
            // The scheduler has dropped it already.
            if let Some(live) = self.requests.remove(&id) {
                let _ = live.events.send(EngineEvent::Error {
                    message,
                    kind: EngineErrorKind::Unavailable,
                });
            }
            return;
        }
        let (finish, prompt_tokens, completion_tokens) =
            (out.finished, out.prompt_tokens, out.completion_tokens);
        self.metrics
            .generation_tokens
            .inc_by(out.tokens.len() as u64);
        let event = EngineEvent::Token(TokenEvent {
            tokens: out.tokens,
            logprobs: out.logprobs,
            top_logprobs: out.top_logprobs,
            prompt_logprobs: out.prompt_logprobs,
            prompt_top_logprobs: out.prompt_top_logprobs,
            finish: out.finished,
            usage: TokenUsage {
                prompt_tokens: out.prompt_tokens,
                completion_tokens: out.completion_tokens,
                cached_tokens: out.cached_tokens,
            },
        });
        let delivered = live.events.send(event).is_ok();
        if let Some(reason) = finish {
            if let Some(live) = self.requests.remove(&id) {
                let admitted = live.admitted.unwrap_or(live.submitted);
                let first = live.first_token.unwrap_or(now);
                self.metrics.observe_finished(&RequestTimes {
                    queued: admitted - live.submitted,
                    prefill: first.saturating_duration_since(admitted),
                    decode: now.saturating_duration_since(first),
                    e2e: now - live.submitted,
                    prompt_tokens,
                    generation_tokens: completion_tokens,
                    finished_reason: match reason {
                        FinishReason::Stop => "stop",
                        FinishReason::Length => "length",
                    },
                });
            }
        } else if !delivered {
            // The client went away: free its slot and pages now.
            self.requests.remove(&id);
            self.scheduler.abort(id);
            self.count_abort();
        }
    }

    fn count_abort(&self) {
        self.metrics
            .request_success
            .with_label_values(&["abort"])
            .inc();
    }

    /// The engine thread panicked (a bug): /health fails, every request in flight ends with an
    /// error, and so does every later one, until shutdown. The scheduler is not touched again:
    /// its state may be what the panic left half-changed.
    fn after_panic(&mut self, message: String) {
        self.healthy.store(false, Ordering::Release);
        tracing::error!(%message, "the engine thread panicked; failing all requests");
        self.lifeline
            .fail(format!("the engine thread panicked: {message}"));
        let error = |m: &str| EngineEvent::Error {
            message: format!("the engine failed: {m}"),
            kind: EngineErrorKind::Unavailable,
        };
        for (_, live) in self.requests.drain() {
            let _ = live.events.send(error(&message));
        }
        while let Ok(cmd) = self.commands.recv() {
            match cmd {
                Command::Submit { events, .. } => {
                    let _ = events.send(error(&message));
                }
                Command::FlushCache { reply } => {
                    let _ = reply.send(false);
                }
                Command::Abort { .. } | Command::AbortAll { .. } => {}
                Command::Shutdown => return,
            }
        }
    }

    /// The worker group is gone: every request ends with an error and /health fails.
    fn fail_all(&mut self, error: &LinkError) {
        if self.healthy.swap(false, Ordering::AcqRel) {
            tracing::error!(%error, "worker group failed; failing all requests");
            self.lifeline
                .fail(format!("the model worker failed: {error}"));
        }
        for (id, live) in self.requests.drain() {
            self.scheduler.abort(id);
            let _ = live.events.send(EngineEvent::Error {
                message: format!("the model worker failed: {error}"),
                kind: EngineErrorKind::Unavailable,
            });
        }
        // No result will come for the plans in flight: close them in the scheduler too (every
        // request is aborted, so answering them with nothing changes nothing else).
        if let Some(last) = self.in_flight.back().map(|p| p.step_id) {
            self.scheduler.advance(&StepResult {
                step_id: last,
                events: Vec::new(),
            });
        }
        self.in_flight.clear();
        self.prefill_sent.clear();
        self.publish_stats(0, 0);
    }

    fn publish_stats(&mut self, batch: usize, tokens: usize) {
        let s: SchedulerStats = self.scheduler.stats();
        self.metrics.observe_pool(&s);
        if let Ok(mut stats) = self.stats.lock() {
            *stats = EngineStats {
                total_pages: s.total_pages,
                free_pages: s.free_pages,
                used_pages: s.used_pages,
                cached_pages: s.cached_pages,
                evictable_pages: s.evictable_pages,
                running_requests: s.running,
                waiting_requests: s.waiting,
                steps: self.steps,
                max_batch_size: self.max_batch,
                last_batch_size: batch,
                last_step_tokens: tokens,
                busy_s: self.busy.as_secs_f64(),
                stalled_s: self.stalled.as_secs_f64(),
            };
        }
    }
}
