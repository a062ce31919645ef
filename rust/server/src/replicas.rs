//! Data parallelism: the server's N engines (one per replica, each with its own scheduler,
//! radix cache, KV pool and worker group) behind one router (`router.rs`). The HTTP side holds
//! a `Replicas` where it held one engine; with N = 1 it is that engine and nothing more.
//!
//! A request's id is its own (the API request's UUID, `RequestId`), chosen before routing: a
//! disconnect aborts through the owner the request holds, and `/abort_request`, which knows
//! only the id, asks every replica (the one that runs it ends it; the others hold no such id).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::{join_all, select_all};
use serde::Serialize;
use tokenspeed_engine::scheduler::{Request, RequestId};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::engine::{Constraint, EngineEvent, EngineHandle, EngineStats, StopSignal};
use crate::router::{Policy, Router};

/// How long the cache-aware router waits for a replica's prefix length (each engine answers
/// between two steps; a replica slower than this, a hung one, counts as holding nothing).
const PREFIX_QUERY_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Clone)]
pub struct Replicas {
    inner: Arc<Inner>,
}

struct Inner {
    engines: Vec<EngineHandle>,
    router: Mutex<Router>,
    /// Per replica: requests routed there and not yet ended (the router's load signal: it
    /// counts a request from the moment it is routed, before its engine has seen it).
    outstanding: Vec<Arc<AtomicUsize>>,
    /// Per replica: requests routed there so far.
    routed: Vec<AtomicU64>,
}

/// A request's place on its replica: its owner engine, and its share of the replica's load
/// until dropped (when the generation ends, however it ends).
pub struct Dispatched {
    pub id: RequestId,
    /// The replica it runs on (its data-parallel rank).
    pub replica: usize,
    pub events: UnboundedReceiver<EngineEvent>,
    pub owner: EngineHandle,
    /// Where the front end says that a stop string ended the request.
    pub stop: StopSignal,
    pub load: LoadTicket,
}

pub struct LoadTicket(Arc<AtomicUsize>);

impl Drop for LoadTicket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One replica's line in `/get_server_info`.
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaInfo {
    pub dp_rank: usize,
    pub healthy: bool,
    /// Routed here and not ended (running, queued, or on their way to the engine).
    pub outstanding: usize,
    pub routed: u64,
    pub running: usize,
    pub queued: usize,
    /// Prompt tokens this replica's radix cache served (and all prompt tokens it saw).
    pub cached_tokens: u64,
    pub prompt_tokens: u64,
    pub free_pages: usize,
    pub cached_pages: usize,
    pub steps: u64,
}

impl Replicas {
    pub fn new(engines: Vec<EngineHandle>, policy: Policy) -> Self {
        let n = engines.len();
        Replicas {
            inner: Arc::new(Inner {
                router: Mutex::new(Router::new(policy, n)),
                outstanding: (0..n).map(|_| Arc::new(AtomicUsize::new(0))).collect(),
                routed: (0..n).map(|_| AtomicU64::new(0)).collect(),
                engines,
            }),
        }
    }

    pub fn len(&self) -> usize {
        self.inner.engines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.inner.engines.is_empty()
    }

    /// Routes a tokenized, validated request (to `pin` if given: the warm-up and
    /// `/health_generate` probe each replica) and queues it there.
    pub async fn dispatch(
        &self,
        request: Request,
        constraint: Option<Constraint>,
        pin: Option<usize>,
    ) -> Dispatched {
        self.dispatch_traced(request, constraint, pin, None).await
    }

    /// `dispatch`, with the request's trace (`--enable-trace`) handed to the engine.
    pub async fn dispatch_traced(
        &self,
        request: Request,
        constraint: Option<Constraint>,
        pin: Option<usize>,
        trace: Option<crate::otel::RequestTrace>,
    ) -> Dispatched {
        let replica = match pin {
            Some(r) => r % self.len(),
            None => self.route(request.sampling.lora_id, &request.prompt).await,
        };
        self.dispatch_to(replica, request, constraint, trace)
    }

    /// `dispatch` without waiting: cache-aware routing falls back to the least loaded replica.
    pub fn submit(
        &self,
        request: Request,
        constraint: Option<Constraint>,
    ) -> (RequestId, UnboundedReceiver<EngineEvent>) {
        let replica = self.pick(None);
        // The caller tracks the request by id alone, so it is not counted in the load.
        let d = self.dispatch_to(replica, request, constraint, None);
        (d.id, d.events)
    }

    fn dispatch_to(
        &self,
        replica: usize,
        request: Request,
        constraint: Option<Constraint>,
        trace: Option<crate::otel::RequestTrace>,
    ) -> Dispatched {
        let id = request.id;
        let load = self.inner.outstanding[replica].clone();
        load.fetch_add(1, Ordering::AcqRel);
        self.inner.routed[replica].fetch_add(1, Ordering::Relaxed);
        let owner = self.inner.engines[replica].clone();
        let stop = StopSignal::default();
        let events = owner.submit_traced(request, constraint, stop.clone(), trace);
        Dispatched {
            id,
            replica,
            events,
            owner,
            stop,
            load: LoadTicket(load),
        }
    }

