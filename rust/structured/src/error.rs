//! Typed errors: compiling a grammar (a client error, answered 400 before any KV is spent) and
//! driving a matcher (an engine-side error that ends one request).

use thiserror::Error;

/// Why a grammar could not be compiled. Every message names the request field's kind and the
/// problem, so the HTTP layer can pass it through as the 400's message.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum GrammarError {
    #[error("invalid JSON schema: {0}")]
    JsonSchema(String),
    #[error("invalid regex: {0}")]
    Regex(String),
    #[error("invalid grammar: {0}")]
    Grammar(String),
    #[error("invalid choice list: {0}")]
    Choice(String),
    #[error("invalid structural_tag: {0}")]
    StructuralTag(String),
    /// The tokenizer cannot back a grammar (a server configuration problem, not the client's).
    #[error("tokenizer unsupported for constrained decoding: {0}")]
    Tokenizer(String),
}

impl GrammarError {
    /// Whether the client caused it (400) rather than the server's tokenizer (500).
    pub fn is_client_error(&self) -> bool {
        !matches!(self, GrammarError::Tokenizer(_))
    }
}

/// A matcher step that failed; the request cannot continue under its grammar.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum MatchError {
    /// The sampler produced a token the mask did not allow (a sampler bug, or a mask that did not
    /// reach the sampler in time).
    #[error("token {token} is not allowed by the grammar: {message}")]
    TokenRejected { token: u32, message: String },
    #[error("the token bitmask has {got} words, the vocab of {vocab_size} needs {needed}")]
    BitmaskTooSmall {
        got: usize,
        needed: usize,
        vocab_size: usize,
    },
    /// No token can extend the output (cannot happen for a satisfiable grammar) or llguidance
    /// failed internally; the message is llguidance's.
    #[error("grammar matcher failed: {0}")]
    Matcher(String),
}
