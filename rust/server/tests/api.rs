//! The HTTP API against a real engine thread and scheduler, with a scripted fake worker:
//! every sampled token comes from a fixed script, so responses are exactly predictable.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tokenspeed_engine::plan::RequestEvent;
use tokenspeed_engine::SchedulerConfig;
use tokenspeed_engine::{GrammarRow, Plan, StepResult, StepTiming, LAST_SAMPLED};
use tokenspeed_server::engine::{LinkError, WorkerLink};
use tokenspeed_server::http::{router, AppState};
use tokenspeed_server::{build_state, ServerConfig};
use tokenspeed_text::TextTokenizer;
use tower::ServiceExt;

mod common;
use common::smollm2_dir;

/// What the scripted worker reports as its GPU idle time before each step.
const GPU_IDLE_US_PER_STEP: u32 = 250;

/// What the scripted worker saw, for tests to check.
#[derive(Default)]
struct WorkerLog {
    /// The most plans sent whose results the engine had not taken yet.
    max_in_flight: AtomicUsize,
    /// `LAST_SAMPLED` inputs seen.
    placeholders: AtomicUsize,
    /// Mask rows applied: sent with their plan, and sent later in a mask completion.
    masks_in_plan: AtomicUsize,
    masks_completed: AtomicUsize,
    /// Grammar rows (a worker-side grammar backend): (plan had the slot's new request, row).
    grammar_rows: Mutex<Vec<(bool, GrammarRow)>>,
    /// Per step: when the engine sent its plan, and when the worker finished it.
    sent_at: Mutex<HashMap<u64, Instant>>,
    done_at: Mutex<HashMap<u64, Instant>>,
}

/// Answers each plan on a worker thread, in order, queueing the results: sampled token =
/// script[position in the answer], or under a grammar mask that forbids it, the lowest allowed
/// id. A plan with pending masks waits for its mask completion (the next plan). A plan that
/// breaks the worker contract kills the thread, which the engine sees as a dead channel (every
/// request then fails).
struct ScriptedWorker {
    plans: mpsc::Sender<Plan>,
    results: mpsc::Receiver<StepResult>,
    dead: Arc<AtomicBool>,
    log: Arc<WorkerLog>,
    in_flight: usize,
    /// Panics (on the engine thread, where links run) when asked to send this many plans.
    panic_after: Option<usize>,
    sent: usize,
}

impl ScriptedWorker {
    /// `step_time`: how long each plan takes (a sleep before its result).
    fn start(
        script: Vec<u32>,
        dead: Arc<AtomicBool>,
        log: Arc<WorkerLog>,
        step_time: Duration,
    ) -> Self {
        let (plan_tx, plan_rx) = mpsc::channel::<Plan>();
        let (res_tx, res_rx) = mpsc::channel();
        let seen = log.clone();
        std::thread::spawn(move || {
            // Per slot: tokens sampled so far, and whether its previous step sampled.
            let mut produced = std::collections::HashMap::<u32, (usize, bool)>::new();
            while let Ok(plan) = plan_rx.recv() {
                let mut masks: std::collections::HashMap<u32, Vec<u32>> = plan
                    .masks
                    .iter()
                    .filter(|m| !m.allowed.is_empty())
                    .map(|m| (m.slot, m.allowed.clone()))
                    .collect();
                seen.masks_in_plan.fetch_add(masks.len(), Ordering::Relaxed);
                if let Ok(mut rows) = seen.grammar_rows.lock() {
                    for g in &plan.grammars {
                        let admitted = plan.new_requests.iter().any(|n| n.slot == g.slot);
                        rows.push((admitted, g.clone()));
                    }
                }
                if plan.masks.iter().any(|m| m.allowed.is_empty()) {
                    let Ok(completion) = plan_rx.recv() else {
                        return;
                    };
                    assert_eq!(
                        completion.step_id, plan.step_id,
                        "a mask completion follows"
                    );
                    assert!(completion.scheduled.is_empty());
                    seen.masks_completed
                        .fetch_add(completion.masks.len(), Ordering::Relaxed);
                    masks.extend(completion.masks.into_iter().map(|m| (m.slot, m.allowed)));
                }
                for f in &plan.finished {
                    produced.remove(&f.slot);
                }
                for r in &plan.scheduled {
                    let ids = &r.tokens;
                    let state = produced.entry(r.slot).or_insert((0, false));
                    if ids.contains(&LAST_SAMPLED) {
                        seen.placeholders.fetch_add(1, Ordering::Relaxed);
                        assert!(
                            ids.len() == 1 && state.1,
                            "LAST_SAMPLED only as a decode right after a sampling step"
                        );
                    }
                    state.1 = r.sample;
                }
                let sampled = plan
                    .scheduled
                    .iter()
                    .filter(|r| r.sample)
                    .map(|r| {
                        let (n, _) = produced.entry(r.slot).or_insert((0, false));
                        let mut token = script[*n % script.len()];
                        *n += 1;
                        if let Some(allowed) = masks.get(&r.slot) {
                            let ok = |t: u32| allowed[t as usize / 32] >> (t % 32) & 1 == 1;
                            if !ok(token) {
                                token = (0..allowed.len() as u32 * 32)
                                    .find(|&t| ok(t))
                                    .expect("a mask allows some token");
                            }
                        }
                        RequestEvent {
                            slot: r.slot,
                            tokens: vec![token],
                            logprobs: vec![-0.5],
                            ..Default::default()
                        }
                    })
                    .collect();
                if !step_time.is_zero() {
                    std::thread::sleep(step_time);
                }
                if let Ok(mut done) = seen.done_at.lock() {
                    done.insert(plan.step_id, Instant::now());
                }
                if res_tx
                    .send(StepResult {
                        step_id: plan.step_id,
                        events: sampled,
                        timing: vec![StepTiming {
                            gpu_idle_us: GPU_IDLE_US_PER_STEP,
                            gpu_busy_us: 0,
                        }],
                        // A worker op succeeds unless its arguments name "/bad".
                        op_results: plan
                            .ops
                            .iter()
                            .map(|op| {
                                let bad = String::from_utf8_lossy(&op.args).contains("/bad");
                                tokenspeed_engine::OpOutcome {
                                    ok: !bad,
                                    message: if bad { b"refused".to_vec() } else { Vec::new() },
                                }
                            })
                            .collect(),
                        ..Default::default()
                    })
                    .is_err()
                {
                    return;
                }
            }
        });
        ScriptedWorker {
            plans: plan_tx,
            results: res_rx,
            dead,
            log,
            in_flight: 0,
            panic_after: None,
            sent: 0,
        }
    }
}

