//! SGLang-native endpoints: /generate, /tokenize, /detokenize, /get_model_info,
//! /get_server_info, /flush_cache, /health, /health_generate, /metrics.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokenspeed_engine::scheduler::RequestId;

use super::error::ApiError;
use super::protocol::{
    parse_body, AbortRequest, DetokenizeRequest, GenerateRequest, TokenizeRequest,
};
#[allow(unused_imports)] // named by the #[utoipa::path] attributes
use super::response::ErrorResponse;
use super::{ok_json, AppState};
use crate::generate::{self, Chunk, Prompt};
use crate::validate;
use tokenspeed_text::TextTokenizer;

/// What `/generate` reports with `return_logprob`.
struct LogprobReport {
    /// Top alternatives per token (`top_logprobs_num`); 0: no `*_top_logprobs` lists for the
    /// prompt.
    top: usize,
    /// `return_text_in_logprobs`: each entry's third element is the token's text, else null.
    text: bool,
    /// The prompt tokens listed in `input_token_logprobs` (from `logprob_start_len` on).
    input_from: usize,
    prompt_ids: Vec<u32>,
}

impl LogprobReport {
    fn entry(&self, tokenizer: &TextTokenizer, logprob: Option<f32>, token: u32) -> Value {
        let text = self
            .text
            .then(|| tokenizer.decode(&[token], false).unwrap_or_default());
        json!([logprob, token, text])
    }

    fn tops(&self, tokenizer: &TextTokenizer, top: &[(u32, f32)]) -> Value {
        Value::Array(
            top.iter()
                .map(|&(t, lp)| self.entry(tokenizer, Some(lp), t))
                .collect(),
        )
    }

    /// SGLang's logprob fields of `meta_info`: `output_token_logprobs` as `[logprob, token_id,
    /// text]` per token and `output_top_logprobs` as a list of those per token; for the prompt,
    /// `input_token_logprobs` from `logprob_start_len` on, the first with a null logprob (SGLang
    /// does not score the first listed token), and with `top_logprobs_num`,
    /// `input_top_logprobs` (null first).
    fn fill(&self, tokenizer: &TextTokenizer, chunk: &Chunk, meta: &mut Value) {
        let tokens = chunk
            .logprobs
            .iter()
            .map(|l| self.entry(tokenizer, Some(l.logprob), l.token))
            .collect();
        let tops = chunk
            .logprobs
            .iter()
            .map(|l| self.tops(tokenizer, &l.top))
            .collect();
        meta["output_token_logprobs"] = Value::Array(tokens);
        meta["output_top_logprobs"] = Value::Array(tops);
        // `chunk.prompt_logprobs[i]` scores prompt token i + 1.
        let scored = |p: usize| {
            (p > self.input_from)
                .then(|| p.checked_sub(1).and_then(|i| chunk.prompt_logprobs.get(i)))
                .flatten()
        };
        let listed = self.input_from..self.prompt_ids.len();
        let input = listed
            .clone()
            .zip(&self.prompt_ids[listed.clone()])
            .map(|(p, &t)| self.entry(tokenizer, scored(p).map(|l| l.logprob), t))
            .collect();
        meta["input_token_logprobs"] = Value::Array(input);
        if self.top > 0 {
            let tops = listed
                .map(|p| scored(p).map_or(Value::Null, |l| self.tops(tokenizer, &l.top)))
                .collect();
            meta["input_top_logprobs"] = Value::Array(tops);
        }
    }
}

/// SGLang's `meta_info`, with its logprob fields when `logprobs` says so.
fn meta_info(
    id: &str,
    weight_version: &str,
    chunk: &Chunk,
    started: Instant,
    logprobs: Option<(&LogprobReport, &TextTokenizer)>,
) -> Value {
    let finish = chunk.finish.as_ref().map(|f| match f.reason {
        "length" => json!({"type": "length", "length": chunk.usage.completion_tokens}),
        reason => json!({"type": reason, "matched": f.matched}),
    });
    let mut meta = json!({
        "id": id,
        "prompt_tokens": chunk.usage.prompt_tokens,
        "completion_tokens": chunk.usage.completion_tokens,
        "cached_tokens": chunk.usage.cached_tokens,
        "finish_reason": finish,
        "e2e_latency": started.elapsed().as_secs_f64(),
        "weight_version": weight_version,
    });
    if let Some((report, tokenizer)) = logprobs {
        report.fill(tokenizer, chunk, &mut meta);
    }
    meta
}

