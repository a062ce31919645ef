//! The error type of the text crate: every failure names the file, token or template involved.

use std::path::PathBuf;

/// Errors from loading tokenizers, encoding/decoding and rendering chat templates.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("failed to read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to parse {path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("failed to load tokenizer from {path}: {message}")]
    LoadTokenizer { path: PathBuf, message: String },
    #[error("tokenizer failed to encode: {0}")]
    Encode(String),
    #[error("tokenizer failed to decode: {0}")]
    Decode(String),
    #[error("no chat template: the model has none (tokenizer_config.json, chat_template.jinja) and no --chat-template was given")]
    NoChatTemplate,
    #[error("chat template file not found: {0}")]
    ChatTemplateNotFound(PathBuf),
    #[error("invalid chat template {name:?}: {message}")]
    InvalidChatTemplate { name: String, message: String },
    #[error("chat template failed to render: {0}")]
    Render(String),
    #[error("invalid chat messages: {0}")]
    InvalidMessages(String),
}
