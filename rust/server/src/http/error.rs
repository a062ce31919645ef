//! Errors in the OpenAI error schema: `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::response::{ErrorDetail, ErrorResponse};
use crate::error::RequestError;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
}

impl ApiError {
    /// Private, as `bad_param`: a 400 is built only from a `RequestError::Invalid` (below),
    /// which `validate/` words, so no route can invent its own.
    fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
        }
    }
    fn bad_param(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.to_string()),
            ..Self::bad_request(message)
        }
    }
    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "invalid or missing API key".into(),
            kind: "authentication_error",
            param: None,
        }
    }
    pub fn model_not_found(model: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist."),
            kind: "not_found_error",
            param: Some("model".into()),
        }
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "not_found_error",
            param: None,
        }
    }
    /// 429 with `Retry-After` (see `into_response`): the queue is full, try again shortly.
    pub fn overloaded(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            kind: "overloaded_error",
            param: None,
        }
    }
    pub fn unsupported_media_type(mime: &str) -> Self {
        ApiError {
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            message: format!(
                "the request body must be JSON (Content-Type: application/json), got {mime:?}"
            ),
            kind: "invalid_request_error",
            param: None,
        }
    }
    pub fn payload_too_large(limit: u64) -> Self {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!(
                "the request body is larger than {limit} bytes (--max-request-body-bytes)"
            ),
            kind: "invalid_request_error",
            param: None,
        }
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "service_unavailable",
            param: None,
        }
    }
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "internal_error",
            param: None,
        }
    }

    pub fn body(&self) -> serde_json::Value {
        json!(ErrorResponse {
            error: ErrorDetail {
                message: self.message.clone(),
                kind: self.kind.to_string(),
                param: self.param.clone(),
                code: self.status.as_u16(),
            },
        })
    }
}

/// Seconds a refused client should wait before retrying (429, and 503 while shutting down).
pub const RETRY_AFTER_SECONDS: &str = "1";

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECONDS),
            );
        }
        response
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}

/// The pipeline's errors in the OpenAI schema: an invalid request is a 400 (naming its
/// parameter), overload a 429, an engine that cannot serve a 503, anything else a 500.
impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        match e {
            RequestError::Invalid {
                param: Some(p),
                message,
            } => ApiError::bad_param(&p, message),
            RequestError::Invalid {
                param: None,
                message,
            } => ApiError::bad_request(message),
            RequestError::Overloaded(m) => ApiError::overloaded(m),
            RequestError::Unavailable(m) => ApiError::unavailable(m),
            RequestError::Internal(m) => ApiError::internal(m),
        }
    }
}