    /// The replica for a prompt run under LoRA adapter `lora_id` (0: the base model): the
    /// router weighs each replica's cached prefix of it in that adapter's cache namespace.
    async fn route(&self, lora_id: u32, prompt: &[u32]) -> usize {
        let wants = self
            .inner
            .router
            .lock()
            .map(|r| r.wants_prefix_lengths())
            .unwrap_or(false);
        if !wants {
            return self.pick(None);
        }
        // Every replica answers for its own tree, all at once: the wait is the slowest
        // replica's time to its next step boundary, not the sum.
        let tokens = Arc::new(prompt.to_vec());
        let answers = join_all(self.inner.engines.iter().map(|e| {
            let tokens = tokens.clone();
            async move {
                tokio::time::timeout(PREFIX_QUERY_TIMEOUT, e.cached_prefix_len(lora_id, tokens))
                    .await
                    .ok()
                    .flatten()
                    .unwrap_or(0)
            }
        }))
        .await;
        self.pick(Some((&answers, prompt.len())))
    }

    fn pick(&self, prefix: Option<(&[usize], usize)>) -> usize {
        let loads: Vec<usize> = self
            .inner
            .outstanding
            .iter()
            .map(|o| o.load(Ordering::Acquire))
            .collect();
        match self.inner.router.lock() {
            Ok(mut r) => r.pick(&loads, prefix),
            Err(_) => 0,
        }
    }

    /// Aborts request `id` wherever it runs (replicas that do not hold it ignore the abort).
    pub fn abort(&self, id: RequestId) {
        for engine in &self.inner.engines {
            engine.abort(id);
        }
    }

    /// Drops every replica's cached prefixes; false when any replica has requests running.
    pub async fn flush_cache(&self) -> bool {
        join_all(self.inner.engines.iter().map(|e| e.flush_cache()))
            .await
            .into_iter()
            .all(|flushed| flushed)
    }

    /// Every replica's scheduler keeps slots for the pinned LoRA adapters `pins`.
    pub fn pin_adapters(&self, pins: Vec<u32>) {
        for engine in &self.inner.engines {
            engine.pin_adapters(pins.clone());
        }
    }

    /// Healthy only while every replica is: one dead worker fails `/health` (and the server
    /// stops, as with one replica).
    pub fn is_healthy(&self) -> bool {
        self.inner.engines.iter().all(|e| e.is_healthy())
    }

    /// The totals over replicas.
    pub fn stats(&self) -> EngineStats {
        let all: Vec<EngineStats> = self.inner.engines.iter().map(|e| e.stats()).collect();
        EngineStats::sum(&all)
    }

    pub fn replica_info(&self) -> Vec<ReplicaInfo> {
        self.inner
            .engines
            .iter()
            .enumerate()
            .map(|(r, e)| {
                let s = e.stats();
                ReplicaInfo {
                    dp_rank: r,
                    healthy: e.is_healthy(),
                    outstanding: self.inner.outstanding[r].load(Ordering::Acquire),
                    routed: self.inner.routed[r].load(Ordering::Relaxed),
                    running: s.running_requests,
                    queued: s.waiting_requests,
                    cached_tokens: s.prefix_cache_hits,
                    prompt_tokens: s.prefix_cache_queries,
                    free_pages: s.free_pages,
                    cached_pages: s.cached_pages,
                    steps: s.steps,
                }
            })
            .collect()
    }

    pub fn policy(&self) -> Option<Policy> {
        self.inner.router.lock().ok().map(|r| r.policy())
    }

    pub fn shutdown(&self) {
        for e in &self.inner.engines {
            e.shutdown();
        }
    }

    /// Runs `op` on every replica's worker group (`EngineHandle::worker_op`): ok when all
    /// succeeded; the message of the first that failed, else of the first.
    pub async fn worker_op(&self, op: tokenspeed_engine::WorkerOp) -> crate::engine::OpReply {
        let replies = join_all(self.inner.engines.iter().map(|e| e.worker_op(op.clone()))).await;
        let queued = replies.iter().map(|r| r.queued).sum();
        let first = replies
            .iter()
            .find(|r| !r.ok)
            .or(replies.first())
            .cloned()
            .unwrap_or(crate::engine::OpReply {
                ok: false,
                message: "no engine".into(),
                queued: 0,
            });
        crate::engine::OpReply { queued, ..first }
    }

    /// Pauses or resumes every replica (`EngineHandle::set_paused`).
    pub async fn set_paused(&self, paused: bool) {
        join_all(self.inner.engines.iter().map(|e| e.set_paused(paused))).await;
    }

    pub fn abort_all(&self, message: impl Into<String>) {
        let message = message.into();
        for e in &self.inner.engines {
            e.abort_all(message.clone());
        }
    }

    /// Resolves once any replica can no longer serve, with the reason (naming the replica
    /// when there are several).
    pub async fn failed(&self) -> String {
        let n = self.len();
        let waits = self.inner.engines.iter().enumerate().map(|(r, e)| {
            Box::pin(async move {
                let message = e.failed().await;
                if n > 1 {
                    format!("data-parallel replica {r}: {message}")
                } else {
                    message
                }
            })
        });
        select_all(waits).await.0
    }

    /// Waits up to `timeout` for every engine thread to end (after `shutdown`).
    pub fn wait_stopped(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        self.inner
            .engines
            .iter()
            .all(|e| e.wait_stopped(deadline.saturating_duration_since(Instant::now())))
    }
}
