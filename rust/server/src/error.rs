//! The request pipeline's error: what went wrong with one request, in domain terms. Validation
//! (`validate/`) is the only producer of `Invalid` (a 400 naming the parameter); the engine
//! adds the rest. `http::error::ApiError` maps each kind to an OpenAI-format error response, so
//! nothing outside `http/` knows about status codes.

use crate::engine::EngineErrorKind;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    /// The request itself is wrong: `param` names the field when one is to blame.
    #[error("{message}")]
    Invalid {
        param: Option<String>,
        message: String,
    },
    /// Too much in flight: try again shortly.
    #[error("{0}")]
    Overloaded(String),
    /// The engine or its workers cannot serve now.
    #[error("{0}")]
    Unavailable(String),
    /// A bug or a failure the client cannot fix.
    #[error("{0}")]
    Internal(String),
}

impl RequestError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        RequestError::Invalid {
            param: None,
            message: message.into(),
        }
    }
    pub fn bad_param(param: &str, message: impl Into<String>) -> Self {
        RequestError::Invalid {
            param: Some(param.to_string()),
            message: message.into(),
        }
    }
    pub fn overloaded(message: impl Into<String>) -> Self {
        RequestError::Overloaded(message.into())
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        RequestError::Unavailable(message.into())
    }
    pub fn internal(message: impl Into<String>) -> Self {
        RequestError::Internal(message.into())
    }
    /// An engine event's error, in request terms (the one mapping of `EngineErrorKind`).
    pub fn from_engine(kind: EngineErrorKind, message: String) -> Self {
        match kind {
            EngineErrorKind::BadRequest => RequestError::bad_request(message),
            EngineErrorKind::Overloaded => RequestError::overloaded(message),
            EngineErrorKind::Unavailable => RequestError::unavailable(message),
            EngineErrorKind::Internal => RequestError::internal(message),
        }
    }
    /// The parameter an invalid request is refused for, if one is named.
    pub fn param(&self) -> Option<&str> {
        match self {
            RequestError::Invalid { param, .. } => param.as_deref(),
            _ => None,
        }
    }
}
