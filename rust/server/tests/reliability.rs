//! The HTTP layer's refusals and the engine's failure paths, against a worker that takes plans
//! and never answers (every request stays in flight until something ends it): 429 with
//! Retry-After once max_running + max_queued requests are in flight, 413 over the body limit,
//! the API key on every route but /health and /ping, 503 while draining, and the
//! watchdog failing the engine (and waking `EngineHandle::failed`).

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::Value;
use tokenspeed_engine::SchedulerConfig;
use tokenspeed_engine::{Plan, StepResult};
use tokenspeed_server::engine::{LinkError, WorkerLink};
use tokenspeed_server::http::{router, AppState};
use tokenspeed_server::{build_state, ServerConfig};
use tower::ServiceExt;

mod common;

/// Takes every plan, never answers: a hung worker.
struct SilentWorker;

impl WorkerLink for SilentWorker {
    fn send_plan(&mut self, _plan: &Plan) -> Result<(), LinkError> {
        Ok(())
    }
    fn recv_result(&mut self, timeout: Duration) -> Result<Option<StepResult>, LinkError> {
        std::thread::sleep(timeout);
        Ok(None)
    }
    fn check_alive(&mut self) -> Result<(), LinkError> {
        Ok(())
    }
}

const KEY: &str = "sk-test-key";

fn state(watchdog_timeout: f64) -> AppState {
    let config = ServerConfig {
        api_key: Some(KEY.into()),
        scheduler: SchedulerConfig {
            num_pages: 256,
            max_running_requests: 2,
            chunked_prefill_size: 64,
            max_prefill_tokens: 64,
            context_length: 256,
            ..common::scheduler_config()
        },
        max_queued_requests: 1,
        max_request_body_bytes: 1024,
        shutdown_timeout: 1.0,
        watchdog_timeout,
        enable_metrics: true,
        ..common::server_config()
    };
    build_state(config, Box::new(SilentWorker)).expect("state")
}

fn request(method: &str, path: &str, body: Option<&str>, key: Option<&str>) -> Request<Body> {
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json");
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    req.body(
        body.map(|b| Body::from(b.to_string()))
            .unwrap_or_else(Body::empty),
    )
    .expect("request")
}

async fn send(state: &AppState, req: Request<Body>) -> (StatusCode, String, Option<String>) {
    let resp = router(state.clone()).oneshot(req).await.expect("response");
    let status = resp.status();
    let retry = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned(), retry)
}

fn error_of(body: &str) -> Value {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
    v["error"].clone()
}

const GEN: &str = r#"{"prompt": "Hello", "max_tokens": 4}"#;

