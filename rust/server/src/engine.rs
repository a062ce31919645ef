//! The engine thread: the single owner of the scheduler. HTTP tasks talk to it through
//! `EngineHandle` (a command channel); it talks to the worker group through a `WorkerLink`.
//!
//! One loop: take commands → schedule a plan → send it → wait for the oldest step result →
//! advance the scheduler → route each token to its request's event channel. With overlap on
//! (the default) up to two plans are in flight: plan N+1 is scheduled and sent while the
//! worker runs plan N, so the GPU does not idle while the host schedules and detokenizes.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokenspeed_engine::scheduler::{FinishReason, Request, RequestId, Scheduler, SchedulerConfig};
use tokenspeed_engine::{Plan, StepResult};
use tokio::sync::{mpsc as tokio_mpsc, oneshot};

use crate::metrics::Metrics;

mod ending;
mod event_loop;
mod grammar;
mod plan_clock;
mod publish;
mod trace;
mod worker_ops;
use event_loop::{panic_message, EngineLoop};

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
    /// 1-based rank of each prompt token in its distribution, one per prompt logprob.
    pub prompt_ranks: Vec<u32>,
    pub finish: Option<FinishReason>,
    pub usage: TokenUsage,
    /// A pooling request's vector (`FinishReason::Pooled`); empty otherwise.
    pub pooled: Vec<f32>,
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
    /// This request failed on the server's side (e.g. its grammar matcher); others go on.
    Internal,
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
    /// Seconds the GPU sat idle between steps as the worker measured it (CUDA events from the
    /// end of one step's GPU work to the start of the next one's; host wall clock on the CPU),
    /// summed from its step results. Unlike `stalled_s` it sees the worker's own host time
    /// between steps (one-step-ahead scheduling keeps `stalled_s` near 0 even when the GPU
    /// waits for the worker), and it counts every gap, also while the server had no requests.
    /// Not in it: a gap inside a step's launch (a host sync after its first kernel).
    pub gpu_idle_s: f64,
    /// Prompt tokens of the requests that reached their first token, and how many of them the
    /// radix cache held (per replica under data parallelism: where the prefix hits land).
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    /// Requests the scheduler sent back to the queue (`SchedulerStats::retractions`).
    pub retractions: u64,
    /// Speculative decoding (`SchedulerStats::spec_*`): drafts verified, accepted, verify steps.
    pub spec_draft_tokens: u64,
    pub spec_accepted_tokens: u64,
    pub spec_verify_steps: u64,
    /// Whether speculation is on now (`SchedulerStats::spec_enabled`; with data parallelism,
    /// on in any replica), the decoding steps that ran with it turned off, and the steps
    /// planned one step ahead while it was paused.
    pub spec_enabled: bool,
    pub spec_off_steps: u64,
    pub spec_ahead_steps: u64,
    /// The radix cache's host tier (`--enable-hierarchical-cache`; zeros when off).
    pub host: tokenspeed_engine::HostStats,
    /// Its storage tier (`--hicache-storage-backend`; zeros when off).
    pub storage: tokenspeed_engine::StorageStats,
    /// PD disaggregation's KV transfers (`--disaggregation-mode`; zeros when off).
    pub kv_transfer: tokenspeed_engine::KvTransferStats,
}

enum Command {
    Submit {
        id: RequestId,
        request: Box<Request>,
        constraint: Option<Constraint>,
        events: tokio_mpsc::UnboundedSender<EngineEvent>,
        stop: StopSignal,
        /// `--enable-trace`: the request's trace, for its queue, prefill and decode spans.
        trace: Option<crate::otel::RequestTrace>,
    },
    Abort {
        id: RequestId,
    },
    /// The front end matched a stop string (its `StopSignal` says after how many tokens): the
    /// scheduler finishes the request as `StopString` (not an abort), its KV pages freed and
    /// its prefix cached.
    StopMatched {
        id: RequestId,
    },
    /// How many leading tokens of `tokens` the radix cache holds under LoRA adapter `lora_id`
    /// (0: the base model); the cache-aware router asks.
    PrefixLen {
        lora_id: u32,
        tokens: Arc<Vec<u32>>,
        reply: oneshot::Sender<usize>,
    },
    FlushCache {
        reply: oneshot::Sender<bool>,
    },
    /// The pinned LoRA adapters, all of them (`Scheduler::pin_adapters`).
    PinAdapters {
        pins: Vec<u32>,
    },
    /// Ends every live request with an error (the shutdown drain ran out of time).
    AbortAll {
        message: String,
    },
    /// Stops (or resumes) planning steps; requests stay where they are and new ones queue
    /// (`/pause_generation`, `/continue_generation`). Steps already in flight finish.
    SetPaused {
        paused: bool,
        reply: oneshot::Sender<()>,
    },
    /// Runs an operation on the worker group once no request holds a slot (admission is held
    /// meanwhile; queued requests wait), replying with its outcome (`engine/worker_ops.rs`).
    WorkerOp {
        op: tokenspeed_engine::WorkerOp,
        reply: oneshot::Sender<OpReply>,
    },
    Shutdown,
}

