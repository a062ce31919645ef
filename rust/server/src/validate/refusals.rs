//! The 400s of the steps around validation: what the client is told when its body does not
//! parse, its prompt does not render, or its grammar does not compile. Those modules say what
//! failed in their own terms (a typed error); the message and the parameter named are decided
//! here, beside the rest of the request's rules.

use tokenspeed_engine::MAX_GRAMMAR_TEXT;

use crate::constraint::GrammarError;
use crate::error::RequestError;
use crate::http::protocol::BodyError;
use crate::prompt::PromptError;

impl From<BodyError> for RequestError {
    fn from(e: BodyError) -> Self {
        match e {
            BodyError::Empty => {
                RequestError::bad_request("request body is empty; expected a JSON object")
            }
            BodyError::Json(message) => {
                RequestError::bad_request(format!("invalid JSON: {message}"))
            }
            BodyError::Unreadable(message) => {
                RequestError::bad_request(format!("reading the request body: {message}"))
            }
            BodyError::NotAnObject => {
                RequestError::bad_request("the request body must be a JSON object")
            }
            BodyError::Shape {
                field: Some(field),
                message,
            } => RequestError::bad_param(&field, format!("invalid '{field}': {message}")),
            BodyError::Shape {
                field: None,
                message,
            } => RequestError::bad_request(format!("invalid request: {message}")),
        }
    }
}

impl From<PromptError> for RequestError {
    fn from(e: PromptError) -> Self {
        match e {
            PromptError::Text(message) => RequestError::bad_param("prompt", message),
            PromptError::Template(message) | PromptError::RenderedChat(message) => {
                RequestError::bad_param("messages", message)
            }
            PromptError::FinalMessageNotRendered => RequestError::bad_param(
                "continue_final_message",
                "the final message's content (a non-empty string) is not in the rendered prompt",
            ),
            PromptError::Tokens(message) => RequestError::bad_param("tokens", message),
            PromptError::Pair(message) => {
                RequestError::bad_request(format!("tokenizing a text pair: {message}"))
            }
        }
    }
}

impl From<GrammarError> for RequestError {
    fn from(e: GrammarError) -> Self {
        match e {
            GrammarError::Disabled { field } => RequestError::bad_param(
                field,
                format!(
                    "'{field}' needs structured output, which this server has disabled \
                     (--grammar-backend none)"
                ),
            ),
            GrammarError::Invalid { field, message } => RequestError::bad_param(field, message),
            GrammarError::TokenIdsNeedLlguidance => RequestError::bad_param(
                "allowed_token_ids",
                "allowed_token_ids needs --grammar-backend llguidance (the default)",
            ),
            GrammarError::TooLongForWorker { field, bytes } => RequestError::bad_param(
                field,
                format!(
                    "'{field}' is {bytes} bytes; --grammar-backend xgrammar takes grammars of at \
                     most {MAX_GRAMMAR_TEXT} bytes (llguidance has no such limit)"
                ),
            ),
        }
    }
}