impl WorkerLink for ScriptedWorker {
    fn send_plan(&mut self, plan: &Plan) -> Result<(), LinkError> {
        self.check_alive()?;
        self.sent += 1;
        if self.panic_after.is_some_and(|n| self.sent > n) {
            panic!("test hook: the engine thread panics");
        }
        self.in_flight += 1;
        self.log
            .max_in_flight
            .fetch_max(self.in_flight, Ordering::Relaxed);
        if let Ok(mut sent) = self.log.sent_at.lock() {
            sent.insert(plan.step_id, Instant::now());
        }
        self.plans
            .send(plan.clone())
            .map_err(|e| LinkError::Channel(e.to_string()))
    }
    fn recv_result(&mut self, timeout: Duration) -> Result<Option<StepResult>, LinkError> {
        if self.dead.load(Ordering::Acquire) {
            return Ok(None);
        }
        match self.results.recv_timeout(timeout) {
            Ok(r) => {
                self.in_flight -= 1;
                Ok(Some(r))
            }
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

struct Harness {
    state: AppState,
    dead: Arc<AtomicBool>,
    answer: String,
    log: Arc<WorkerLog>,
}

/// The scripted answer: " Paris is the capital." then EOS. Overlap scheduling on (the default).
fn harness(api_key: Option<&str>) -> Harness {
    harness_with(api_key, false)
}

fn harness_with(api_key: Option<&str>, disable_overlap_schedule: bool) -> Harness {
    harness_opts(api_key, disable_overlap_schedule, false, None)
}

fn harness_opts(
    api_key: Option<&str>,
    disable_overlap_schedule: bool,
    enable_metrics: bool,
    panic_after: Option<usize>,
) -> Harness {
    harness_from(HarnessOpts {
        api_key,
        disable_overlap_schedule,
        enable_metrics,
        panic_after,
        ..Default::default()
    })
}

fn harness_grammar(
    api_key: Option<&str>,
    disable_overlap_schedule: bool,
    enable_metrics: bool,
    panic_after: Option<usize>,
    grammar_backend: Option<&str>,
) -> Harness {
    harness_from(HarnessOpts {
        api_key,
        disable_overlap_schedule,
        enable_metrics,
        panic_after,
        grammar_backend,
        ..Default::default()
    })
}

#[derive(Default)]
struct HarnessOpts<'a> {
    api_key: Option<&'a str>,
    disable_overlap_schedule: bool,
    enable_metrics: bool,
    panic_after: Option<usize>,
    grammar_backend: Option<&'a str>,
    /// `--schedule-lead-ms`.
    schedule_lead_ms: f64,
    /// How long the scripted worker takes per step.
    step_time: Duration,
    /// `--max-running-requests` (0: the harness's 16).
    max_running_requests: u32,
}

fn harness_from(o: HarnessOpts) -> Harness {
    let HarnessOpts {
        api_key,
        disable_overlap_schedule,
        enable_metrics,
        panic_after,
        grammar_backend,
        schedule_lead_ms,
        step_time,
        max_running_requests,
    } = o;
    let dir = smollm2_dir();
    let tok = TextTokenizer::from_dir(&dir, None).expect("tokenizer");
    let answer = " Paris is the capital.".to_string();
    let mut script = tok.encode(&answer, false).expect("encode");
    script.push(tok.eos_token_ids()[0]);
    let dead = Arc::new(AtomicBool::new(false));
    let config = ServerConfig {
        api_key: api_key.map(str::to_string),
        scheduler: SchedulerConfig {
            max_running_requests: if max_running_requests == 0 {
                16
            } else {
                max_running_requests
            },
            chunked_prefill_size: 64,
            max_prefill_tokens: 64,
            context_length: 256,
            ..common::scheduler_config()
        },
        disable_overlap_schedule,
        schedule_lead_ms,
        enable_metrics,
        grammar_backend: grammar_backend.map(str::to_string),
        ..common::server_config()
    };
    let log = Arc::new(WorkerLog::default());
    let mut link = Box::new(ScriptedWorker::start(
        script,
        dead.clone(),
        log.clone(),
        step_time,
    ));
    link.panic_after = panic_after;
    let state = build_state(config, link).expect("state");
    Harness {
        state,
        dead,
        answer,
        log,
    }
}

async fn call(
    state: &AppState,
    method: &str,
    path: &str,
    body: Option<&str>,
    key: Option<&str>,
) -> (StatusCode, String) {
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let req = req
        .body(
            body.map(|b| Body::from(b.to_string()))
                .unwrap_or_else(Body::empty),
        )
        .expect("request");
    let resp = router(state.clone()).oneshot(req).await.expect("response");
    let status = resp.status();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

fn json_of(s: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
}

#[tokio::test]
async fn completion_returns_the_scripted_answer_and_stops_at_eos() {
    let h = harness(None);
    let (status, body) = call(
        &h.state,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "The capital of France is", "max_tokens": 50}"#),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let v = json_of(&body);
    assert_eq!(v["choices"][0]["text"], h.answer);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["object"], "text_completion");
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap_or(0) > 0);
}

#[tokio::test]
async fn overlap_keeps_two_plans_in_flight_and_off_keeps_one() {
    for disable in [false, true] {
        let h = harness_with(None, disable);
        let (status, body) = call(
            &h.state,
            "POST",
            "/v1/completions",
            Some(r#"{"prompt": "The capital of France is", "max_tokens": 50}"#),
            None,
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let v = json_of(&body);
        assert_eq!(v["choices"][0]["text"], h.answer, "overlap off: {disable}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        let (max_in_flight, placeholders) = (
            h.log.max_in_flight.load(Ordering::Relaxed),
            h.log.placeholders.load(Ordering::Relaxed),
        );
        if disable {
            assert_eq!((max_in_flight, placeholders), (1, 0));
        } else {
            assert_eq!(max_in_flight, 2);
            assert!(
                placeholders > 0,
                "decodes planned before their input came back"
            );
        }
        // The EOS found one step late cost a decode, but no page.
        let (_, b) = call(&h.state, "POST", "/flush_cache", None, None).await;
        let (_, b2) = call(&h.state, "GET", "/get_server_info", None, None).await;
        let kv = &json_of(&b2)["kv_pages"];
        assert_eq!(kv["free"], kv["total"], "{b} {b2}");
    }
}

/// Per decode step N+1: how long before step N finished the engine sent its plan (the last
/// `n` steps of a run).
fn plan_slack(log: &WorkerLog, n: usize) -> Vec<i128> {
    let (sent, done) = (
        log.sent_at.lock().expect("log"),
        log.done_at.lock().expect("log"),
    );
    let mut steps: Vec<u64> = sent.keys().copied().collect();
    steps.sort_unstable();
    let slack: Vec<i128> = steps
        .iter()
        .filter_map(|s| {
            let (d, t) = (done.get(&s.checked_sub(1)?)?, sent.get(s)?);
            Some(if d >= t {
                d.duration_since(*t).as_millis() as i128
            } else {
                -(t.duration_since(*d).as_millis() as i128)
            })
        })
        .collect();
    slack[slack.len().saturating_sub(n)..].to_vec()
}

#[tokio::test]
async fn a_schedule_lead_sends_the_next_decode_plan_shortly_before_the_running_step_ends() {
    // Steps of 40 ms: without a lead each plan goes out as the step before it starts (~40 ms
    // ahead); with 10 ms, once the decode step time is known, ~10 ms ahead, so a request that
    // arrives in the 30 ms between joins the very next step.
    for lead in [0.0, 10.0] {
        let h = harness_from(HarnessOpts {
            schedule_lead_ms: lead,
            step_time: Duration::from_millis(40),
            ..Default::default()
        });
        let body =
            r#"{"prompt": "The capital of France is", "max_tokens": 14, "ignore_eos": true}"#;
        let (status, text) = call(&h.state, "POST", "/v1/completions", Some(body), None).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        assert_eq!(json_of(&text)["usage"]["completion_tokens"], 14);
        let mut slack = plan_slack(&h.log, 6);
        slack.sort_unstable();
        let median = slack[slack.len() / 2];
        if lead == 0.0 {
            assert!(median >= 30, "lead 0: plans ~40 ms ahead, got {slack:?} ms");
        } else {
            assert!(
                (0..=25).contains(&median),
                "lead 10: plans ~10 ms ahead, got {slack:?} ms"
            );
        }
        assert_eq!(h.log.max_in_flight.load(Ordering::Relaxed), 2);
    }
}

#[tokio::test]
async fn no_lead_while_prompts_wait_to_be_computed() {
    // One request runs at a time: while the first decodes, the second waits in the queue. Its
    // prompt work makes the next step due at once, so the engine holds no plan for the lead
    // (that would only leave the worker less time to launch a step behind the running one).
    let h = harness_from(HarnessOpts {
        schedule_lead_ms: 10.0,
        step_time: Duration::from_millis(40),
        max_running_requests: 1,
        ..Default::default()
    });
    let body = r#"{"prompt": "The capital of France is", "max_tokens": 14, "ignore_eos": true}"#;
    let (first, second) = tokio::join!(
        call(&h.state, "POST", "/v1/completions", Some(body), None),
        async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            call(&h.state, "POST", "/v1/completions", Some(body), None).await
        }
    );
    assert_eq!(first.0, StatusCode::OK, "{}", first.1);
    assert_eq!(second.0, StatusCode::OK, "{}", second.1);
    // The first request's decode plans after the second arrived, then the second's own
    // decodes (nothing waits by then: the lead holds again).
    let slack = plan_slack(&h.log, 28);
    let waiting = &slack[4..12];
    assert!(
        waiting.iter().all(|&s| s >= 30),
        "plans ~40 ms ahead while a prompt waits: {slack:?} ms"
    );
    let mut alone = slack[slack.len() - 6..].to_vec();
    alone.sort_unstable();
    assert!(
        (0..=25).contains(&alone[alone.len() / 2]),
        "lead 10 once nothing waits: {slack:?} ms"
    );
}

#[tokio::test]
async fn max_tokens_cuts_with_length() {
    let h = harness(None);
    let (_, body) = call(
        &h.state,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "x", "max_tokens": 2}"#),
        None,
    )
    .await;
    let v = json_of(&body);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 2);
}