/// How an operation on the worker group went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpReply {
    pub ok: bool,
    pub message: String,
    /// Requests that were queued, held while it ran.
    pub queued: usize,
}

/// How the front end tells the engine that a stop string ended a request, and after how many
/// generated tokens: written before the request's event channel is dropped. The engine reads it
/// whenever it ends the request (`Command::StopMatched`, or a token it can no longer deliver), so
/// a stop is never counted as a client that went away, whichever of the two it sees first.
#[derive(Clone, Default)]
pub struct StopSignal(Arc<AtomicU32>);

impl StopSignal {
    pub fn set(&self, generated: u32) {
        self.0.store(generated.saturating_add(1), Ordering::Release);
    }

    /// The generated tokens the stop string kept, once set.
    pub fn get(&self) -> Option<u32> {
        self.0.load(Ordering::Acquire).checked_sub(1)
    }
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
    healthy: Arc<AtomicBool>,
    stats: Arc<Mutex<EngineStats>>,
    lifeline: Arc<Lifeline>,
}

impl EngineHandle {
    /// Queues a tokenized, validated request under its id (`request.id`, unique: the API
    /// request's UUID and choice); its tokens arrive on the returned channel.
    /// With a `constraint`, its tokens follow the grammar (see `engine/grammar.rs`).
    pub fn submit(
        &self,
        request: Request,
        constraint: Option<Constraint>,
        stop: StopSignal,
    ) -> tokio_mpsc::UnboundedReceiver<EngineEvent> {
        self.submit_traced(request, constraint, stop, None)
    }

    /// `submit`, with the request's trace (`--enable-trace`): the engine records its queue,
    /// prefill-chunk and decode spans.
    pub fn submit_traced(
        &self,
        request: Request,
        constraint: Option<Constraint>,
        stop: StopSignal,
        trace: Option<crate::otel::RequestTrace>,
    ) -> tokio_mpsc::UnboundedReceiver<EngineEvent> {
        let (events, rx) = tokio_mpsc::unbounded_channel();
        let sent = self.commands.send(Command::Submit {
            id: request.id,
            request: Box::new(request),
            constraint,
            events: events.clone(),
            stop,
            trace,
        });
        if sent.is_err() {
            let _ = events.send(EngineEvent::Error {
                message: "the engine has stopped".into(),
                kind: EngineErrorKind::Unavailable,
            });
        }
        rx
    }

    /// The exact length of the longest prefix of `tokens` this engine's radix cache holds, as
    /// the engine thread sees it between two steps: the scheduler never leaves that thread, so
    /// the question travels as a command (answered within one step; None if the engine is gone).
    pub async fn cached_prefix_len(&self, lora_id: u32, tokens: Arc<Vec<u32>>) -> Option<usize> {
        let (reply, rx) = oneshot::channel();
        self.commands
            .send(Command::PrefixLen {
                lora_id,
                tokens,
                reply,
            })
            .ok()?;
        rx.await.ok()
    }

    /// Ends request `id` as aborted (client gone, `/abort_request`); unknown ids are ignored.
    pub fn abort(&self, id: RequestId) {
        let _ = self.commands.send(Command::Abort { id });
    }

    /// Ends request `id` as finished by a stop string the front end found after its first
    /// `generated` tokens: the scheduler, which ends every request, records it as a
    /// `StopString` ("stop" in the API).
    pub fn stop_matched(&self, id: RequestId, signal: &StopSignal, generated: u32) {
        signal.set(generated);
        let _ = self.commands.send(Command::StopMatched { id });
    }

