//! A chat server over a scripted worker: the worker "samples" a fixed token script, so the
//! real route, engine thread, scheduler, detokenizer and output stage see a known answer; and
//! the helpers that post to it and reassemble its streams as OpenAI clients do.

use std::collections::HashMap;
use std::sync::mpsc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tokenspeed_engine::plan::RequestEvent;
use tokenspeed_engine::{Plan, StepResult};
use tokenspeed_server::engine::{LinkError, WorkerLink};
use tokenspeed_server::http::{router, AppState};
use tower::ServiceExt;

/// Answers each plan in order: a request's n-th sampled token is script[n].
pub struct ScriptedWorker {
    plans: mpsc::Sender<Plan>,
    results: mpsc::Receiver<StepResult>,
}

impl ScriptedWorker {
    pub fn start(script: Vec<u32>) -> Self {
        let (plan_tx, plan_rx) = mpsc::channel::<Plan>();
        let (res_tx, res_rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut produced = HashMap::<u32, usize>::new();
            for plan in plan_rx {
                for f in &plan.finished {
                    produced.remove(&f.slot);
                }
                let events = plan
                    .scheduled
                    .iter()
                    .filter(|r| r.sample)
                    .map(|r| {
                        let n = produced.entry(r.slot).or_insert(0);
                        let token = script[*n % script.len()];
                        *n += 1;
                        RequestEvent {
                            slot: r.slot,
                            tokens: vec![token],
                            logprobs: vec![-0.5],
                            ..Default::default()
                        }
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
        ScriptedWorker {
            plans: plan_tx,
            results: res_rx,
        }
    }
}

impl WorkerLink for ScriptedWorker {
    fn send_plan(&mut self, plan: &Plan) -> Result<(), LinkError> {
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
        Ok(())
    }
}

pub async fn post(state: &AppState, body: &Value) -> (StatusCode, String) {
    let req = Request::builder()
        .method("POST")
        .uri("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .expect("request");
    let resp = router(state.clone()).oneshot(req).await.expect("response");
    let status = resp.status();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// A streamed chat completion reassembled into a non-streamed message, as OpenAI clients do;
/// checks the delta shapes on the way. Returns (message, finish_reason).
pub fn reassemble(sse: &str) -> (Value, Value) {
    let events: Vec<&str> = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{sse}");
    let (mut content, mut reasoning) = (String::new(), String::new());
    let mut calls: Vec<Value> = Vec::new();
    let mut finish = Value::Null;
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).expect("chunk json");
        let choice = &v["choices"][0];
        let delta = &choice["delta"];
        content.push_str(delta["content"].as_str().unwrap_or_default());
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or_default());
        for c in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = c["index"].as_u64().expect("index") as usize;
            if index == calls.len() {
                // The first delta of a call: id, type and name, OpenAI's order.
                assert!(
                    c["id"].as_str().is_some_and(|id| id.starts_with("call_")),
                    "{e}"
                );
                assert_eq!(c["type"], "function", "{e}");
                assert!(c["function"]["name"].is_string(), "{e}");
                calls.push(json!({"name": c["function"]["name"], "arguments": ""}));
            } else {
                assert!(
                    c.get("id").is_none() && c["function"].get("name").is_none(),
                    "{e}"
                );
            }
            let args = c["function"]["arguments"].as_str().unwrap_or_default();
            let slot = calls.get_mut(index).expect("a call's name comes first");
            slot["arguments"] = Value::from(format!(
                "{}{args}",
                slot["arguments"].as_str().unwrap_or_default()
            ));
        }
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
    }
    let message = json!({
        "content": (!content.is_empty()).then_some(content),
        "reasoning_content": (!reasoning.is_empty()).then_some(reasoning),
        "tool_calls": calls,
    });
    (message, finish)
}

/// The parts of a non-streamed message that a stream reassembles to (call ids differ).
pub fn comparable(message: &Value) -> Value {
    let calls: Vec<Value> = message["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| json!({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}))
        .collect();
    json!({
        "content": message["content"],
        "reasoning_content": message.get("reasoning_content").cloned().unwrap_or(Value::Null),
        "tool_calls": calls,
    })
}
