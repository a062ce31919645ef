//! Grammar-constrained decoding: `GrammarSpec` (what a request asks for) compiles once per spec
//! into a `CompiledGrammar`, from which each request gets its own `Matcher` producing token masks.

use crate::lark;
use crate::vocab;
use crate::{GrammarError, MatchError};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::TokEnv;
use llguidance::ParserFactory;
use serde_json::Value as Json;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use tokenspeed_text::TextTokenizer;

/// What a request constrains its output to; one variant per request form (see lib.rs for the
/// mapping from OpenAI / SGLang / vLLM fields).
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (OpenAI `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON schema (`json_schema`, `guided_json`).
    JsonSchema(Json),
    /// A regex over the whole output, Rust `regex` syntax (`regex`, `guided_regex`).
    Regex(String),
    /// A grammar: Lark (llguidance's dialect) or GBNF/EBNF with `::=` rules and a `root` rule
    /// (`ebnf`, `guided_grammar`); the `::=` form is translated to Lark first.
    Grammar(String),
    /// Exactly one of these strings (`guided_choice`).
    Choice(Vec<String>),
    /// SGLang's `structural_tag`: free text with constrained sections after trigger strings.
    StructuralTag(Json),
}

impl GrammarSpec {
    /// The cache key: the kind plus the spec's canonical text. Schemas are keyed by their
    /// serialized form, so the same schema with keys in another order compiles again (rare, and
    /// harmless).
    fn cache_key(&self) -> String {
        match self {
            GrammarSpec::JsonObject => "json_object".into(),
            GrammarSpec::JsonSchema(s) => format!("json_schema\0{s}"),
            GrammarSpec::Regex(r) => format!("regex\0{r}"),
            GrammarSpec::Grammar(g) => format!("grammar\0{g}"),
            GrammarSpec::Choice(c) => format!("choice\0{}", Json::from(c.clone())),
            GrammarSpec::StructuralTag(t) => format!("structural_tag\0{t}"),
        }
    }

    /// llguidance's input for this spec, or the error naming why there is none.
    fn to_llguidance(&self, ws: &JsonWhitespace) -> Result<TopLevelGrammar, GrammarError> {
        Ok(match self {
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(ws.apply(serde_json::json!({"type": "object"})))
            }
            GrammarSpec::JsonSchema(schema) => {
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err(GrammarError::JsonSchema(format!(
                        "a schema is a JSON object (or true/false), got {}",
                        json_kind(schema)
                    )));
                }
                TopLevelGrammar::from_json_schema(ws.apply(schema.clone()))
            }
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Grammar(text) => TopLevelGrammar::from_lark(
                lark::grammar_to_lark(text).map_err(GrammarError::Grammar)?,
            ),
            GrammarSpec::Choice(choices) => TopLevelGrammar::from_lark(
                lark::choice_to_lark(choices).map_err(GrammarError::Choice)?,
            ),
            GrammarSpec::StructuralTag(tag) => TopLevelGrammar::from_lark(
                lark::structural_tag_to_lark(tag).map_err(GrammarError::StructuralTag)?,
            ),
        })
    }

    /// Wraps llguidance's compile error message in the variant naming this spec's kind.
    fn error(&self, message: String) -> GrammarError {
        match self {
            GrammarSpec::JsonObject | GrammarSpec::JsonSchema(_) => {
                GrammarError::JsonSchema(message)
            }
            GrammarSpec::Regex(_) => GrammarError::Regex(message),
            GrammarSpec::Grammar(_) => GrammarError::Grammar(message),
            GrammarSpec::Choice(_) => GrammarError::Choice(message),
            GrammarSpec::StructuralTag(_) => GrammarError::StructuralTag(message),
        }
    }
}

/// The whitespace JSON outputs may have between tokens (`--constrained-json-*` flags).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum JsonWhitespace {
    /// Any run of whitespace (llguidance's default; a small model can loop on it).
    #[default]
    Flexible,
    /// None: compact JSON.
    Compact,
    /// Runs matching this regex.
    Pattern(String),
}

impl JsonWhitespace {
    /// The schema with llguidance's options for this whitespace, unless it names its own.
    fn apply(&self, mut schema: Json) -> Json {
        let options = match self {
            JsonWhitespace::Flexible => return schema,
            JsonWhitespace::Compact => serde_json::json!({"whitespace_flexible": false}),
            JsonWhitespace::Pattern(p) => serde_json::json!({"whitespace_pattern": p}),
        };
        if let Some(obj) = schema.as_object_mut() {
            obj.entry("x-guidance").or_insert(options);
        }
        schema
    }
}

fn json_kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

/// End-of-text tokens assumed when the model directory names no eos id.
const FALLBACK_EOS_TOKENS: [&str; 6] = [
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
];

/// Compiled grammars kept by default; a schema is a few KB to a few MB compiled.
pub const DEFAULT_CACHE_CAPACITY: usize = 256;

/// Compiles grammar specs against one model's vocabulary and caches the results. One per model
/// (per engine); `compile` is safe to call from many threads.
pub struct GrammarCompiler {
    factory: ParserFactory,
    vocab_size: usize,
    eos_token_ids: Vec<u32>,
    json_whitespace: JsonWhitespace,
    cache: Mutex<GrammarCache>,
}

struct GrammarCache {
    capacity: usize,
    by_key: HashMap<String, Arc<CompiledGrammar>>,
    /// Insertion order, for evicting the oldest entry when full.
    order: VecDeque<String>,
}

impl GrammarCompiler {
    /// `vocab_size` is the model's (the logits' width); it may exceed the tokenizer's when the
    /// embedding is padded, and the padded ids are never allowed. Generation ends on the
    /// tokenizer's eos ids (generation_config's list).
    pub fn new(tokenizer: &TextTokenizer, vocab_size: usize) -> Result<Self, GrammarError> {
        Self::with_cache_capacity(tokenizer, vocab_size, DEFAULT_CACHE_CAPACITY)
    }

    pub fn with_cache_capacity(
        tokenizer: &TextTokenizer,
        vocab_size: usize,
        capacity: usize,
    ) -> Result<Self, GrammarError> {
        let mut eos_ids = tokenizer.eos_token_ids().to_vec();
        if eos_ids.is_empty() {
            // A bare tokenizer.json (no generation_config): the usual end-of-text tokens, when
            // they are special tokens (Qwen2's vocab has "</s>" as plain text).
            let added = tokenizer.hf_tokenizer().get_added_tokens_decoder();
            eos_ids = FALLBACK_EOS_TOKENS
                .iter()
                .filter_map(|t| tokenizer.token_to_id(t))
                .filter(|id| added.get(id).is_some_and(|a| a.special))
                .collect();
        }
        let env: TokEnv = vocab::tok_env(tokenizer.hf_tokenizer(), vocab_size, &eos_ids)?;
        let eos_token_ids = env.tok_trie().eos_tokens().to_vec();
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        // Errors travel back as values; nothing should print to the server's stderr.
        factory.quiet();
        Ok(Self {
            factory,
            vocab_size,
            eos_token_ids,
            json_whitespace: JsonWhitespace::default(),
            cache: Mutex::new(GrammarCache {
                capacity: capacity.max(1),
                by_key: HashMap::new(),
                order: VecDeque::new(),
            }),
        })
    }

    /// JSON outputs (schemas, json_object) keep to this whitespace; set before compiling.
    pub fn with_json_whitespace(mut self, ws: JsonWhitespace) -> Self {
        self.json_whitespace = ws;
        self
    }

    /// The logits' width the masks cover.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The ids a finished grammar allows (and that end an accepting one): the tokenizer's eos
    /// ids, or the usual end-of-text tokens when the model directory names none.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Words of a bitmask row: 32 token ids per `u32`.
    pub fn bitmask_words(&self) -> usize {
        self.vocab_size.div_ceil(32)
    }

    /// The compiled grammar for `spec`, from the cache when this spec was compiled before.
    /// Compiling takes from under a millisecond (a regex) to tens of milliseconds (a large
    /// schema): call it off the engine thread, before the request is admitted.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Arc<CompiledGrammar>, GrammarError> {
        let key = spec.cache_key();
        if let Some(hit) = self.lock_cache().by_key.get(&key) {
            return Ok(hit.clone());
        }
        // Compiled outside the lock: two threads compiling one new spec both succeed, one
        // result is kept.
        let compiled = Arc::new(self.compile_uncached(spec)?);
        let mut cache = self.lock_cache();
        if !cache.by_key.contains_key(&key) {
            if cache.by_key.len() >= cache.capacity {
                if let Some(oldest) = cache.order.pop_front() {
                    cache.by_key.remove(&oldest);
                }
            }
            cache.order.push_back(key.clone());
            cache.by_key.insert(key, compiled.clone());
        }
        Ok(compiled)
    }

    /// Number of grammars in the cache.
    pub fn cached(&self) -> usize {
        self.lock_cache().by_key.len()
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, GrammarCache> {
        // A panic while holding the lock leaves a consistent map (inserts are single calls).
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn compile_uncached(&self, spec: &GrammarSpec) -> Result<CompiledGrammar, GrammarError> {
        let grammar = spec.to_llguidance(&self.json_whitespace)?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| spec.error(e.to_string()))?;
        let mut template = llguidance::Matcher::new(Ok(parser));
        // Some problems (an unsatisfiable schema, a regex matching nothing) only show when the
        // first mask is computed: find them now, so they are a 400 and not a failed request.
        // This also warms the lexer cache every request's matcher starts from.
        template
            .compute_mask()
            .map_err(|e| spec.error(e.to_string()))?;
        Ok(CompiledGrammar {
            template,
            vocab_size: self.vocab_size,
        })
    }
}

/// A grammar compiled for one vocabulary; shared (`Arc`) by every request using the same spec.
pub struct CompiledGrammar {
    /// A matcher at the start of the output; each request's matcher is a copy of it.
    template: llguidance::Matcher,
    vocab_size: usize,
}

impl CompiledGrammar {
    /// A fresh matcher at the start of the output, for one request: a copy of the parser state
    /// (under 1 µs, no compilation) that shares the grammar's lexer cache with every other
    /// request of this grammar, behind llguidance's lock. Measured (benches/mask.rs), sharing
    /// beats llguidance's `deep_clone` (25 µs, a private cold cache): at batch 64 the median
    /// step took 0.9 ms instead of 4.1 ms sequentially, and parallel (rayon) steps still gain.
    pub fn matcher(&self) -> Matcher {
        Matcher {
            inner: self.template.clone(),
            vocab_size: self.vocab_size,
        }
    }
}

/// One request's position in its grammar. Not shared: the engine owns it with the request.
pub struct Matcher {
    inner: llguidance::Matcher,
    vocab_size: usize,
}

impl Matcher {
    /// Writes the next token's mask into `bitmask` (bit `i % 32` of word `i / 32` set = id `i`
    /// allowed; the layout xgrammar and vLLM's samplers use). Ids past the tokenizer's vocab are
    /// never allowed. Once the grammar is finished the mask allows only the eos ids, so a request
    /// that runs on ends cleanly. Words past the vocab are zeroed.
    pub fn fill_next_token_bitmask(&mut self, bitmask: &mut [u32]) -> Result<(), MatchError> {
        let needed = self.vocab_size.div_ceil(32);
        if bitmask.len() < needed {
            return Err(MatchError::BitmaskTooSmall {
                got: bitmask.len(),
                needed,
                vocab_size: self.vocab_size,
            });
        }
        let mask = self
            .inner
            .compute_mask_or_eos()
            .map_err(|e| MatchError::Matcher(e.to_string()))?;
        let words = mask.as_slice();
        let n = words.len().min(needed);
        bitmask[..n].copy_from_slice(&words[..n]);
        bitmask[n..].fill(0);
        Ok(())
    }

    /// Advances past the sampled `token`. A token the mask did not allow is an error.
    pub fn consume_token(&mut self, token: u32) -> Result<(), MatchError> {
        self.inner
            .consume_token(token)
            .map_err(|e| MatchError::TokenRejected {
                token,
                message: e.to_string(),
            })
    }

    /// Whether the output is complete: nothing but eos may follow. The engine can finish the
    /// request now (finish_reason "stop") without sampling the eos.
    pub fn is_finished(&self) -> bool {
        self.inner.is_stopped()
    }

    /// Whether eos is allowed now (the output so far is a complete match).
    pub fn is_accepting(&mut self) -> bool {
        self.inner.is_accepting().unwrap_or(false)
    }

    /// Undoes the last `n` consumed tokens (speculative decoding's rejected drafts, or a
    /// retracted step).
    pub fn rollback(&mut self, n: usize) -> Result<(), MatchError> {
        self.inner
            .rollback(n)
            .map_err(|e| MatchError::Matcher(e.to_string()))
    }

    /// Tokens the grammar forces next (e.g. the rest of a fixed key): they could be appended
    /// without sampling ("jump forward"). Not consumed.
    pub fn forced_tokens(&mut self) -> Vec<u32> {
        self.inner.compute_ff_tokens()
    }

    /// The matcher's error, if one step failed (it stays failed).
    pub fn error(&self) -> Option<String> {
        self.inner.get_error()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The compiler and compiled grammars are shared across the HTTP and engine threads; a
    /// matcher moves to whichever thread computes its mask.
    #[test]
    fn types_cross_threads() {
        fn shared<T: Send + Sync>() {}
        fn sent<T: Send>() {}
        shared::<GrammarCompiler>();
        shared::<CompiledGrammar>();
        sent::<Matcher>();
    }
}
