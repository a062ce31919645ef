//! `/openapi.json`: the OpenAPI document of every route, generated from the handlers'
//! `#[utoipa::path]` attributes and the typed request/response structs they use.

use axum::response::{IntoResponse, Response};
use utoipa::OpenApi;

use super::{native, openai};

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
        openai::chat_completions,
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

pub async fn openapi_json() -> Response {
    axum::Json(ApiDoc::openapi()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_has_every_generating_route_and_its_fields() {
        let doc = serde_json::to_value(ApiDoc::openapi()).expect("serializable");
        for path in [
            "/v1/completions",
            "/v1/chat/completions",
            "/generate",
            "/v1/models/{id}",
        ] {
            assert!(doc["paths"].get(path).is_some(), "{path} missing");
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