#[tokio::test]
async fn stop_string_is_held_back_and_cut() {
    let h = harness(None);
    let (_, body) = call(
        &h.state,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "x", "max_tokens": 50, "stop": ["the cap"]}"#),
        None,
    )
    .await;
    let v = json_of(&body);
    assert_eq!(v["choices"][0]["text"], " Paris is ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn chat_stream_is_sse_ending_in_done() {
    let h = harness(None);
    let body =
        r#"{"messages": [{"role": "user", "content": "Capital of France?"}], "stream": true}"#;
    let (status, text) = call(&h.state, "POST", "/v1/chat/completions", Some(body), None).await;
    assert_eq!(status, StatusCode::OK);
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let mut content = String::new();
    let mut finish = Value::Null;
    for e in &events[..events.len() - 1] {
        let v = json_of(e);
        assert_eq!(v["object"], "chat.completion.chunk");
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            content.push_str(c);
        }
        if !v["choices"][0]["finish_reason"].is_null() {
            finish = v["choices"][0]["finish_reason"].clone();
        }
    }
    assert_eq!(content, h.answer);
    assert_eq!(finish, "stop");
}

#[tokio::test]
async fn repeated_prompt_reports_cached_tokens() {
    let h = harness(None);
    let body = r#"{"prompt": "one two three four five six seven eight nine ten eleven twelve", "max_tokens": 3}"#;
    let (_, first) = call(&h.state, "POST", "/v1/completions", Some(body), None).await;
    let (_, second) = call(&h.state, "POST", "/v1/completions", Some(body), None).await;
    let (a, b) = (json_of(&first), json_of(&second));
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(cached >= 8, "{b}");
}