#[utoipa::path(post, path = "/generate", request_body = GenerateRequest, responses((status = 200, description = "SGLang native generation"), (status = 400, description = "invalid request", body = ErrorResponse), (status = 503, description = "overloaded or no worker", body = ErrorResponse)))]
pub async fn generate(State(state): State<AppState>, body: Bytes) -> Response {
    match generate_inner(state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn generate_inner(state: AppState, body: &[u8]) -> Result<Response, ApiError> {
    let started = Instant::now();
    let req: GenerateRequest = parse_body(body)?;
    super::protocol::check_extra_fields("/generate", "GenerateRequest", &req.extra)?;
    super::protocol::check_extra_fields(
        "/generate sampling_params",
        "NativeSamplingParams",
        &req.sampling_params.extra,
    )?;
    let adapter = state.adapter_for(None, req.lora_path.as_deref())?;
    let mut checked = validate::routes::generate_request(
        &req,
        &state.config.sampling_defaults,
        state.tokenizer.vocab_size() as u32,
        state.config.max_logprobs,
    )?;
    crate::lora::run_on(&mut checked.spec.sampling, adapter);
    checked.spec.priority = validate::priority(
        req.priority,
        state.config.scheduler.enable_priority_scheduling,
    )?;
    let pd = validate::PdFields {
        room: req.bootstrap_room,
        host: req.bootstrap_host.as_deref(),
        port: req.bootstrap_port,
    };
    checked.spec.kv_transfer = validate::bootstrap(pd, state.config.pd_pair(), 1)?;
    let mut gen = generate::start(&state, generate::new_request_id(), checked.spec).await?;
    let report = LogprobReport {
        top: checked.top as usize,
        text: req.return_text_in_logprobs.unwrap_or(false),
        input_from: validate::routes::logprob_start(checked.start_len, gen.prompt_ids.len())?,
        prompt_ids: gen.prompt_ids.clone(),
    };
    let render = NativeRender {
        id: gen.id().to_string(),
        weight_version: state.weight_version(),
        started,
        report: checked.want_logprobs.then_some(report),
        tokenizer: state.tokenizer.clone(),
    };
    if req.stream.unwrap_or(false) {
        // SGLang streams the cumulative text and ids so far in every event.
        let first = match gen.next().await {
            Some(c) => c?,
            None => return Err(ApiError::internal("the request ended without output")),
        };
        return Ok(render.stream(gen, first));
    }
    let all = gen.collect().await?;
    Ok(ok_json(render.body(&all)))
}

/// How a `/generate` answer is rendered (SGLang's shape).
struct NativeRender {
    id: String,
    /// `--weight-version`.
    weight_version: String,
    started: Instant,
    /// With `return_logprob`: which logprobs `meta_info` lists.
    report: Option<LogprobReport>,
    tokenizer: Arc<TextTokenizer>,
}

impl NativeRender {
    fn body(&self, acc: &Chunk) -> Value {
        let logprobs = self.report.as_ref().map(|r| (r, &*self.tokenizer));
        json!({
            "text": acc.text, "output_ids": acc.token_ids,
            "meta_info": meta_info(&self.id, &self.weight_version, acc, self.started, logprobs),
        })
    }

    fn stream(self, mut gen: generate::Generation, first: Chunk) -> Response {
        let stream = async_stream::stream! {
            let mut acc = Chunk::default();
            let mut pending = Some(Ok(first));
            loop {
                let item = match pending.take() { Some(c) => Some(c), None => gen.next().await };
                let Some(item) = item else { break };
                match item {
                    Ok(c) => {
                        acc.text.push_str(&c.text);
                        acc.token_ids.extend(c.token_ids);
                        acc.logprobs.extend(c.logprobs);
                        acc.prompt_logprobs.extend(c.prompt_logprobs);
                        acc.usage = c.usage;
                        acc.finish = c.finish;
                        yield Ok::<_, Infallible>(Event::default().data(self.body(&acc).to_string()));
                    }
                    Err(e) => {
                        yield Ok(Event::default().data(ApiError::from(e).body().to_string()));
                        break;
                    }
                }
            }
            yield Ok(Event::default().data("[DONE]"));
        };
        Sse::new(stream).into_response()
    }
}

#[utoipa::path(post, path = "/tokenize", request_body = TokenizeRequest, responses((status = 200, description = "token ids"), (status = 400, body = ErrorResponse)))]
pub async fn tokenize(State(state): State<AppState>, body: Bytes) -> Response {
    let run = async {
        let req: TokenizeRequest = parse_body(&body)?;
        state.check_model(req.model.as_deref())?;
        let prompt = validate::routes::tokenize_request(req)?;
        let ids = crate::prompt::tokenize_prompt(&state, prompt).await?;
        Ok::<_, ApiError>(ok_json(json!({
            "tokens": ids, "count": ids.len(), "max_model_len": state.config.scheduler.context_length,
        })))
    };
    run.await.unwrap_or_else(|e| e.into_response())
}

#[utoipa::path(post, path = "/detokenize", request_body = DetokenizeRequest, responses((status = 200, description = "text"), (status = 400, body = ErrorResponse)))]
pub async fn detokenize(State(state): State<AppState>, body: Bytes) -> Response {
    let run = async {
        let req: DetokenizeRequest = parse_body(&body)?;
        state.check_model(req.model.as_deref())?;
        validate::routes::token_ids(&req.tokens, state.tokenizer.vocab_size() as u32)?;
        let text = crate::prompt::detokenize(
            &state,
            &req.tokens,
            req.skip_special_tokens.unwrap_or(false),
        )?;
        Ok::<_, ApiError>(ok_json(json!({"prompt": text, "text": text})))
    };
    run.await.unwrap_or_else(|e| e.into_response())
}

#[utoipa::path(get, path = "/get_model_info", responses((status = 200, description = "model facts")))]
pub async fn model_info(State(state): State<AppState>) -> Response {
    ok_json(json!({
        "model_path": state.config.model_path,
        "tokenizer_path": state.config.tokenizer_path,
        "served_model_name": state.config.served_model_name,
        "weight_version": state.weight_version(),
        "is_generation": true,
        "context_length": state.config.scheduler.context_length,
        "vocab_size": state.tokenizer.vocab_size(),
        "eos_token_ids": state.tokenizer.eos_token_ids(),
    }))
}

#[utoipa::path(get, path = "/get_server_info", responses((status = 200, description = "engine state and configuration")))]
pub async fn server_info(State(state): State<AppState>) -> Response {
    let stats = state.engine.stats();
    let replicas = state.engine.replica_info();
    let mut info = json!({
        "version": env!("CARGO_PKG_VERSION"),
        "healthy": state.engine.is_healthy(),
        "uptime_s": state.started.elapsed().as_secs_f64(),
        "disable_overlap_schedule": state.config.disable_overlap_schedule,
        "kv_pages": {
            "total": stats.total_pages, "free": stats.free_pages, "used": stats.used_pages,
            "cached": stats.cached_pages, "evictable": stats.evictable_pages,
        },
        // SGLang's name: tokens per verifying request-step (0 before any, or without spec).
        "avg_spec_accept_length": stats.pool().avg_spec_accept_length(),
        // The hierarchical cache's host tier (`--enable-hierarchical-cache`; zeros when off).
        "host_kv_pages": {
            "total": stats.host.total_pages, "used": stats.host.used_pages,
            "hit_tokens": stats.host.hit_tokens, "load_pages": stats.host.load_pages,
            "writeback_pages": stats.host.writeback_pages,
        },
        // Its storage tier (`--hicache-storage-backend`; zeros when off).
        "storage_kv_pages": stats.storage,
        // PD disaggregation's transfers (`--disaggregation-mode`; zeros when off).
        "kv_transfer": stats.kv_transfer,
        "engine": stats,
        "dp_size": replicas.len(),
        "replicas": replicas,
        // What a router in front reads to name this worker's model (SGLang's router: the
        // `model_path` and `served_model_name` of its /server_info).
        "model_path": state.config.model_path,
        "tokenizer_path": state.config.tokenizer_path,
        "served_model_name": state.config.served_model_name,
    });
    // The scheduler's settings as it holds them (page_size, num_pages, context_length, ...),
    // then the extra facts the launcher reported.
    let scheduler = serde_json::to_value(&state.config.scheduler).unwrap_or(Value::Null);
    for source in [&scheduler, &state.config.server_info] {
        if let (Value::Object(extra), Value::Object(out)) = (source, &mut info) {
            for (k, v) in extra {
                out.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
    }
    ok_json(info)
}

#[utoipa::path(method(get, post), path = "/flush_cache", responses((status = 200, description = "flushed"), (status = 400, description = "requests are running")))]
pub async fn flush_cache(State(state): State<AppState>) -> Response {
    let flushed = state.engine.flush_cache().await;
    let text = if flushed {
        "Cache flushed.\n"
    } else {
        "Cache not flushed: requests are running.\n"
    };
    (super::ops::op_status(flushed), text).into_response()
}

#[utoipa::path(get, path = "/health", responses((status = 200, description = "healthy"), (status = 503, body = ErrorResponse)))]
pub async fn health(State(state): State<AppState>) -> Response {
    if state.engine.is_healthy() {
        StatusCode::OK.into_response()
    } else {
        ApiError::unavailable("the model worker is not running").into_response()
    }
}

/// Health that proves the whole path works: generates one token.
#[utoipa::path(get, path = "/health_generate", responses((status = 200, description = "a one-token generation worked"), (status = 503, body = ErrorResponse)))]
pub async fn health_generate(State(state): State<AppState>) -> Response {
    if !state.engine.is_healthy() {
        return ApiError::unavailable("the model worker is not running").into_response();
    }
    // Every data-parallel replica, at once: each must prove its own path.
    let probes = (0..state.engine.len()).map(|r| {
        let prompt = Prompt::Ids(vec![state.tokenizer.bos_token_id().unwrap_or(0)]);
        generate::probe(&state, prompt, std::time::Duration::from_secs(20), Some(r))
    });
    let results = futures_util::future::join_all(probes).await;
    match results.into_iter().find_map(Result::err) {
        None => StatusCode::OK.into_response(),
        Some(e) => ApiError::from(e).into_response(),
    }
}

#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "Prometheus text"), (status = 404, description = "served only with --enable-metrics", body = ErrorResponse)))]
pub async fn metrics(State(state): State<AppState>) -> Response {
    if state.engine.len() > 1 {
        // With one replica its engine keeps the pool gauges current; with several they are
        // the sum, taken now.
        state.metrics.observe_pool(&state.engine.stats().pool());
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}

#[utoipa::path(get, path = "/version", responses((status = 200, description = "server version")))]
pub async fn version() -> Response {
    ok_json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

/// SGLang's `/abort_request`: ends the request whose id `/generate` reported in
/// `meta_info.id`, freeing its slot and KV pages; its client's request ends with an error.
/// Aborting a request that already ended is a 200, as in SGLang (abort is idempotent); a `rid`
/// that no request could have (not one of our ids: 32 hex digits, `-<choice>` after the first
/// choice) is a 404: well-formed, naming nothing.
#[utoipa::path(post, path = "/abort_request", request_body = AbortRequest, responses((status = 200, description = "aborted"), (status = 400, body = ErrorResponse), (status = 404, body = ErrorResponse)))]
pub async fn abort_request(State(state): State<AppState>, body: Bytes) -> Response {
    let run = async {
        let req: AbortRequest = parse_body(&body)?;
        let id: RequestId = req
            .rid
            .parse()
            .map_err(|_| ApiError::not_found(format!("no request has the id {:?}", req.rid)))?;
        state.engine.abort(id);
        Ok::<_, ApiError>(StatusCode::OK.into_response())
    };
    run.await.unwrap_or_else(|e| e.into_response())
}
