//! Text side of serving: tokenizer loading, chat templates, incremental detokenizing, stop strings.
//!
//! Workers only ever see token ids; everything that touches text lives here. All types are plain
//! synchronous values so the HTTP layer can share a `TextTokenizer` behind an `Arc` and keep one
//! `IncrementalDetokenizer` + `StopMatcher` per request.

mod chat;
mod detokenizer;
mod error;
mod jinja_compat;
mod stop;
mod stop_regex;
mod tokenizer;

pub use detokenizer::IncrementalDetokenizer;
pub use error::TextError;
pub use stop::{StopMatcher, StopStep};
pub use stop_regex::StopRegex;
pub use tokenizer::TextTokenizer;
