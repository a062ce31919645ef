//! Operations and RL hooks (SGLang's routes): pause and continue generation, the weights'
//! version label, new weights from disk, releasing and resuming the workers' memory.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use utoipa::ToSchema;

use super::error::ApiError;
use super::protocol::parse_body;
use super::response::ErrorResponse;
use super::{ok_json, AppState};
use crate::validate;

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
        let abort = validate::admin::pause_aborts(req.mode.as_deref())?;
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
    run.await.unwrap_or_else(|e: ApiError| e.into_response())
}

/// SGLang's: the `--weight-version` label of the weights serving now.
#[utoipa::path(get, path = "/get_weight_version", responses((status = 200, description = "the weights' version label")))]
pub async fn weight_version(State(state): State<AppState>) -> Response {
    ok_json(json!({"weight_version": state.weight_version()}))
}

/// Resumes planning steps after `/pause_generation`.
#[utoipa::path(post, path = "/continue_generation", responses((status = 200, description = "resumed")))]
pub async fn continue_generation(State(state): State<AppState>) -> Response {
    state.engine.set_paused(false).await;
    ok_json(json!({"success": true, "message": "generation continued"}))
}

/// `/update_weights_from_disk`'s body (SGLang's `UpdateWeightFromDiskReqInput`, the fields
/// TokenSpeed implements).
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateWeightsRequest {
    /// A checkpoint directory of the same architecture as the one serving.
    pub model_path: String,
    /// As `--load-format` (default: what the server started with).
    pub load_format: Option<String>,
    /// The label `/get_weight_version` and each response report from now on.
    pub weight_version: Option<String>,
    /// End every request in flight first (default false: they finish on the old weights).
    pub abort_all_requests: Option<bool>,
    /// Drop the prefix cache after the update: only true (the default) is supported, since
    /// KV from the old weights would be reused with the new ones.
    pub flush_cache: Option<bool>,
}

/// Reloads the weights from `model_path` while the server stays up: admission is held, the
/// running requests finish (or are aborted with `abort_all_requests`), every worker rank loads
/// the new weights in place, the prefix cache is dropped, and queued requests go on with the
/// new weights. A checkpoint of another architecture fails (`success: false`, 400) and the old
/// weights keep serving.
#[utoipa::path(post, path = "/update_weights_from_disk", request_body = UpdateWeightsRequest, responses((status = 200, description = "updated"), (status = 400, description = "not updated: the old weights keep serving")))]
pub async fn update_weights_from_disk(State(state): State<AppState>, body: Bytes) -> Response {
    let run = async {
        let req: UpdateWeightsRequest = parse_body(&body)?;
        let args = validate::admin::weight_update(
            &req.model_path,
            req.load_format.as_deref(),
            req.flush_cache,
        )?;
        if req.abort_all_requests == Some(true) {
            state
                .engine
                .abort_all("aborted: the weights are being updated (/update_weights_from_disk)");
        }
        let op = tokenspeed_engine::WorkerOp {
            kind: tokenspeed_engine::op_kind::UPDATE_WEIGHTS,
            args,
        };
        let reply = state.engine.worker_op(op).await;
        if reply.ok {
            if let Some(version) = req.weight_version {
                *state
                    .weight_version
                    .write()
                    .unwrap_or_else(|e| e.into_inner()) = version;
            }
            tracing::info!(path = %req.model_path, "weights updated from disk");
        } else {
            tracing::warn!(path = %req.model_path, message = %reply.message, "weights not updated");
        }
        let body = json!({
            "success": reply.ok,
            "message": reply.message,
            "num_paused_requests": reply.queued,
        });
        Ok((op_status(reply.ok), axum::Json(body)).into_response())
    };
    run.await.unwrap_or_else(|e: ApiError| e.into_response())
}

/// `/release_memory_occupation`'s and `/resume_memory_occupation`'s body (optional).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MemoryRequest {
    /// SGLang's memory kinds ("weights", "kv_cache", "cuda_graph"); absent: all. Only all of
    /// them together are supported.
    pub tags: Option<Vec<String>>,
}

/// Frees the workers' weights (a host copy kept), KV cache and CUDA graphs once the running
/// requests finish (SGLang's sleep, for an RL trainer that needs the GPU); requests sent
/// meanwhile wait in the queue until `/resume_memory_occupation`.
#[utoipa::path(method(get, post), path = "/release_memory_occupation", request_body = MemoryRequest, responses((status = 200, description = "released: `{success, message}`"), (status = 400, description = "not released: an error for a bad body or tags, `{success: false, message}` when the workers refuse (already released)")))]
pub async fn release_memory(State(state): State<AppState>, body: Bytes) -> Response {
    memory_op(state, body, tokenspeed_engine::op_kind::RELEASE_MEMORY).await
}

/// Restores what `/release_memory_occupation` freed; queued requests then run, on the same
/// weights as before.
#[utoipa::path(method(get, post), path = "/resume_memory_occupation", request_body = MemoryRequest, responses((status = 200, description = "resumed: `{success, message}`"), (status = 400, description = "not resumed: an error for a bad body or tags, `{success: false, message}` when the workers refuse (not released)")))]
pub async fn resume_memory(State(state): State<AppState>, body: Bytes) -> Response {
    memory_op(state, body, tokenspeed_engine::op_kind::RESUME_MEMORY).await
}

/// An operation's status in SGLang's shape: 200 when the workers did it, 400 when they
/// refused it (already released, a checkpoint of another architecture): the body's
/// `{success: false, message}` says why.
pub(super) fn op_status(done: bool) -> StatusCode {
    if done {
        StatusCode::OK
    } else {
        StatusCode::BAD_REQUEST
    }
}

async fn memory_op(state: AppState, body: Bytes, kind: u8) -> Response {
    let run = async {
        let req: MemoryRequest = if body.iter().all(u8::is_ascii_whitespace) {
            MemoryRequest::default()
        } else {
            parse_body(&body)?
        };
        if let Some(tags) = &req.tags {
            validate::admin::memory_tags(tags)?;
        }
        let op = tokenspeed_engine::WorkerOp {
            kind,
            args: b"{}".to_vec(),
        };
        let reply = state.engine.worker_op(op).await;
        let body = json!({"success": reply.ok, "message": reply.message});
        Ok((op_status(reply.ok), axum::Json(body)).into_response())
    };
    run.await.unwrap_or_else(|e: ApiError| e.into_response())
}