#[tokio::test]
async fn bad_input_gets_openai_errors() {
    let h = harness(None);
    for (path, body, status, param) in [
        (
            "/v1/completions",
            "{oops",
            StatusCode::BAD_REQUEST,
            Value::Null,
        ),
        (
            "/v1/completions",
            r#"{"max_tokens": 3}"#,
            StatusCode::BAD_REQUEST,
            json!("prompt"),
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "top_p": "high"}"#,
            StatusCode::BAD_REQUEST,
            json!("top_p"),
        ),
        (
            "/v1/completions",
            "[1, 2]",
            StatusCode::BAD_REQUEST,
            Value::Null,
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "temperature": -1}"#,
            StatusCode::BAD_REQUEST,
            json!("temperature"),
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "model": "gpt-9"}"#,
            StatusCode::NOT_FOUND,
            json!("model"),
        ),
        (
            "/v1/completions",
            r#"{"prompt": "x", "max_tokens": 9999}"#,
            StatusCode::BAD_REQUEST,
            json!("max_tokens"),
        ),
        (
            "/v1/completions",
            r#"{"prompt": [999999]}"#,
            StatusCode::BAD_REQUEST,
            json!("prompt"),
        ),
        (
            "/v1/chat/completions",
            r#"{"messages": []}"#,
            StatusCode::BAD_REQUEST,
            json!("messages"),
        ),
        (
            "/generate",
            r#"{"sampling_params": {}}"#,
            StatusCode::BAD_REQUEST,
            Value::Null,
        ),
    ] {
        let (s, b) = call(&h.state, "POST", path, Some(body), None).await;
        assert_eq!(s, status, "{path} {body}: {b}");
        let v = json_of(&b);
        assert_eq!(v["error"]["param"], param, "{b}");
        assert_eq!(v["error"]["code"], status.as_u16());
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
    let (s, b) = call(&h.state, "POST", "/v1/completions", Some(r#"{"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115, 116, 117, 118, 119, 120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 130, 131, 132, 133, 134, 135, 136, 137, 138, 139, 140, 141, 142, 143, 144, 145, 146, 147, 148, 149, 150, 151, 152, 153, 154, 155, 156, 157, 158, 159, 160, 161, 162, 163, 164, 165, 166, 167, 168, 169, 170, 171, 172, 173, 174, 175, 176, 177, 178, 179, 180, 181, 182, 183, 184, 185, 186, 187, 188, 189, 190, 191, 192, 193, 194, 195, 196, 197, 198, 199, 200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 211, 212, 213, 214, 215, 216, 217, 218, 219, 220, 221, 222, 223, 224, 225, 226, 227, 228, 229, 230, 231, 232, 233, 234, 235, 236, 237, 238, 239, 240, 241, 242, 243, 244, 245, 246, 247, 248, 249, 250, 251, 252, 253, 254, 255, 256, 257]}"#), None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(b.contains("257") && b.contains("256"), "{b}");
}

#[tokio::test]
async fn api_key_is_enforced_except_on_health() {
    let h = harness(Some("sekret"));
    let (s, b) = call(&h.state, "GET", "/v1/models", None, None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "{b}");
    assert_eq!(json_of(&b)["error"]["type"], "authentication_error");
    let (s, _) = call(&h.state, "GET", "/v1/models", None, Some("sekret")).await;
    assert_eq!(s, StatusCode::OK);
    let (s, _) = call(&h.state, "GET", "/health", None, None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, b) = call(&h.state, "GET", "/health_generate", None, Some("sekret")).await;
    assert_eq!(s, StatusCode::OK, "{b}");
}

#[tokio::test]
async fn native_generate_and_tokenize_round_trip() {
    let h = harness(None);
    let (s, b) = call(
        &h.state,
        "POST",
        "/tokenize",
        Some(r#"{"prompt": "Hello world"}"#),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let ids = json_of(&b)["tokens"].clone();
    let (_, b) = call(
        &h.state,
        "POST",
        "/detokenize",
        Some(&json!({"tokens": ids}).to_string()),
        None,
    )
    .await;
    assert_eq!(json_of(&b)["text"], "Hello world");
    let (s, b) = call(
        &h.state,
        "POST",
        "/generate",
        Some(&json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 4}}).to_string()),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let v = json_of(&b);
    assert_eq!(v["output_ids"].as_array().map(Vec::len), Some(4));
    assert_eq!(v["meta_info"]["finish_reason"]["type"], "length");
}

#[tokio::test]
async fn pages_are_all_free_after_requests_and_flush() {
    let h = harness(None);
    for _ in 0..3 {
        call(
            &h.state,
            "POST",
            "/v1/completions",
            Some(r#"{"prompt": "a b c d e f g h i j", "max_tokens": 5}"#),
            None,
        )
        .await;
    }
    let (s, _) = call(&h.state, "POST", "/flush_cache", None, None).await;
    assert_eq!(s, StatusCode::OK);
    let (_, b) = call(&h.state, "GET", "/get_server_info", None, None).await;
    let kv = &json_of(&b)["kv_pages"];
    assert_eq!(kv["free"], kv["total"], "{b}");
    assert_eq!(kv["total"], 512);
}

#[tokio::test]
async fn dead_worker_fails_health_and_requests() {
    let h = harness(None);
    h.dead.store(true, Ordering::Release);
    let (s, b) = call(
        &h.state,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "x", "max_tokens": 5}"#),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{b}");
    assert!(json_of(&b)["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("worker"));
    let (s, _) = call(&h.state, "GET", "/health", None, None).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn an_engine_thread_panic_fails_health_and_every_request() {
    let h = harness_opts(None, false, false, Some(2));
    let body = r#"{"prompt": "The capital of France is", "max_tokens": 50}"#;
    let (status, text) = call(&h.state, "POST", "/v1/completions", Some(body), None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
    assert!(text.contains("engine failed"), "{text}");
    let (status, _) = call(&h.state, "GET", "/health", None, None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let (status, text) = call(&h.state, "POST", "/v1/completions", Some(body), None).await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "later requests fail too: {text}"
    );
}

#[tokio::test]
async fn metrics_route_exists_only_with_enable_metrics() {
    let off = harness_opts(None, false, false, None);
    let (status, _) = call(&off.state, "GET", "/metrics", None, None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let on = harness_opts(None, false, true, None);
    let (status, text) = call(&on.state, "GET", "/metrics", None, None).await;
    assert_eq!(status, StatusCode::OK);
    assert!(text.contains("tokenspeed"), "{text}");
}

#[tokio::test]
async fn stop_token_ids_are_honoured_with_ignore_eos() {
    let h = harness(None);
    let tok = &h.state.tokenizer;
    let is = tok.encode(" is", false).expect("encode")[0];
    let body = format!(
        r#"{{"prompt": "The capital of France is", "max_tokens": 40, "ignore_eos": true,
            "stop_token_ids": [{is}]}}"#
    );
    let (status, text) = call(&h.state, "POST", "/v1/completions", Some(&body), None).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v = json_of(&text);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["matched_stop"], is);
    assert_eq!(v["choices"][0]["text"], " Paris is");
}

#[tokio::test]
async fn min_tokens_holds_off_eos_on_every_route() {
    let h = harness(None);
    let script_len = h
        .state
        .tokenizer
        .encode(&h.answer, false)
        .expect("encode")
        .len()
        + 1;
    let min = script_len as u32 + 3;
    for (path, body) in [
        (
            "/v1/completions",
            format!(r#"{{"prompt": "Hi", "max_tokens": 40, "min_tokens": {min}}}"#),
        ),
        (
            "/v1/chat/completions",
            format!(
                r#"{{"messages": [{{"role": "user", "content": "Hi"}}], "max_tokens": 40,
                    "min_tokens": {min}}}"#
            ),
        ),
        (
            "/generate",
            format!(
                r#"{{"text": "Hi", "sampling_params": {{"max_new_tokens": 40,
                    "min_new_tokens": {min}}}}}"#
            ),
        ),
    ] {
        let (status, text) = call(&h.state, "POST", path, Some(&body), None).await;
        assert_eq!(status, StatusCode::OK, "{path}: {text}");
        let v = json_of(&text);
        let usage = if path == "/generate" {
            &v["meta_info"]
        } else {
            &v["usage"]
        };
        let n = usage["completion_tokens"].as_u64().unwrap_or(0);
        assert!(
            n >= u64::from(min),
            "{path}: {n} tokens < min_tokens {min}: {text}"
        );
    }
}