async fn wait_in_flight(state: &AppState, n: usize) {
    for _ in 0..500 {
        if state.lifecycle.in_flight() == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("in flight: {} (wanted {n})", state.lifecycle.in_flight());
}

#[tokio::test]
async fn full_admission_gets_429_with_retry_after_and_gone_clients_free_their_slots() {
    let s = state(0.0);
    // max_running 2 + max_queued 1: three requests hang on the silent worker.
    let held: Vec<_> = (0..3)
        .map(|_| {
            let s = s.clone();
            tokio::spawn(async move {
                send(&s, request("POST", "/v1/completions", Some(GEN), Some(KEY))).await
            })
        })
        .collect();
    wait_in_flight(&s, 3).await;
    for path in ["/v1/completions", "/generate"] {
        let body = if path == "/generate" {
            r#"{"text": "Hello", "sampling_params": {"max_new_tokens": 4}}"#
        } else {
            GEN
        };
        let (status, text, retry) = send(&s, request("POST", path, Some(body), Some(KEY))).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{text}");
        assert_eq!(retry.as_deref(), Some("1"));
        let err = error_of(&text);
        assert!(err["message"].as_str().unwrap_or("").contains("overloaded"));
        assert_eq!(err["code"], 429);
    }
    // Non-generating routes are not counted against the limit.
    let (status, _, _) = send(&s, request("GET", "/v1/models", None, Some(KEY))).await;
    assert_eq!(status, StatusCode::OK);
    // Clients that go away release their slots (the engine loop, waiting on the silent
    // worker, cannot end them itself: abort_all is covered by the e2e drain test).
    for h in held {
        h.abort();
    }
    wait_in_flight(&s, 0).await;
}

#[tokio::test]
async fn body_over_the_limit_gets_413_declared_or_streamed() {
    let s = state(0.0);
    let big = format!(r#"{{"prompt": "{}", "max_tokens": 1}}"#, "a".repeat(2000));
    let (status, text, _) = send(
        &s,
        request("POST", "/v1/completions", Some(&big), Some(KEY)),
    )
    .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{text}");
    assert!(error_of(&text)["message"]
        .as_str()
        .unwrap_or("")
        .contains("1024"));
    // No Content-Length: counted while reading.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        (0..10).map(|_| Ok(vec![b' '; 200])).collect();
    let req = Request::builder()
        .method("POST")
        .uri("/tokenize")
        .header("authorization", format!("Bearer {KEY}"))
        .body(Body::from_stream(futures_util::stream::iter(chunks)))
        .expect("request");
    let (status, text, _) = send(&s, req).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{text}");
    // Malformed UTF-8 inside a JSON string: 400, not 500.
    let req = Request::builder()
        .method("POST")
        .uri("/tokenize")
        .header("authorization", format!("Bearer {KEY}"))
        .body(Body::from(b"{\"prompt\": \"\xff\xfe\"}".to_vec()))
        .expect("request");
    let (status, text, _) = send(&s, req).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
}

#[tokio::test]
async fn the_key_guards_every_route_but_health_ping_metrics() {
    let s = state(0.0);
    let guarded = [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/generate"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/v1/models"),
        ("GET", "/get_model_info"),
        ("GET", "/get_server_info"),
        ("GET", "/flush_cache"),
        ("POST", "/flush_cache"),
        ("GET", "/health_generate"),
    ];
    for key in [
        None,
        Some("sk-test-kez"),
        Some("sk-test-key-longer"),
        Some(""),
    ] {
        for (method, path) in guarded {
            let (status, text, _) = send(&s, request(method, path, Some("{}"), key)).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {path}: {text}");
            assert_eq!(error_of(&text)["type"], "authentication_error");
        }
    }
    for (method, path) in [
        ("GET", "/health"),
        ("GET", "/ping"),
        ("POST", "/ping"),
        ("GET", "/metrics"),
    ] {
        let (status, text, _) = send(&s, request(method, path, None, None)).await;
        assert_eq!(status, StatusCode::OK, "{method} {path}: {text}");
    }
    let (status, _, _) = send(&s, request("GET", "/v1/models", None, Some(KEY))).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn draining_refuses_new_requests_with_503_but_keeps_metrics() {
    let s = state(0.0);
    s.lifecycle.start_draining();
    for (method, path) in [
        ("POST", "/v1/completions"),
        ("GET", "/health"),
        ("GET", "/v1/models"),
    ] {
        let (status, text, _) = send(&s, request(method, path, Some(GEN), Some(KEY))).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{path}: {text}");
        assert!(text.contains("shutting down"), "{text}");
    }
    let (status, _, _) = send(&s, request("GET", "/metrics", None, None)).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn a_step_over_the_watchdog_fails_requests_and_the_engine() {
    let s = state(0.3);
    let (status, text, _) =
        send(&s, request("POST", "/v1/completions", Some(GEN), Some(KEY))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
    assert!(text.contains("watchdog"), "{text}");
    let reason = tokio::time::timeout(Duration::from_secs(5), s.engine.failed())
        .await
        .expect("failed() resolves");
    assert!(reason.contains("watchdog"), "{reason}");
    let (status, _, _) = send(&s, request("GET", "/health", None, None)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
}
