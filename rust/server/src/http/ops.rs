//! Operations and RL hooks (SGLang's routes): pause and continue generation, the weights'
//! version label.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use utoipa::ToSchema;

use super::error::ApiError;
use super::protocol::parse_body;
use super::response::ErrorResponse;
use super::{ok_json, AppState};

/// `/pause_generation`'s body (optional).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PauseRequest {
    /// "abort" (the default, as in SGLang): every in-flight request ends with an error first;
    /// "in_place": they stay queued or running and go on at `/continue_generation`.
    pub mode: Option<String>,
}

/// Stops planning steps until `/continue_generation` (an RL trainer syncing weights, an
/// operator draining a node). Requests sent meanwhile are queued, not refused; steps already
/// on the GPU finish. Returns once every replica has stopped planning.
#[utoipa::path(post, path = "/pause_generation", request_body = PauseRequest, responses((status = 200, description = "paused"), (status = 400, body = ErrorResponse)))]
pub async fn pause_generation(State(state): State<AppState>, body: Bytes) -> Response {
    let run = async {
        let req: PauseRequest = if body.iter().all(u8::is_ascii_whitespace) {
            PauseRequest::default()
        } else {
            parse_body(&body)?
        };
        let abort = match req.mode.as_deref() {
            None | Some("abort") => true,
            Some("in_place") => false,
            Some("retract") => {
                return Err(ApiError::bad_param(
                    "mode",
                    "mode 'retract' is not supported yet: use 'in_place' (requests keep their \
                     KV) or 'abort'",
                ))
            }
            Some(other) => {
                return Err(ApiError::bad_param(
                    "mode",
                    format!("unknown mode {other:?} (expected \"abort\" or \"in_place\")"),
                ))
            }
        };
        state.engine.set_paused(true).await;
        if abort {
            state
                .engine
                .abort_all("aborted: generation was paused (/pause_generation)");
        }
        Ok(ok_json(
            json!({"success": true, "message": "generation paused"}),
        ))
    };
    run.await.unwrap_or_else(|e| e.into_response())
}

/// SGLang's: the `--weight-version` label of the weights serving now.
#[utoipa::path(get, path = "/get_weight_version", responses((status = 200, description = "the weights' version label")))]
pub async fn weight_version(State(state): State<AppState>) -> Response {
    ok_json(json!({"weight_version": state.config.weight_version}))
}

/// Resumes planning steps after `/pause_generation`.
#[utoipa::path(post, path = "/continue_generation", responses((status = 200, description = "resumed")))]
pub async fn continue_generation(State(state): State<AppState>) -> Response {
    state.engine.set_paused(false).await;
    ok_json(json!({"success": true, "message": "generation continued"}))
}
