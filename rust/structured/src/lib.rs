//! Structured outputs: grammar-constrained token masks (llguidance), tool-call parsers and
//! reasoning parsers. Pure, synchronous types: no threads, sockets or GPU; the server and the
//! engine wire them in.
//!
//! # Grammars: from a request to a mask
//!
//! Request fields map to one [`GrammarSpec`]:
//!
//! | request field | spec |
//! |---|---|
//! | OpenAI `response_format: {"type": "json_object"}` | `JsonObject` |
//! | OpenAI `response_format: {"type": "json_schema", "json_schema": {"schema": S}}`, SGLang `json_schema`, vLLM `guided_json` / `structured_outputs.json` | `JsonSchema(S)` |
//! | SGLang `regex`, vLLM `guided_regex` / `structured_outputs.regex` | `Regex` |
//! | SGLang `ebnf`, vLLM `guided_grammar` / `structured_outputs.grammar` (GBNF `::=` or Lark) | `Grammar` |
//! | vLLM `guided_choice` / `structured_outputs.choice` | `Choice` |
//! | SGLang `structural_tag` (`structures` + `triggers` form) | `StructuralTag` |
//!
//! One [`GrammarCompiler`] per model (`GrammarCompiler::new(&text_tokenizer, model_vocab_size)`;
//! the model's vocab may be padded past the tokenizer's, padded ids are never allowed).
//! `compile(&spec)` returns a cached `Arc<CompiledGrammar>` or a [`GrammarError`] whose message
//! names the problem: call it in the HTTP handler's validation stage (on the blocking pool: a
//! large schema takes tens of ms the first time), so an invalid schema is a 400 before the
//! request reaches the scheduler and before any KV page is spent. The request then carries the
//! `Arc<CompiledGrammar>`; the engine calls `compiled.matcher()` when it admits the request and
//! owns that [`Matcher`] with the request's state.
//!
//! # Where masks are computed, relative to the GPU step
//!
//! A mask row is `GrammarCompiler::bitmask_words()` `u32`s (32 ids per word, bit set = allowed,
//! xgrammar's and vLLM's layout); a step's mask is one row per grammar request, with the rows'
//! slot indices. The sampler applies it to the logits (`-inf` where the bit is clear) before
//! temperature/top-k/top-p. Per token, for each grammar request: `consume_token(sampled)` when
//! the step's result arrives, then `fill_next_token_bitmask(row)` for the next step. Rows are
//! independent, but matchers of one grammar share its lexer cache behind a lock: computing a
//! batch's rows with rayon scaled on the benchmark yet slowed serving on the H100 box (the
//! engine computes them one by one; see `rust/server/src/engine/grammar.rs`).
//! Costs on the Llama-3 vocab (128k ids) for a realistic JSON schema (`benches/mask.rs`, a
//! loaded 2-core dev box): median ~16-20 µs per mask, mean ~100 µs (the first masks of a new
//! grammar build lexer states and take up to ~0.6 ms), compile ~2 ms uncached, a matcher < 1 µs.
//!
//! # Grammar requests and one-step-ahead scheduling
//!
//! Without a grammar, plan N+1 is sent while step N runs: its inputs are "the token step N
//! samples", resolved on the GPU, and the CPU never waits. A grammar request's *mask* for step
//! N+1 depends on the token step N samples, which the CPU only learns when result N arrives, so
//! the mask cannot ride in plan N+1 when that plan is sent early. Its *input* still can. So
//! (as built in `rust/server/src/engine/grammar.rs` and `python/tokenspeed/worker/loop.py`):
//!
//! 1. Plan N+1 is built and sent as for any request; its mask row for such a request is
//!    *pending* (empty).
//! 2. When result N arrives, the engine thread consumes the tokens, computes the pending rows
//!    and sends them as plan N+1's *mask completion* (a plan with the same step
//!    id carrying only masks), before scheduling plan N+2.
//! 3. The worker runs step N+1's forward pass, sends result N, then waits for the completion
//!    before sampling. The GPU waits only when the masks take longer than a forward pass.
//!
//! The same idea is SGLang's overlap scheduler (its forward thread waits on a "sampling info
//! done" event before sampling grammar batches). Measured on an H100 (Llama-3.1-8B shape): +0.8%
//! per token at batch 1 (benches/diagnostics/grammar_bench.py).
//!
//! Finishing: after `consume_token`, `is_finished()` means only eos can follow: finish the
//! request now (finish_reason "stop"). Step N+1 already has it in flight, exactly as for a request
//! that hit a stop string: discard that token. (Its mask row, if computed, allows only eos.)
//! A request that hits `max_tokens` first ends with an incomplete output ("length"), as in vLLM.
//! A `MatchError` ends only its request (finish_reason "error"), never the batch. Retraction or
//! speculative decoding: `rollback(n)` undoes consumed tokens.
//!
//! Reasoning models: with a reasoning parser, the grammar applies after the reasoning ends. The
//! engine feeds the matcher nothing, and masks nothing, until the think-end token id (e.g.
//! `</think>`, looked up with `TextTokenizer::token_to_id`) is sampled; from the next token on the
//! request is a grammar request.

//!
//! # Tool calls and reasoning: a named stage after stop matching
//!
//! Per response, after the detokenizer and stop matching (so text past a stop string never
//! reaches them): the reasoning parser first (`ReasoningFormat::stream(enable_thinking)`), its
//! `content` then through the tool-call parser (`ToolCallFormat::stream()`); non-streaming
//! responses call `parse` on the final text. Both are pure and chunk-independent: streamed
//! deltas concatenate to the non-streamed result. Tool-call markers that are special tokens
//! (`<|python_tag|>`, `[TOOL_CALLS]`) only reach the parser when the request detokenizes with
//! special tokens kept, so keep them when `tools` are given. The API layer adds the call ids
//! (`call_...`), `type: "function"`, `finish_reason: "tool_calls"` when there are calls, and
//! maps empty `content` / `reasoning_content` to null. GPT-OSS's harmony output is the exception
//! to the two stages: reasoning, answer and calls are channels of one text, read together by
//! [`harmony`] (`harmony::stream(calls)` / `harmony::parse`).
//!
//! `tool_choice`: "none" skips the tool parser (and leaves tools out of the template if the
//! API says so); "auto" runs it as above; "required" and a named function are enforced with a
//! grammar (`tool_call::forced`), as vLLM does: "required" compiles
//! `forced::required_schema(tools, parallel_tool_calls)` and parses the output with
//! `ToolCallFormat::JsonArray`; a named function compiles `forced::named_schema(tools, name)`
//! and the whole output is that call's arguments (stream the name first, then each text delta as
//! an argument fragment). Either way the arguments always parse against the function's schema.

mod error;
mod grammar;
pub mod harmony;
mod json_scan;
mod lark;
pub mod reasoning;
pub mod tool_call;
mod vocab;

pub use error::{GrammarError, MatchError};
pub use grammar::{
    CompiledGrammar, GrammarCompiler, GrammarSpec, JsonWhitespace, Matcher, DEFAULT_CACHE_CAPACITY,
};
pub use harmony::{HarmonyDelta, HarmonyMessage, HarmonyStream};
pub use reasoning::{ReasoningFormat, ReasoningOutput, ReasoningStream};
pub use tool_call::{
    ParsedToolCalls, ToolCall, ToolCallDelta, ToolCallFormat, ToolCallStream, ToolStreamDelta,
};
