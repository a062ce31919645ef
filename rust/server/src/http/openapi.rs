//! `/openapi.json`: the OpenAPI document of every route, generated from the handlers'
//! `#[utoipa::path]` attributes and the typed request/response structs they use.

use axum::response::{IntoResponse, Response};
use utoipa::OpenApi;

use super::{chat, lora, messages, native, openai, ops, pooling, responses};

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
        responses::create,
        responses::get,
        responses::delete,
        messages::messages,
        messages::count_tokens,
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
        lora::load_adapter,
        lora::unload_adapter,
        ops::pause_generation,
        ops::continue_generation,
        ops::weight_version,
        ops::update_weights_from_disk,
        ops::release_memory,
        ops::resume_memory,
        pooling::embeddings,
        pooling::score,
        pooling::rerank,
        pooling::classify,
        openapi_json,
    )
)]
pub struct ApiDoc;

/// Routes served by the same handler as another: (alias, documented path).
const ALIASES: &[(&str, &str)] = &[
    ("/v1/tokenize", "/tokenize"),
    ("/v1/detokenize", "/detokenize"),
    ("/server_info", "/get_server_info"),
    ("/model_info", "/get_model_info"),
    ("/ping", "/health"),
    ("/load_lora_adapter", "/v1/load_lora_adapter"),
    ("/unload_lora_adapter", "/v1/unload_lora_adapter"),
    ("/rerank", "/v1/rerank"),
];

/// Routes whose body names a `model`: an unknown one is a 404, as on OpenAI.
const MODEL_ROUTES: &[&str] = &[
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/tokenize",
    "/detokenize",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
    "/rerank",
    "/classify",
];
/// Routes that queue work for the engine: a full queue is a 429, a dead worker a 503.
const QUEUED_ROUTES: &[&str] = &[
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/generate",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
    "/rerank",
    "/classify",
];
/// Routes open without the API key (load balancers and scrapers need them).
const OPEN_ROUTES: &[&str] = &["/health", "/ping", "/metrics", "/openapi.json"];

/// The errors any route of a kind can answer, written once here rather than on each handler
/// (all in the OpenAI error format): the fuzz test holds every response to the document.
fn add_common_errors(path: &str, item: &mut utoipa::openapi::PathItem) {
    use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
    // `/v1/messages` answers errors in Anthropic's shape (`messages::anthropic_errors`).
    let schema = if path.starts_with(super::messages::PATH) {
        "AnthropicError"
    } else {
        "ErrorResponse"
    };
    let error = |description: &str| {
        ResponseBuilder::new()
            .description(description)
            .content(
                "application/json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name(schema)))
                    .build(),
            )
            .build()
    };
    let post = item.post.is_some();
    for op in [&mut item.get, &mut item.post, &mut item.delete]
        .into_iter()
        .flatten()
    {
        let mut add = |status: &str, description: &str| {
            op.responses
                .responses
                .entry(status.to_string())
                .or_insert_with(|| error(description).into());
        };
        if !OPEN_ROUTES.contains(&path) {
            add("401", "missing or wrong API key (with --api-key)");
        }
        if post {
            add("400", "invalid request");
            add("413", "body over --max-request-body-bytes");
        }
        if MODEL_ROUTES.contains(&path) {
            add("404", "unknown model");
        }
        if QUEUED_ROUTES.contains(&path) {
            add(
                "429",
                "queue full: retry after the Retry-After header's seconds",
            );
            add("503", "no worker, or shutting down");
        }
    }
}

/// The document, alias routes included.
pub fn document() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    for (path, item) in doc.paths.paths.iter_mut() {
        add_common_errors(path, item);
        // A handler served on GET and POST has one operation id: the GET's gets a suffix.
        if let (Some(get), Some(post)) = (&mut item.get, &item.post) {
            if get.operation_id == post.operation_id {
                get.operation_id = get.operation_id.take().map(|id| format!("{id}_get"));
            }
        }
    }
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

#[utoipa::path(get, path = "/openapi.json", responses((status = 200, description = "this document")))]
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
            "/v1/responses",
            "/v1/responses/{id}",
            "/v1/messages",
            "/v1/messages/count_tokens",
            "/openapi.json",
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
