//! The HTTP front end: routes, shared state, and the layers every request passes before its
//! handler: drain refusal, auth, body limit, admission. Handlers live in `openai` and `native`.

pub mod agents;
pub mod chat;
pub mod error;
pub mod lifecycle;
pub mod lora;
pub mod messages;
pub mod native;
pub mod openai;
pub mod openapi;
pub mod ops;
pub mod pooling;
pub mod protocol;
pub mod protocol_agents;
pub mod response;
pub mod responses;
pub mod trace;

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use crate::error::RequestError;
use crate::frontend::Frontend;
use crate::validate::pooling::check_server_kind;
use error::ApiError;
use futures_util::StreamExt;
pub use lifecycle::Lifecycle;
use subtle::ConstantTimeEq;

/// The pipeline's parts (`Frontend`, which `AppState` derefs to) and what only the HTTP layer
/// reads: the start time and the drain / in-flight count.
#[derive(Clone)]
pub struct AppState {
    pub frontend: Arc<Frontend>,
    pub started: Instant,
    /// Draining (shutdown) and the count of generating requests in flight.
    pub lifecycle: Arc<Lifecycle>,
    /// `/v1/responses` answers kept for `previous_response_id` and `GET /v1/responses/{id}`.
    pub responses: Arc<crate::response_store::ResponseStore>,
    /// The LoRA adapters requests may name (`--enable-lora`).
    pub lora: Arc<crate::lora::LoraRegistry>,
    /// The label of the weights serving now: `--weight-version`, then what
    /// `/update_weights_from_disk` set.
    pub weight_version: Arc<std::sync::RwLock<String>>,
}

impl std::ops::Deref for AppState {
    type Target = Frontend;
    fn deref(&self) -> &Frontend {
        &self.frontend
    }
}

impl AppState {
    /// The label of the weights serving now (`weight_version`).
    pub fn weight_version(&self) -> String {
        self.weight_version
            .read()
            .map_or_else(|e| e.into_inner().clone(), |v| v.clone())
    }

    /// 404 unless `model` names what we serve (absent means "the one model") or a loaded
    /// LoRA adapter.
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            None => Ok(()),
            Some(m)
                if m.is_empty()
                    || m == self.config.served_model_name
                    || m == self.config.model_path
                    || self.lora.get(m).is_some() =>
            {
                Ok(())
            }
            Some(m) => Err(ApiError::model_not_found(m)),
        }
    }

    /// The `model` a response names: the adapter a request ran on (as vLLM's responses do),
    /// else the served model.
    pub fn response_model(&self, adapter: Option<&crate::lora::Adapter>) -> String {
        adapter.map_or_else(|| self.config.served_model_name.clone(), |a| a.name.clone())
    }

    /// The LoRA adapter a generating request runs: SGLang's `lora_path` (an adapter's name;
    /// 400 when not loaded), else the `model` field when it names one (vLLM), else none;
    /// `model` must name the base model or an adapter either way (404).
    pub fn adapter_for(
        &self,
        model: Option<&str>,
        lora_path: Option<&str>,
    ) -> Result<Option<crate::lora::Adapter>, ApiError> {
        self.check_model(model)?;
        if let Some(name) = lora_path {
            return Ok(Some(crate::validate::admin::lora_path(
                self.lora.enabled(),
                name,
                self.lora.get(name),
            )?));
        }
        Ok(model.and_then(|m| self.lora.get(m)))
    }
}

/// Layers run outermost first: drain refusal (every route but /metrics), then on the API routes
/// auth (before any body byte is read), the body limit, and on the generating routes admission
/// (before tokenizing).
pub fn router(state: AppState) -> Router {
    let api = control_routes()
        .merge(generating_routes(&state))
        .merge(pooling_routes(&state))
        .route_layer(middleware::from_fn_with_state(state.clone(), limit_body))
        .route_layer(middleware::from_fn(require_json))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    let open = Router::new()
        .route("/health", get(native::health))
        .route("/ping", get(native::health).post(native::health))
        .route("/openapi.json", get(openapi::openapi_json));
    let open = if state.config.enable_metrics {
        open.route("/metrics", get(native::metrics))
    } else {
        open
    };
    open.merge(api)
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            refuse_while_draining,
        ))
        .layer(middleware::from_fn(messages::anthropic_errors))
        // `limit_body` enforces --max-request-body-bytes; axum's own 2 MB default must not.
        .layer(DefaultBodyLimit::disable())
        .with_state(state)
}

/// The routes that generate, behind admission (429 past the in-flight limit).
fn generating_routes(state: &AppState) -> Router<AppState> {
    let routes = Router::new()
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/generate", post(native::generate))
        .route("/v1/responses", post(responses::create))
        .route("/v1/messages", post(messages::messages))
        .route_layer(middleware::from_fn_with_state(state.clone(), admit))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            refuse_on_embedding_server,
        ));
    // Outermost of these: the server span covers admission too.
    match state.tracer {
        Some(_) => routes.route_layer(middleware::from_fn_with_state(
            state.clone(),
            trace::trace_request,
        )),
        None => routes,
    }
}

/// The pooling routes (embeddings, scores, classes), behind admission.
fn pooling_routes(state: &AppState) -> Router<AppState> {
    Router::new()
        .route("/v1/embeddings", post(pooling::embeddings))
        .route("/v1/score", post(pooling::score))
        .route("/v1/rerank", post(pooling::rerank))
        .route("/rerank", post(pooling::rerank))
        .route("/classify", post(pooling::classify))
        .route_layer(middleware::from_fn_with_state(state.clone(), admit))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            refuse_on_generation_server,
        ))
}

