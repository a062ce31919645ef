//! `/openapi.json`: the OpenAPI document of every route, generated from the handlers'
//! `#[utoipa::path]` attributes and the typed request/response structs they use.

use axum::response::{IntoResponse, Response};
use utoipa::OpenApi;

use super::{chat, native, openai};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "TokenSpeed",
        description = "OpenAI-compatible and SGLang-native LLM serving API"
    ),
    paths(
        openai::models,
        openai::model,
        openai::completions,
        chat::chat_completions,
        native::generate,
        native::tokenize,
        native::detokenize,
        native::model_info,
        native::server_info,
        native::flush_cache,
        native::health,
        native::health_generate,
        native::metrics,
        native::version,
        native::abort_request,
    )
)]
pub struct ApiDoc;

/// Routes served by the same handler as another: (alias, documented path).
const ALIASES: &[(&str, &str)] = &[
    ("/v1/tokenize", "/tokenize"),
    ("/v1/detokenize", "/detokenize"),
    ("/server_info", "/get_server_info"),
    ("/ping", "/health"),
];

/// The document, alias routes included.
pub fn document() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    for (alias, path) in ALIASES {
        if let Some(mut item) = doc.paths.paths.get(*path).cloned() {
            // Operation ids must be unique: the alias's get its path as a suffix.
            let suffix = alias.trim_start_matches('/').replace('/', "_");
            for op in [&mut item.get, &mut item.post].into_iter().flatten() {
                op.operation_id = op.operation_id.take().map(|id| format!("{id}_{suffix}"));
            }
            doc.paths.paths.insert((*alias).to_string(), item);
        }
    }
    doc
}

pub async fn openapi_json() -> Response {
    axum::Json(document()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_has_every_generating_route_and_its_fields() {
        let doc = serde_json::to_value(document()).expect("serializable");
        for path in [
            "/v1/completions",
            "/v1/chat/completions",
            "/generate",
            "/v1/models/{id}",
            "/v1/tokenize",
            "/ping",
        ] {
            assert!(doc["paths"].get(path).is_some(), "{path} missing");
        }
        let mut ids = std::collections::HashSet::new();
        for item in doc["paths"].as_object().expect("paths").values() {
            for op in item.as_object().expect("item").values() {
                if let Some(id) = op.get("operationId").and_then(|v| v.as_str()) {
                    assert!(ids.insert(id.to_string()), "operation id {id} twice");
                }
            }
        }
        let schemas = &doc["components"]["schemas"];
        // The shared sampling fields are one component, referenced by every generating route.
        let completion = serde_json::to_string(&schemas["CompletionRequest"]).expect("json");
        let sampling = serde_json::to_string(&schemas["SamplingFields"]).expect("json");
        assert!(completion.contains("#/components/schemas/SamplingFields"));
        for field in ["prompt", "echo", "best_of"] {
            assert!(completion.contains(&format!("\"{field}\"")), "{field}");
        }
        for field in ["logit_bias", "prompt_logprobs", "n", "temperature"] {
            assert!(sampling.contains(&format!("\"{field}\"")), "{field}");
        }
        assert!(schemas.get("ErrorResponse").is_some());
    }
}
