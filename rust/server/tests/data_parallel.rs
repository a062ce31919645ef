//! Data-parallel replicas (`Replicas`) over real engine threads and schedulers, each driving
//! its own fake worker: request ids name their replica and aborts reach it; cache-aware routing
//! follows the prefix a replica's radix tree holds; one dead worker fails health, naming the
//! replica.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use tokenspeed_engine::plan::RequestEvent;
use tokenspeed_engine::{Plan, Request, SamplingParams, SchedulerConfig, StepResult};
use tokenspeed_server::engine::{spawn_engine, EngineEvent, EngineOptions, LinkError, WorkerLink};
use tokenspeed_server::generate::new_request_id;
use tokenspeed_server::kv_events::{self, KvEventsConfig};
use tokenspeed_server::metrics::Metrics;
use tokenspeed_server::router::Policy;
use tokenspeed_server::Replicas;

mod common;

/// Samples token 7 for every request that samples, a few milliseconds per step; counts the
/// requests it ever scheduled.
struct EchoWorker {
    plans: mpsc::Sender<Plan>,
    results: mpsc::Receiver<StepResult>,
    dead: Arc<AtomicBool>,
}

impl EchoWorker {
    fn start(dead: Arc<AtomicBool>, scheduled: Arc<AtomicUsize>) -> Self {
        let (plan_tx, plan_rx) = mpsc::channel::<Plan>();
        let (res_tx, res_rx) = mpsc::channel();
        std::thread::spawn(move || {
            while let Ok(plan) = plan_rx.recv() {
                std::thread::sleep(Duration::from_millis(2));
                scheduled.fetch_add(plan.new_requests.len(), Ordering::Relaxed);
                let events = plan
                    .scheduled
                    .iter()
                    .filter(|r| r.sample)
                    .map(|r| RequestEvent {
                        slot: r.slot,
                        tokens: vec![7],
                        logprobs: vec![-0.5],
                        ..Default::default()
                    })
                    .collect();
                let result = StepResult {
                    step_id: plan.step_id,
                    events,
                    ..Default::default()
                };
                if res_tx.send(result).is_err() {
                    return;
                }
            }
        });
        EchoWorker {
            plans: plan_tx,
            results: res_rx,
            dead,
        }
    }
}

impl WorkerLink for EchoWorker {
    fn send_plan(&mut self, plan: &Plan) -> Result<(), LinkError> {
        self.check_alive()?;
        self.plans
            .send(plan.clone())
            .map_err(|e| LinkError::Channel(e.to_string()))
    }
    fn recv_result(&mut self, timeout: Duration) -> Result<Option<StepResult>, LinkError> {
        match self.results.recv_timeout(timeout) {
            Ok(r) => Ok(Some(r)),
            Err(mpsc::RecvTimeoutError::Timeout) => Ok(None),
            Err(e) => Err(LinkError::Channel(e.to_string())),
        }
    }
    fn check_alive(&mut self) -> Result<(), LinkError> {
        if self.dead.load(Ordering::Acquire) {
            Err(LinkError::WorkerDied { pid: 4242 })
        } else {
            Ok(())
        }
    }
}

struct Group {
    replicas: Replicas,
    dead: Vec<Arc<AtomicBool>>,
    scheduled: Vec<Arc<AtomicUsize>>,
}

fn group(n: usize, policy: Policy) -> Group {
    group_with(n, policy, None)
}

/// `group`, each replica publishing KV events with `kv` (on the endpoint's port + its rank).
fn group_with(n: usize, policy: Policy, kv: Option<&KvEventsConfig>) -> Group {
    let metrics = Arc::new(Metrics::new("test-model", 4096));
    let (mut engines, mut dead, mut scheduled) = (vec![], vec![], vec![]);
    for rank in 0..n {
        let d = Arc::new(AtomicBool::new(false));
        let s = Arc::new(AtomicUsize::new(0));
        let config = SchedulerConfig {
            context_length: 4096,
            ..common::scheduler_config()
        };
        let options = EngineOptions {
            max_queued_requests: 64,
            step_log_interval: 0,
            liveness_interval: Duration::from_millis(20),
            overlap: true,
            plan_lead: None,
            watchdog: None,
            mask_words: 0,
            pool_metrics: false,
            max_adapters: usize::MAX,
            kv_events: kv.map(|kv| kv_events::start(kv, rank as u32).expect("KV events bind")),
            trace: false,
        };
        let link = Box::new(EchoWorker::start(d.clone(), s.clone()));
        let (engine, _thread) =
            spawn_engine(config, link, options, metrics.clone()).expect("engine");
        engines.push(engine);
        dead.push(d);
        scheduled.push(s);
    }
    Group {
        replicas: Replicas::new(engines, policy),
        dead,
        scheduled,
    }
}