#[tokio::test]
async fn native_generate_returns_logprobs_when_asked() {
    let h = harness(None);
    let body = r#"{"text": "Hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                   "return_logprob": true, "top_logprobs_num": 2}"#;
    let (status, text) = call(&h.state, "POST", "/generate", Some(body), None).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v = json_of(&text);
    let lps = v["meta_info"]["output_token_logprobs"]
        .as_array()
        .expect("logprobs");
    assert_eq!(lps.len(), 4);
    assert_eq!(lps[0][0], -0.5);
    assert_eq!(lps[0][1], v["output_ids"][0]);
    assert_eq!(
        v["meta_info"]["output_top_logprobs"]
            .as_array()
            .map(Vec::len),
        Some(4)
    );
    let (_, plain) = call(
        &h.state,
        "POST",
        "/generate",
        Some(r#"{"text": "Hi"}"#),
        None,
    )
    .await;
    assert!(json_of(&plain)["meta_info"]
        .get("output_token_logprobs")
        .is_none());
}

#[tokio::test]
async fn server_info_reports_engine_busy_stalled_and_gpu_idle_time() {
    let h = harness(None);
    let started = std::time::Instant::now();
    let (s, b) = call(
        &h.state,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "x", "max_tokens": 6}"#),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    // The engine publishes its counters just after routing the last token: wait for them.
    let mut b = String::new();
    for _ in 0..200 {
        b = call(&h.state, "GET", "/get_server_info", None, None)
            .await
            .1;
        if json_of(&b)["engine"]["steps"].as_f64().unwrap_or(0.0) >= 6.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let engine = &json_of(&b)["engine"];
    let busy = engine["busy_s"].as_f64().unwrap_or(-1.0);
    let stalled = engine["stalled_s"].as_f64().unwrap_or(-1.0);
    // Six steps ran, each with its plan in flight for a while; nothing is booked twice.
    assert!(busy > 0.0, "{b}");
    assert!(stalled >= 0.0, "{b}");
    assert!(
        busy + stalled <= started.elapsed().as_secs_f64() + 1.0,
        "{b}"
    );
    // The worker's own GPU idle count is the sum of what its results reported.
    let steps = engine["steps"].as_f64().unwrap_or(-1.0);
    let gpu_idle = engine["gpu_idle_s"].as_f64().unwrap_or(-1.0);
    assert!(steps >= 6.0, "{b}");
    assert!(
        (gpu_idle - steps * f64::from(GPU_IDLE_US_PER_STEP) * 1e-6).abs() < 1e-9,
        "{b}"
    );
}

#[tokio::test]
async fn grammar_masks_reach_the_worker_and_the_grammar_ends_the_request() {
    for disable_overlap in [false, true] {
        let h = harness_grammar(None, disable_overlap, false, None, Some("llguidance"));
        let (status, body) = call(
            &h.state,
            "POST",
            "/v1/completions",
            Some(r#"{"prompt": "Digits:", "max_tokens": 20, "guided_regex": "[0-9]{4}"}"#),
            None,
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let v = json_of(&body);
        let text = v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(
            text.len() == 4 && text.chars().all(|c| c.is_ascii_digit()),
            "{text:?}"
        );
        assert_eq!(
            v["choices"][0]["finish_reason"], "stop",
            "the grammar ended it"
        );
        assert!(
            v["choices"][0]["matched_stop"].is_null(),
            "no stop was matched"
        );
        let completed = h.log.masks_completed.load(Ordering::Relaxed);
        let in_plan = h.log.masks_in_plan.load(Ordering::Relaxed);
        // The first token's mask rides in the prefill plan; with overlap, later ones follow as
        // completions of plans sent one step ahead; without, every mask rides in its plan.
        assert!(in_plan >= 1, "in plan {in_plan}");
        if disable_overlap {
            assert_eq!(completed, 0);
        } else {
            assert!(completed >= 2, "completed {completed}");
        }
        // An unconstrained request on the same server is untouched.
        let (_, body) = call(
            &h.state,
            "POST",
            "/v1/completions",
            Some(r#"{"prompt": "The capital of France is", "max_tokens": 50}"#),
            None,
        )
        .await;
        assert_eq!(json_of(&body)["choices"][0]["text"], h.answer);
    }
}

#[tokio::test]
async fn with_xgrammar_the_grammar_travels_once_at_admission_and_no_mask_is_sent() {
    let h = harness_grammar(None, false, false, None, Some("xgrammar"));
    let (status, body) = call(
        &h.state,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "Digits:", "max_tokens": 50, "guided_regex": "[0-9]{4}"}"#),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // The scripted worker enforces nothing: the request runs to its scripted eos ("stop"), and
    // the engine neither masks nor ends it at the grammar's end (the worker's matcher would).
    let v = json_of(&body);
    assert_eq!(v["choices"][0]["text"], h.answer);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(h.log.masks_in_plan.load(Ordering::Relaxed), 0);
    assert_eq!(h.log.masks_completed.load(Ordering::Relaxed), 0);
    let rows = h.log.grammar_rows.lock().expect("log").clone();
    assert_eq!(rows.len(), 1, "{rows:?}");
    let (admitted, row) = &rows[0];
    assert!(
        admitted,
        "sent with the plan that gives the request its slot"
    );
    assert_eq!(row.kind, tokenspeed_engine::grammar_kind::REGEX);
    assert_eq!(row.text, b"[0-9]{4}");
    assert_eq!(row.starts_after, -1);
    assert!(row.generated.is_empty());
    let tok = TextTokenizer::from_dir(&smollm2_dir(), None).expect("tokenizer");
    assert_eq!(row.stop_ids, tok.eos_token_ids());
    // Invalid grammars are the llguidance backend's 400s.
    let (status, body) = call(
        &h.state,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "x", "max_tokens": 3, "guided_regex": "(unclosed"}"#),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(json_of(&body)["error"]["param"], "guided_regex");
}

#[tokio::test]
async fn structured_output_is_refused_when_the_grammar_backend_is_none() {
    let h = harness(None);
    let (status, body) = call(
        &h.state,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "x", "max_tokens": 3, "guided_regex": "[0-9]"}"#),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let v = json_of(&body);
    assert_eq!(v["error"]["param"], "guided_regex");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .contains("--grammar-backend none"));
}

/// With a reasoning model, the grammar starts after the think-end token: the reasoning is
/// sampled freely (here the script's first tokens), the answer under the grammar.
#[tokio::test]
async fn a_grammar_that_starts_after_the_reasoning_leaves_the_reasoning_free() {
    use tokenspeed_engine::scheduler::FinishReason;
    use tokenspeed_engine::SamplingParams;
    use tokenspeed_server::engine::{Constraint, EngineEvent};
    use tokenspeed_structured::GrammarSpec;

    for disable_overlap in [false, true] {
        let h = harness_grammar(None, disable_overlap, false, None, Some("llguidance"));
        let tok = &h.state.tokenizer;
        let script = tok.encode(&h.answer, false).expect("encode");
        // Stand-in for `</think>`: the script's third token ends the reasoning.
        let think_end = script[2];
        let grammar = h
            .state
            .grammar
            .as_ref()
            .expect("llguidance")
            .compile(&GrammarSpec::Regex("[0-9]{2}".into()))
            .expect("compiles");
        let request = tokenspeed_engine::Request {
            id: tokenspeed_server::generate::new_request_id(),
            prompt: tok.encode("Think, then answer:", true).expect("encode"),
            sampling: SamplingParams::greedy(),
            max_new_tokens: 20,
            ..Default::default()
        };
        let (_, mut events) = h.state.engine.submit(
            request,
            Some(Constraint {
                grammar,
                starts_after: Some(think_end),
                worker: None,
            }),
        );
        let mut tokens = Vec::new();
        let finish = loop {
            match events.recv().await.expect("an event") {
                EngineEvent::Token(t) => {
                    tokens.extend(t.tokens);
                    if let Some(f) = t.finish {
                        break f;
                    }
                }
                EngineEvent::Error { message, .. } => panic!("{message}"),
            }
        };
        assert_eq!(
            &tokens[..3],
            &script[..3],
            "the reasoning is the script's, unmasked"
        );
        let answer = tok.decode(&tokens[3..], false).expect("decode");
        assert!(
            answer.len() == 2 && answer.chars().all(|c| c.is_ascii_digit()),
            "{answer:?} (overlap off: {disable_overlap})"
        );
        assert_eq!(finish, FinishReason::Complete);
    }
}

#[tokio::test]
async fn chat_continuous_usage_reaches_every_chunk_the_role_chunk_too() {
    // vLLM's: the role chunk carries the prompt's usage (no completion tokens, no details).
    let h = harness(None);
    let body = r#"{"messages": [{"role": "user", "content": "Capital of France?"}], "stream": true,
        "stream_options": {"include_usage": true, "continuous_usage_stats": true}}"#;
    let (status, text) = call(&h.state, "POST", "/v1/chat/completions", Some(body), None).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let chunks: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .map(json_of)
        .collect();
    let (last, with_choices) = chunks.split_last().expect("chunks");
    let prompt = last["usage"]["prompt_tokens"]
        .as_u64()
        .expect("final usage");
    let first = &with_choices[0];
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(
        first["usage"],
        serde_json::json!({"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt})
    );
    let counts: Vec<u64> = with_choices
        .iter()
        .map(|c| {
            assert_eq!(c["usage"]["prompt_tokens"], prompt, "{c}");
            c["usage"]["completion_tokens"]
                .as_u64()
                .expect("usage on every chunk")
        })
        .collect();
    assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{counts:?}");
    assert_eq!(
        counts.last().copied(),
        last["usage"]["completion_tokens"].as_u64()
    );
}

#[tokio::test]
async fn priority_is_refused_unless_neutral_without_priority_scheduling() {
    let h = harness(None);
    for (path, body) in [
        ("/v1/completions", json!({"prompt": "x", "max_tokens": 2})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
        ),
        (
            "/generate",
            json!({"text": "x", "sampling_params": {"max_new_tokens": 2}}),
        ),
    ] {
        for (priority, status) in [
            (json!(0), StatusCode::OK),
            (Value::Null, StatusCode::OK),
            (json!(3), StatusCode::BAD_REQUEST),
            (json!(-1), StatusCode::BAD_REQUEST),
        ] {
            let mut body = body.clone();
            body["priority"] = priority.clone();
            let (s, b) = call(&h.state, "POST", path, Some(&body.to_string()), None).await;
            assert_eq!(s, status, "{path} priority {priority}: {b}");
            if status == StatusCode::BAD_REQUEST {
                let v = json_of(&b);
                assert_eq!(v["error"]["param"], "priority", "{b}");
                assert!(b.contains("--enable-priority-scheduling"), "{b}");
            }
        }
    }
}

#[tokio::test]
async fn unimplemented_fields_at_their_neutral_value_are_accepted() {
    // SGLang's router spells out `"return_hidden_states": false` on every request it forwards.
    let h = harness(None);
    let body = r#"{"prompt": "x", "max_tokens": 2, "return_hidden_states": false}"#;
    let (s, b) = call(&h.state, "POST", "/v1/completions", Some(body), None).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let body = r#"{"prompt": "x", "max_tokens": 2, "return_hidden_states": true}"#;
    let (s, b) = call(&h.state, "POST", "/v1/completions", Some(body), None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    assert_eq!(json_of(&b)["error"]["param"], "return_hidden_states");
}

#[tokio::test]
async fn pause_in_place_holds_requests_until_continue() {
    let h = harness(None);
    let (s, b) = call(
        &h.state,
        "POST",
        "/pause_generation",
        Some(r#"{"mode": "in_place"}"#),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let state = h.state.clone();
    let pending = tokio::spawn(async move {
        let body = r#"{"prompt": "The capital of France is", "max_tokens": 4}"#;
        call(&state, "POST", "/v1/completions", Some(body), None).await
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!pending.is_finished(), "a paused engine must not generate");
    let (s, _) = call(&h.state, "POST", "/continue_generation", None, None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, b) = tokio::time::timeout(Duration::from_secs(20), pending)
        .await
        .expect("continues")
        .expect("task");
    assert_eq!(s, StatusCode::OK, "{b}");
    assert_eq!(json_of(&b)["usage"]["completion_tokens"], 4);
}

#[tokio::test]
async fn pause_in_abort_mode_ends_in_flight_requests_and_later_ones_wait() {
    let h = harness(None);
    let (s, _) = call(
        &h.state,
        "POST",
        "/pause_generation",
        Some(r#"{"mode": "in_place"}"#),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let state = h.state.clone();
    let held = tokio::spawn(async move {
        let body = r#"{"prompt": "x", "max_tokens": 4}"#;
        call(&state, "POST", "/v1/completions", Some(body), None).await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The default mode aborts what is in flight, as SGLang's does.
    let (s, b) = call(&h.state, "POST", "/pause_generation", None, None).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    let (s, b) = tokio::time::timeout(Duration::from_secs(20), held)
        .await
        .expect("ended")
        .expect("task");
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{b}");
    assert!(b.contains("paused"), "{b}");
    for bad in [r#"{"mode": "retract"}"#, r#"{"mode": "later"}"#] {
        let (s, b) = call(&h.state, "POST", "/pause_generation", Some(bad), None).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
        assert_eq!(json_of(&b)["error"]["param"], "mode");
    }
    let (s, _) = call(&h.state, "POST", "/continue_generation", None, None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, b) = call(
        &h.state,
        "POST",
        "/v1/completions",
        Some(r#"{"prompt": "x", "max_tokens": 2}"#),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
}

#[tokio::test]
async fn weight_version_is_reported_by_model_info_and_every_generate_answer() {
    let h = harness(None);
    let (s, b) = call(&h.state, "GET", "/get_weight_version", None, None).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    assert_eq!(json_of(&b)["weight_version"], "default");
    let (_, b) = call(&h.state, "GET", "/get_model_info", None, None).await;
    assert_eq!(json_of(&b)["weight_version"], "default");
    let body = r#"{"text": "x", "sampling_params": {"max_new_tokens": 2}}"#;
    let (s, b) = call(&h.state, "POST", "/generate", Some(body), None).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    assert_eq!(json_of(&b)["meta_info"]["weight_version"], "default");
}

#[tokio::test]
async fn weight_updates_and_memory_release_wait_for_running_requests_and_report() {
    let h = harness(None);
    let state = h.state.clone();
    let running = tokio::spawn(async move {
        let body = r#"{"prompt": "The capital of France is", "max_tokens": 16}"#;
        call(&state, "POST", "/v1/completions", Some(body), None).await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let body = r#"{"model_path": "/new", "weight_version": "v2"}"#;
    let (s, b) = call(
        &h.state,
        "POST",
        "/update_weights_from_disk",
        Some(body),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    assert_eq!(json_of(&b)["success"], true);
    let (s, b) = running.await.expect("task");
    assert_eq!(s, StatusCode::OK, "{b}");
    assert!(
        json_of(&b)["choices"][0]["finish_reason"].is_string(),
        "it ran to its end: {b}"
    );
    let (_, b) = call(&h.state, "GET", "/get_weight_version", None, None).await;
    assert_eq!(json_of(&b)["weight_version"], "v2");
    let body = r#"{"model_path": "/bad", "weight_version": "v3"}"#;
    let (s, b) = call(
        &h.state,
        "POST",
        "/update_weights_from_disk",
        Some(body),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    assert_eq!(json_of(&b)["success"], false);
    let (_, b) = call(&h.state, "GET", "/get_weight_version", None, None).await;
    assert_eq!(
        json_of(&b)["weight_version"],
        "v2",
        "a failed update keeps the label"
    );
    let bad = r#"{"model_path": "/new", "flush_cache": false}"#;
    let (s, _) = call(
        &h.state,
        "POST",
        "/update_weights_from_disk",
        Some(bad),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);

    let (s, b) = call(&h.state, "POST", "/release_memory_occupation", None, None).await;
    assert_eq!(
        (s, json_of(&b)["success"].clone()),
        (StatusCode::OK, json!(true))
    );
    let state = h.state.clone();
    let held = tokio::spawn(async move {
        let body = r#"{"prompt": "x", "max_tokens": 2}"#;
        call(&state, "POST", "/v1/completions", Some(body), None).await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !held.is_finished(),
        "nothing runs while the memory is released"
    );
    let (s, _) = call(
        &h.state,
        "POST",
        "/update_weights_from_disk",
        Some(r#"{"model_path": "/x"}"#),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "no update while released");
    let (s, _) = call(&h.state, "POST", "/resume_memory_occupation", None, None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, b) = tokio::time::timeout(Duration::from_secs(20), held)
        .await
        .expect("runs after the resume")
        .expect("task");
    assert_eq!(s, StatusCode::OK, "{b}");
    let (s, _) = call(&h.state, "POST", "/resume_memory_occupation", None, None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "not released");
}