    /// Drops every cached prefix; false when requests are running (as in SGLang).
    pub async fn flush_cache(&self) -> bool {
        let (reply, rx) = oneshot::channel();
        if self.commands.send(Command::FlushCache { reply }).is_err() {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// The pinned LoRA adapters now (the registry's `PinSink`): queued before any request
    /// sent after it, so a request on a new pin is admitted under it.
    pub fn pin_adapters(&self, pins: Vec<u32>) {
        let _ = self.commands.send(Command::PinAdapters { pins });
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

    /// Runs `op` on the worker group (`Command::WorkerOp`) and waits for its outcome.
    pub async fn worker_op(&self, op: tokenspeed_engine::WorkerOp) -> OpReply {
        let (reply, rx) = oneshot::channel();
        let gone = OpReply {
            ok: false,
            message: "the engine has stopped".into(),
            queued: 0,
        };
        if self.commands.send(Command::WorkerOp { op, reply }).is_err() {
            return gone;
        }
        rx.await.unwrap_or(gone)
    }

    /// Stops or resumes planning steps (`Command::SetPaused`); resolves once the engine has
    /// taken it, so a request sent after a pause returns is held by it.
    pub async fn set_paused(&self, paused: bool) {
        let (reply, rx) = oneshot::channel();
        if self
            .commands
            .send(Command::SetPaused { paused, reply })
            .is_ok()
        {
            let _ = rx.await;
        }
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
    /// With overlap: plan step N+1 this long before a decode-only step N is expected to end,
    /// not as soon as N starts (`--schedule-lead-ms`; engine/plan_clock.rs). None: at once.
    pub plan_lead: Option<Duration>,
    /// A step whose result takes longer than this fails the worker group (`--watchdog-timeout`).
    pub watchdog: Option<Duration>,
    /// Words of a grammar's token mask row (`GrammarCompiler::bitmask_words`; 0: no grammars).
    pub mask_words: usize,
    /// Set the KV pool gauges of `/metrics` after each step. Off under data parallelism, where
    /// they are the sum over replicas (set when `/metrics` is read).
    pub pool_metrics: bool,
    /// Most distinct LoRA adapters running at once (`--max-loras-per-batch`; usize::MAX: off).
    pub max_adapters: usize,
    /// Where the radix cache's KV events go after each step (`--kv-events-config`; None: off,
    /// and the cache records none).
    pub kv_events: Option<crate::kv_events::KvEventSink>,
    /// `--enable-trace`: requests may carry a trace (engine/trace.rs); off, no step looks.
    pub trace: bool,
}

/// A request's structured-output constraint, as the engine applies it.
pub struct Constraint {
    pub grammar: Arc<tokenspeed_structured::CompiledGrammar>,
    /// With a reasoning parser: the think-end token, after which the grammar starts (the
    /// reasoning itself is unconstrained). None: from the first generated token.
    pub starts_after: Option<u32>,
    /// Enforced by the worker (`--grammar-backend xgrammar`): the grammar as it travels there;
    /// `grammar` then only validated it. None: the engine's llguidance matcher enforces it.
    pub worker: Option<crate::constraint::WorkerGrammar>,
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
        healthy: Arc::new(AtomicBool::new(true)),
        stats: Arc::new(Mutex::new(EngineStats::default())),
        lifeline: Arc::new(Lifeline::default()),
    };
    let (healthy, stats) = (handle.healthy.clone(), handle.stats.clone());
    let lifeline = handle.lifeline.clone();
    let mask_words = options.mask_words;
    let plan_lead = options.plan_lead;
    // The scheduler is single-threaded by design (it shares pages through Rc), so it is built
    // on the engine thread and never leaves it.
    let (started_tx, started_rx) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("tokenspeed-engine".into())
        .spawn(move || {
            let _stopped = StoppedOnDrop(lifeline.clone());
            let mut scheduler = match Scheduler::new(config) {
                Ok(s) => s,
                Err(e) => {
                    let _ = started_tx.send(Err(e.to_string()));
                    return;
                }
            };
            scheduler.limit_adapters(options.max_adapters);
            if options.kv_events.is_some() {
                scheduler.enable_kv_events();
            }
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
                gpu_idle: Duration::ZERO,
                last_submit: None,
                prefill_sent: HashMap::new(),
                traced_steps: HashMap::new(),
                grammars: grammar::Grammars::new(mask_words),
                plan_clock: plan_clock::PlanClock::new(plan_lead),
                prefix_queries: 0,
                prefix_hits: 0,
                paused: false,
                pending_op: None,
                memory_released: false,
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