fn request(prompt: Vec<u32>, max_new_tokens: u32) -> Request {
    Request {
        id: new_request_id(),
        prompt,
        sampling: SamplingParams::greedy(),
        max_new_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Tokens until the request finishes (or its channel closes: aborted).
async fn drain(events: &mut tokio::sync::mpsc::UnboundedReceiver<EngineEvent>) -> usize {
    let mut n = 0;
    while let Some(e) = events.recv().await {
        match e {
            EngineEvent::Token(t) => {
                n += t.tokens.len();
                if t.finish.is_some() {
                    break;
                }
            }
            EngineEvent::Error { message, .. } => panic!("{message}"),
        }
    }
    n
}

#[tokio::test]
async fn ids_name_their_replica_and_an_abort_reaches_the_owner() {
    let g = group(2, Policy::RoundRobin);
    let mut owners = vec![];
    for _ in 0..4 {
        let mut d = g
            .replicas
            .dispatch(request(vec![1, 2, 3], 2), None, None)
            .await;
        owners.push(d.replica);
        assert_eq!(drain(&mut d.events).await, 2);
    }
    assert_eq!(owners, vec![0, 1, 0, 1]);
    assert_eq!(g.scheduled[0].load(Ordering::Relaxed), 2);
    assert_eq!(g.scheduled[1].load(Ordering::Relaxed), 2);

    // A long request on replica 1, aborted by id after its first token: its channel closes
    // long before its 1500 tokens (an abort sent to replica 0 would leave it running).
    let mut d = g
        .replicas
        .dispatch(request(vec![5, 6, 7], 1_500), None, Some(1))
        .await;
    assert_eq!(d.replica, 1);
    match d.events.recv().await {
        Some(EngineEvent::Token(_)) => {}
        other => panic!("expected a token, got {other:?}"),
    }
    g.replicas.abort(d.id);
    let rest = tokio::time::timeout(Duration::from_secs(5), drain(&mut d.events))
        .await
        .expect("the abort ended the request");
    assert!(rest < 500, "{rest} tokens after the abort");
    // Its load ends with the dispatch; the engine publishes its running count after a step.
    drop(d);
    assert_eq!(g.replicas.replica_info()[1].outstanding, 0);
}

#[tokio::test]
async fn cache_aware_follows_the_replica_holding_the_prefix() {
    let g = group(2, Policy::CacheAware);
    let system: Vec<u32> = (100..164).collect(); // 64 tokens: 16 pages
    let with_question = |q: u32| {
        let mut p = system.clone();
        p.extend([q, q + 1, q + 2]);
        p
    };
    // Seed replica 1's tree, then ask without pinning: every request follows it.
    let mut d = g
        .replicas
        .dispatch(request(with_question(1), 1), None, Some(1))
        .await;
    drain(&mut d.events).await;
    drop(d);
    for q in 10..14 {
        let mut d = g
            .replicas
            .dispatch(request(with_question(q), 1), None, None)
            .await;
        assert_eq!(d.replica, 1, "question {q} went to replica {}", d.replica);
        drain(&mut d.events).await;
    }
    // The engine publishes its counters just after routing the last token: wait for them.
    let mut info = g.replicas.replica_info();
    for _ in 0..200 {
        if info[1].prompt_tokens >= 5 * 67 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        info = g.replicas.replica_info();
    }
    assert!(info[1].cached_tokens >= 4 * 64, "{info:?}");
    assert_eq!(info[0].routed, 0);
    // Unrelated prompts: no meaningful match, so the least loaded in turn.
    let mut owners = vec![];
    for q in 0..2 {
        let mut d = g
            .replicas
            .dispatch(request(vec![9000 + q, 1, 2, 3, 4], 1), None, None)
            .await;
        owners.push(d.replica);
        drain(&mut d.events).await;
    }
    owners.sort();
    assert_eq!(owners, vec![0, 1]);
}

#[tokio::test]
async fn cache_aware_asks_for_the_prefix_in_the_requests_adapter_namespace() {
    // KV computed under a LoRA adapter lives in that adapter's namespace of the radix tree:
    // the router must ask there, or an adapter's prefix is never found and its requests
    // spread over the replicas (least loaded in turn).
    let g = group(2, Policy::CacheAware);
    let on_adapter = |q: u32| {
        let mut r = request((100..164).chain([q, q + 1, q + 2]).collect(), 1);
        r.sampling.lora_id = 5;
        r
    };
    let mut d = g.replicas.dispatch(on_adapter(1), None, Some(1)).await;
    drain(&mut d.events).await;
    drop(d);
    for q in 10..14 {
        let mut d = g.replicas.dispatch(on_adapter(q), None, None).await;
        assert_eq!(d.replica, 1, "question {q} went to replica {}", d.replica);
        drain(&mut d.events).await;
    }
}

#[tokio::test]
async fn shortest_queue_routes_around_a_busy_replica() {
    let g = group(2, Policy::ShortestQueue);
    // Three long requests held on replica 0 (their loads count until dropped).
    let mut held = vec![];
    for _ in 0..3 {
        held.push(
            g.replicas
                .dispatch(request(vec![1, 2, 3], 1_500), None, Some(0))
                .await,
        );
    }
    for _ in 0..3 {
        let mut d = g
            .replicas
            .dispatch(request(vec![4, 5], 1), None, None)
            .await;
        assert_eq!(d.replica, 1);
        drain(&mut d.events).await;
    }
    for d in &held {
        g.replicas.abort(d.id);
    }
}

#[tokio::test]
async fn one_dead_worker_fails_health_naming_its_replica() {
    let g = group(2, Policy::RoundRobin);
    assert!(g.replicas.is_healthy());
    g.dead[1].store(true, Ordering::Release);
    let reason = tokio::time::timeout(Duration::from_secs(5), g.replicas.failed())
        .await
        .expect("the failure is reported");
    assert!(reason.contains("data-parallel replica 1"), "{reason}");
    assert!(!g.replicas.is_healthy());
    let info = g.replicas.replica_info();
    assert!(info[0].healthy && !info[1].healthy);
    g.replicas.shutdown();
    assert!(g.replicas.wait_stopped(Duration::from_secs(5)));
}

#[tokio::test]
async fn each_replica_publishes_its_kv_events_on_its_own_port_with_its_rank() {
    use zeromq::{Socket, SocketRecv};
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let kv = KvEventsConfig {
        publisher: "zmq".into(),
        endpoint: format!("tcp://*:{port}"),
        replay_endpoint: None,
        buffer_steps: 0,
        hwm: 100_000,
        max_queue_size: 16,
        topic: "kv".into(),
    };
    let g = group_with(2, Policy::RoundRobin, Some(&kv));
    let mut subs = vec![];
    for rank in 0..2u16 {
        let mut sub = zeromq::SubSocket::new();
        sub.connect(&format!("tcp://127.0.0.1:{}", port + rank))
            .await
            .expect("connect");
        sub.subscribe("kv").await.expect("subscribe");
        subs.push(sub);
    }
    tokio::time::sleep(Duration::from_millis(300)).await; // the subscriptions land
    for replica in [1, 0] {
        let mut d = g
            .replicas
            .dispatch(request((1..=9).collect(), 2), None, Some(replica))
            .await;
        assert_eq!(drain(&mut d.events).await, 2);
        let got = tokio::time::timeout(Duration::from_secs(10), subs[replica].recv())
            .await
            .expect("an event batch within 10 s")
            .expect("a message");
        let frames = got.into_vec();
        assert_eq!(frames[0].as_ref(), b"kv");
        assert_eq!(frames[1].as_ref(), 0u64.to_be_bytes());
        // [ts, events, data_parallel_rank]: the rank is the payload's last byte (a fixint).
        let payload = frames[2].as_ref();
        assert_eq!(
            (payload[0], payload[payload.len() - 1]),
            (0x93, replica as u8)
        );
    }
}