/// The API routes that neither generate nor pool: models, tokenizer, engine control, LoRA.
fn control_routes() -> Router<AppState> {
    Router::new()
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{id}", get(openai::model))
        .route(
            "/v1/responses/{id}",
            get(responses::get).delete(responses::delete),
        )
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/tokenize", post(native::tokenize))
        .route("/detokenize", post(native::detokenize))
        .route("/v1/tokenize", post(native::tokenize))
        .route("/v1/detokenize", post(native::detokenize))
        .route("/version", get(native::version))
        .route("/abort_request", post(native::abort_request))
        .route("/server_info", get(native::server_info))
        .route("/get_model_info", get(native::model_info))
        .route("/model_info", get(native::model_info))
        .route("/get_server_info", get(native::server_info))
        .route(
            "/flush_cache",
            post(native::flush_cache).get(native::flush_cache),
        )
        .route("/health_generate", get(native::health_generate))
        .route("/v1/load_lora_adapter", post(lora::load_adapter))
        .route("/v1/unload_lora_adapter", post(lora::unload_adapter))
        .route("/load_lora_adapter", post(lora::load_adapter))
        .route("/unload_lora_adapter", post(lora::unload_adapter))
        .route("/pause_generation", post(ops::pause_generation))
        .route("/continue_generation", post(ops::continue_generation))
        .route("/get_weight_version", get(ops::weight_version))
        .route(
            "/update_weights_from_disk",
            post(ops::update_weights_from_disk),
        )
        .route(
            "/release_memory_occupation",
            post(ops::release_memory).get(ops::release_memory),
        )
        .route(
            "/resume_memory_occupation",
            post(ops::resume_memory).get(ops::resume_memory),
        )
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!(
        "no route for {} {}",
        req.method(),
        req.uri().path()
    ))
}

/// Compares the bearer token in constant time (only the key's length can leak), so the key
/// cannot be guessed byte by byte from response times.
async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = state.config.api_key.as_deref() {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            // Anthropic's clients send the key as `x-api-key`.
            .or_else(|| req.headers().get("x-api-key").and_then(|v| v.to_str().ok()));
        let ok = given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(key.as_bytes())));
        if !ok {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

/// While shutting down, new requests get 503 at once (a load balancer moves on); /metrics stays
/// readable.
async fn refuse_while_draining(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    if state.lifecycle.is_draining() && req.uri().path() != "/metrics" {
        return ApiError::unavailable("the server is shutting down").into_response();
    }
    next.run(req).await
}

/// The API routes read JSON: a body declared as anything else (a form or text, which a browser
/// sends cross-site without a CORS preflight) gets 415. A body without a Content-Type is read
/// as JSON, as FastAPI-based servers do.
async fn require_json(req: Request, next: Next) -> Response {
    if let Some(value) = req.headers().get(header::CONTENT_TYPE) {
        let mime = value
            .to_str()
            .unwrap_or_default()
            .split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase();
        let json = mime == "application/json"
            || (mime.starts_with("application/") && mime.ends_with("+json"));
        if !json {
            return ApiError::unsupported_media_type(&mime).into_response();
        }
    }
    next.run(req).await
}

/// Reads the body up to --max-request-body-bytes: a larger declared length gets 413 before any
/// byte is read, a longer chunked body 413 as soon as it passes the limit.
async fn limit_body(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let limit = state.config.max_request_body_bytes;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return ApiError::payload_too_large(limit).into_response();
    }
    let (parts, body) = req.into_parts();
    let mut data = body.into_data_stream();
    let mut bytes = Vec::with_capacity(declared.unwrap_or(0) as usize);
    while let Some(chunk) = data.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                let refusal = RequestError::from(protocol::BodyError::Unreadable(e.to_string()));
                return ApiError::from(refusal).into_response();
            }
        };
        if (bytes.len() + chunk.len()) as u64 > limit {
            return ApiError::payload_too_large(limit).into_response();
        }
        bytes.extend_from_slice(&chunk);
    }
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// An `--is-embedding` server pools; it has no generating routes (a 400 that says so).
async fn refuse_on_embedding_server(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    match check_server_kind(state.config.is_embedding, false, req.uri().path()) {
        Ok(()) => next.run(req).await,
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// The pooling routes need `--is-embedding` (a 400 that says so on a generation server).
async fn refuse_on_generation_server(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    match check_server_kind(state.config.is_embedding, true, req.uri().path()) {
        Ok(()) => next.run(req).await,
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// Admission for the generating routes, before the handler tokenizes: 503 when the engine
/// cannot serve, 429 (with Retry-After) when --max-running-requests + --max-queued-requests
/// requests are already in flight (never with priority scheduling: the engine bounds the
/// queue then, by priority; lib.rs). The slot is held until the response body ends or is
/// dropped (a stream lives past the handler), which bounds the memory of any burst.
async fn admit(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if !state.engine.is_healthy() {
        return ApiError::unavailable("the model worker is not running").into_response();
    }
    let Some(slot) = state.lifecycle.try_admit() else {
        state.metrics.counters.requests_rejected.inc();
        return ApiError::overloaded(format!(
            "server overloaded: {} requests in flight; retry later",
            state.lifecycle.max_in_flight()
        ))
        .into_response();
    };
    let (parts, body) = next.run(req).await.into_parts();
    let body = body.into_data_stream().map(move |frame| {
        let _held = &slot;
        frame
    });
    Response::from_parts(parts, Body::from_stream(body))
}

/// Unix seconds for the `created` field.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub fn ok_json(value: serde_json::Value) -> Response {
    (StatusCode::OK, axum::Json(value)).into_response()
}
