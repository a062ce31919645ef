//! Structured output on the request path: a request's grammar (`validate::grammar` maps the
//! request forms to one `GrammarSpec`) compiled, cached per spec, before the request reaches the
//! engine, so an invalid schema is a 400 naming its field before any KV page is spent.

use std::sync::Arc;

use serde_json::Value;
use tokenspeed_engine::{grammar_kind, MAX_GRAMMAR_STOP_IDS, MAX_GRAMMAR_TEXT};
use tokenspeed_structured::{CompiledGrammar, GrammarCompiler, GrammarSpec};

use crate::error::RequestError;

/// A request's grammar and the field it came from (named in its errors).
#[derive(Debug, Clone, PartialEq)]
pub struct GrammarRequest {
    pub spec: GrammarSpec,
    pub field: &'static str,
}

/// Why a request's grammar cannot be used, in the compiler's terms (`validate::refusals`
/// decides what the client is told). `field` is the request field the grammar came from.
#[derive(Debug)]
pub enum GrammarError {
    /// No grammar backend (`--grammar-backend none`).
    Disabled { field: &'static str },
    /// The compiler refused the grammar.
    Invalid {
        field: &'static str,
        message: String,
    },
    /// `allowed_token_ids` under `--grammar-backend xgrammar`.
    TokenIdsNeedLlguidance,
    /// Over `MAX_GRAMMAR_TEXT` bytes, for a worker-side backend.
    TooLongForWorker { field: &'static str, bytes: usize },
}

/// Compiles (or finds cached) the request's grammar, off the async threads: a large schema
/// takes tens of milliseconds the first time.
pub async fn compile(
    compiler: Option<&Arc<GrammarCompiler>>,
    request: &GrammarRequest,
) -> Result<Arc<CompiledGrammar>, RequestError> {
    let Some(compiler) = compiler.cloned() else {
        return Err(GrammarError::Disabled {
            field: request.field,
        }
        .into());
    };
    let spec = request.spec.clone();
    let compiled = tokio::task::spawn_blocking(move || compiler.compile(&spec))
        .await
        .map_err(|e| RequestError::internal(format!("grammar compilation panicked: {e}")))?;
    compiled.map_err(|e| {
        if e.is_client_error() {
            GrammarError::Invalid {
                field: request.field,
                message: e.to_string(),
            }
            .into()
        } else {
            RequestError::internal(e.to_string())
        }
    })
}

/// A request's grammar as a worker-side backend reads it (the plan's `GrammarRow`).
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerGrammar {
    /// `grammar_kind::*`.
    pub kind: u8,
    pub text: String,
    /// What a finished grammar allows: the model's eos ids (as llguidance's masks do).
    pub stop_ids: Vec<u32>,
}

/// The spec in the form `--grammar-backend xgrammar` compiles on the worker. Same spec, same
/// meaning: only where its masks are computed changes. A grammar over `MAX_GRAMMAR_TEXT`
/// bytes is a 400 for this backend only (the plan's slot size is bounded by it).
pub fn worker_grammar(
    request: &GrammarRequest,
    eos_token_ids: &[u32],
) -> Result<WorkerGrammar, RequestError> {
    if request.field == "allowed_token_ids" {
        // Written as llguidance's token-id ranges, which xgrammar does not read.
        return Err(GrammarError::TokenIdsNeedLlguidance.into());
    }
    let (kind, text) = match &request.spec {
        GrammarSpec::JsonObject => (grammar_kind::JSON_SCHEMA, r#"{"type":"object"}"#.into()),
        GrammarSpec::JsonSchema(s) => (grammar_kind::JSON_SCHEMA, s.to_string()),
        GrammarSpec::Regex(r) => (grammar_kind::REGEX, r.clone()),
        GrammarSpec::Grammar(g) => (grammar_kind::GRAMMAR, g.clone()),
        GrammarSpec::Choice(c) => (grammar_kind::CHOICE, Value::from(c.clone()).to_string()),
        GrammarSpec::StructuralTag(t) => (grammar_kind::STRUCTURAL_TAG, t.to_string()),
    };
    if text.len() > MAX_GRAMMAR_TEXT {
        return Err(GrammarError::TooLongForWorker {
            field: request.field,
            bytes: text.len(),
        }
        .into());
    }
    Ok(WorkerGrammar {
        kind,
        text,
        stop_ids: eos_token_ids
            .iter()
            .copied()
            .take(MAX_GRAMMAR_STOP_IDS)
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_grammars_carry_each_kind_and_refuse_oversized_text() {
        let req = |spec| GrammarRequest {
            spec,
            field: "guided_regex",
        };
        let choice =
            worker_grammar(&req(GrammarSpec::Choice(vec!["a\"b".into()])), &[7]).expect("fits");
        assert_eq!(choice.kind, grammar_kind::CHOICE);
        assert_eq!(
            serde_json::from_str::<Vec<String>>(&choice.text).expect("json"),
            ["a\"b"]
        );
        assert_eq!(choice.stop_ids, [7]);
        let object = worker_grammar(&req(GrammarSpec::JsonObject), &[]).expect("fits");
        assert_eq!(object.kind, grammar_kind::JSON_SCHEMA);
        let big = GrammarSpec::Regex("a".repeat(MAX_GRAMMAR_TEXT + 1));
        let err = worker_grammar(&req(big), &[]).expect_err("too long");
        assert_eq!(err.param(), Some("guided_regex"));
    }
}
