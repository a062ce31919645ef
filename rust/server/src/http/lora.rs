//! Loading and unloading LoRA adapters at run time: vLLM's `/v1/load_lora_adapter` and
//! `/v1/unload_lora_adapter`, also under SGLang's `/load_lora_adapter` spelling. Both take
//! `{"lora_name": ..., "lora_path": ...}` (unload needs only the name).

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;
use utoipa::ToSchema;

use super::error::ApiError;
#[allow(unused_imports)] // named by the #[utoipa::path] attributes
use super::response::ErrorResponse;
use super::{ok_json, protocol::parse_body, AppState};
use crate::lora::LoraError;
use crate::validate;

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LoadLoraRequest {
    pub lora_name: String,
    pub lora_path: String,
    /// SGLang's: never evict the adapter from the workers' GPU pool, which keeps a slot for
    /// it (at most `--max-loras-per-batch` - 1 pinned).
    pub pinned: Option<bool>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UnloadLoraRequest {
    pub lora_name: String,
    /// vLLM's clients may send it; ignored (the name identifies the adapter).
    pub lora_int_id: Option<i64>,
}

fn api_error(e: LoraError, param: &str) -> ApiError {
    match e {
        LoraError::Unknown(_) => ApiError::not_found(e.to_string()),
        _ => validate::admin::lora_refusal(e, param).into(),
    }
}

fn loaded(state: &AppState) -> serde_json::Value {
    let list = state.lora.list();
    let map: serde_json::Map<String, serde_json::Value> =
        list.into_iter().map(|a| (a.name, a.path.into())).collect();
    serde_json::Value::Object(map)
}

#[utoipa::path(post, path = "/v1/load_lora_adapter", request_body = LoadLoraRequest, responses((status = 200, description = "adapter loaded"), (status = 400, body = ErrorResponse)))]
pub async fn load_adapter(State(state): State<AppState>, body: Bytes) -> Response {
    let run = || -> Result<Response, ApiError> {
        let req: LoadLoraRequest = parse_body(&body)?;
        let adapter = state
            .lora
            .load(&req.lora_name, &req.lora_path, req.pinned.unwrap_or(false))
            .map_err(|e| api_error(e, "lora_path"))?;
        tracing::info!(name = %adapter.name, id = adapter.id, path = %adapter.path, pinned = adapter.pinned, "LoRA adapter loaded");
        Ok(ok_json(json!({
            "success": true,
            "message": format!("Success: LoRA adapter '{}' added successfully.", adapter.name),
            "loaded_adapters": loaded(&state),
        })))
    };
    run().unwrap_or_else(IntoResponse::into_response)
}

#[utoipa::path(post, path = "/v1/unload_lora_adapter", request_body = UnloadLoraRequest, responses((status = 200, description = "adapter unloaded"), (status = 404, body = ErrorResponse)))]
pub async fn unload_adapter(State(state): State<AppState>, body: Bytes) -> Response {
    let run = || -> Result<Response, ApiError> {
        let req: UnloadLoraRequest = parse_body(&body)?;
        let adapter = state
            .lora
            .unload(&req.lora_name)
            .map_err(|e| api_error(e, "lora_name"))?;
        tracing::info!(name = %adapter.name, id = adapter.id, "LoRA adapter unloaded");
        Ok((
            StatusCode::OK,
            axum::Json(json!({
                "success": true,
                "message": format!("Success: LoRA adapter '{}' removed successfully.", adapter.name),
                "loaded_adapters": loaded(&state),
            })),
        )
            .into_response())
    };
    run().unwrap_or_else(IntoResponse::into_response)
}
