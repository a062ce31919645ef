//! The HTTP front end: routes, shared state, auth. Handlers live in `openai` and `native`.

pub mod error;
pub mod native;
pub mod openai;
pub mod protocol;
pub mod response;

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tokenspeed_text::TextTokenizer;

use crate::config::ServerConfig;
use crate::engine::EngineHandle;
use crate::metrics::Metrics;
use error::ApiError;

#[derive(Clone)]
pub struct AppState {
    pub config: Arc<ServerConfig>,
    pub tokenizer: Arc<TextTokenizer>,
    pub engine: EngineHandle,
    pub metrics: Arc<Metrics>,
    pub started: Instant,
}

impl AppState {
    /// 404 unless `model` names what we serve (absent means "the one model").
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            None => Ok(()),
            Some(m)
                if m.is_empty()
                    || m == self.config.served_model_name
                    || m == self.config.model_path =>
            {
                Ok(())
            }
            Some(m) => Err(ApiError::model_not_found(m)),
        }
    }
}

pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{id}", get(openai::model))
        .route("/generate", post(native::generate))
        .route("/tokenize", post(native::tokenize))
        .route("/detokenize", post(native::detokenize))
        .route("/v1/tokenize", post(native::tokenize))
        .route("/v1/detokenize", post(native::detokenize))
        .route("/version", get(native::version))
        .route("/abort_request", post(native::abort_request))
        .route("/server_info", get(native::server_info))
        .route("/get_model_info", get(native::model_info))
        .route("/get_server_info", get(native::server_info))
        .route(
            "/flush_cache",
            post(native::flush_cache).get(native::flush_cache),
        )
        .route("/health_generate", get(native::health_generate))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    let open = Router::new()
        .route("/health", get(native::health))
        .route("/ping", get(native::health).post(native::health));
    let open = if state.config.enable_metrics {
        open.route("/metrics", get(native::metrics))
    } else {
        open
    };
    open.merge(api).fallback(not_found).with_state(state)
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!(
        "no route for {} {}",
        req.method(),
        req.uri().path()
    ))
}

async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = state.config.api_key.as_deref() {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(key) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
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
