//! A request's journey, shared by every generating endpoint:
//! prepare (tokenize: `prompt.rs`; validate) → submit to the engine → stream back text chunks
//! (incremental detokenization, stop strings held back until they can't match).

use std::sync::Arc;
use std::time::Instant;

use opentelemetry::KeyValue;
use serde_json::Value;
use tokenspeed_engine::scheduler::{FinishReason, Request, RequestId};
use tokenspeed_engine::{KvTransfer, SamplingParams};
use tokenspeed_text::{IncrementalDetokenizer, StopMatcher, StopStep, TextTokenizer};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::constraint::GrammarRequest;
use crate::engine::{Constraint, EngineEvent, EngineHandle, StopSignal, TokenEvent, TokenUsage};
use crate::error::RequestError;
use crate::frontend::Frontend;
use crate::otel::{DetokenizeSpan, RequestTrace};
use crate::prompt::tokenize_prompt;
pub use crate::prompt::Prompt;

#[derive(Debug, Clone)]
pub struct GenerationSpec {
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    /// None: up to the context length.
    pub max_new_tokens: Option<u32>,
    /// No stop ends the request before this many tokens.
    pub min_new_tokens: u32,
    pub stop: Vec<String>,
    pub stop_regex: Vec<tokenspeed_text::StopRegex>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub skip_special_tokens: bool,
    /// vLLM's: false joins adjacent added tokens without the decoder's separator (see
    /// `IncrementalDetokenizer::spaces_between_special_tokens`).
    pub spaces_between_special_tokens: bool,
    /// vLLM's: a matched stop string stays at the end of the text.
    pub include_stop_str_in_output: bool,
    /// Top alternatives per generated token (the worker's `top_logprobs` is the larger of this
    /// and `prompt_logprobs`; each list is cut to what was asked for).
    pub top_logprobs: u32,
    /// Prompt logprobs with this many top alternatives each (vLLM's `prompt_logprobs`).
    pub prompt_logprobs: Option<u32>,
    /// Structured output: the grammar the generated text follows.
    pub grammar: Option<GrammarRequest>,
    /// The grammar starts after this token (a reasoning model's think-end), if set.
    pub grammar_starts_after: Option<u32>,
    /// Admission priority (`validate::priority`); 0 is neutral.
    pub priority: i64,
    /// vLLM's `truncate_prompt_tokens`: the prompt's last tokens kept.
    pub truncate_prompt: Option<crate::validate::Truncation>,
    /// Prefill/decode disaggregation: the KV transfer the router named (`bootstrap_room`).
    pub kv_transfer: KvTransfer,
}

#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
    /// 1-based rank of `token` in its distribution, when the worker computed it (prompt
    /// tokens only: vLLM's `prompt_logprobs` entries carry it).
    pub rank: Option<u32>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Finish {
    /// "stop" or "length" (OpenAI's values).
    pub reason: &'static str,
    /// The stop string or stop token that ended it, if any.
    pub matched: Option<Value>,
}

/// A piece of the answer: new text and the tokens behind it.
#[derive(Debug, Clone, Default)]
pub struct Chunk {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    /// With prompt logprobs, on the first chunk: one per prompt token after the first.
    pub prompt_logprobs: Vec<TokenLogprob>,
    pub finish: Option<Finish>,
    pub usage: TokenUsage,
}

/// Aborts the engine request if the generation is dropped before it finished (client
/// disconnect): its slot and KV pages are freed. `engine` is the data-parallel replica that
/// owns the request; `_load` counts it there until dropped.
struct AbortGuard {
    engine: EngineHandle,
    id: RequestId,
    stop: StopSignal,
    done: bool,
    _load: crate::replicas::LoadTicket,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.done {
            self.engine.abort(self.id);
        }
    }
}

pub struct Generation {
    pub prompt_ids: Vec<u32>,
    /// The most tokens it may generate (`max_tokens`, or the room left in the context).
    pub max_new_tokens: u32,
    tokenizer: Arc<TextTokenizer>,
    events: UnboundedReceiver<EngineEvent>,
    detok: IncrementalDetokenizer,
    stops: StopMatcher,
    guard: AbortGuard,
    finished: bool,
    include_stop_str: bool,
    top_logprobs: usize,
    prompt_top: usize,
    /// Prompt logprobs received so far (they come before the first token).
    prompt_logprobs: Vec<TokenLogprob>,
    /// A chunk already taken from the engine (by `start_choices`), returned by the next `next`.
    pending: Option<Chunk>,
    /// `--enable-trace`: the time spent detokenizing, recorded as a span when it is dropped.
    detok_span: Option<Box<DetokenizeSpan>>,
}

/// Generates one greedy token for `prompt` and waits for it: the probe behind the warm-up and
/// `/health_generate`, proving the whole path (tokenizer, scheduler, shm, worker) works.
/// `replica`: the data-parallel replica to probe (None: wherever the router sends it).
pub async fn probe(
    fe: &Frontend,
    prompt: Prompt,
    timeout: std::time::Duration,
    replica: Option<usize>,
) -> Result<(), RequestError> {
    let spec = GenerationSpec {
        prompt,
        sampling: SamplingParams::greedy(),
        max_new_tokens: Some(1),
        min_new_tokens: 0,
        stop: vec![],
        stop_regex: vec![],
        stop_token_ids: vec![],
        ignore_eos: true,
        skip_special_tokens: true,
        spaces_between_special_tokens: true,
        include_stop_str_in_output: false,
        top_logprobs: 0,
        prompt_logprobs: None,
        grammar: None,
        grammar_starts_after: None,
        priority: 0,
        truncate_prompt: None,
        kv_transfer: KvTransfer::None,
    };
    if fe.config.is_embedding {
        let run = crate::pooling::probe(fe, spec.prompt, replica);
        return match tokio::time::timeout(timeout, run).await {
            Ok(result) => result,
            Err(_) => Err(RequestError::unavailable(format!(
                "a pooling request did not finish within {}s",
                timeout.as_secs()
            ))),
        };
    }
    let id = new_request_id();
    let run = async { start_on(fe, id, spec, replica).await?.collect().await };
    match tokio::time::timeout(timeout, run).await {
        Ok(result) => result.map(|_| ()),
        Err(_) => Err(RequestError::unavailable(format!(
            "a one-token generation did not finish within {}s",
            timeout.as_secs()
        ))),
    }
}

/// A new API request's id: a random (v4) UUID, in the logs, the engine and the response `id`.
pub fn new_request_id() -> RequestId {
    RequestId::new(uuid::Uuid::new_v4().as_u128())
}

/// Tokenizes and validates, then hands the request to the engine (the replica the router picks)
/// under `id`.
pub async fn start(
    fe: &Frontend,
    id: RequestId,
    spec: GenerationSpec,
) -> Result<Generation, RequestError> {
    start_on(fe, id, spec, None).await
}

async fn start_on(
    fe: &Frontend,
    id: RequestId,
    spec: GenerationSpec,
    replica: Option<usize>,
) -> Result<Generation, RequestError> {
    // The server span's context rides on the handler's future (`http/trace.rs`).
    let trace = fe
        .tracer
        .as_ref()
        .and_then(|t| RequestTrace::of(t, &opentelemetry::Context::current()));
    let tokenizing = trace.as_ref().map(|_| Instant::now());
    let budgeted = budgeted_prompt(fe, &spec).await;
    if let (Some(t), Some(start)) = (&trace, tokenizing) {
        let tokens = budgeted.as_ref().map_or(0, |(p, _)| p.len() as i64);
        let attrs = vec![KeyValue::new("tokenspeed.prompt_tokens", tokens)];
        t.span("tokenize", start, Instant::now(), attrs);
    }
    let (prompt_ids, mut max_new_tokens) = budgeted?;
    let mut min_new_tokens = spec.min_new_tokens;
    if let KvTransfer::Send { .. } = spec.kv_transfer {
        // A prefill server computes the prompt and its first token; the decode server the rest.
        (max_new_tokens, min_new_tokens) = (1, 0);
    }
    // Compiled before submitting: an invalid grammar is a 400 before any KV is spent.
    let constraint = compile_constraint(fe, &spec).await?;
    let request = Request {
        id,
        prompt: prompt_ids.clone(),
        sampling: spec.sampling,
        max_new_tokens,
        min_new_tokens,
        stop_token_ids: spec.stop_token_ids,
        eos_token_ids: fe.tokenizer.eos_token_ids().to_vec(),
        ignore_eos: spec.ignore_eos,
        priority: spec.priority,
        kv_transfer: spec.kv_transfer,
    };
    fe.metrics
        .counters
        .prompt_tokens
        .inc_by(prompt_ids.len() as u64);
    let dispatched = fe
        .engine
        .dispatch_traced(request, constraint, replica, trace.clone())
        .await;
    let events = dispatched.events;
    if fe.config.log_requests {
        tracing::info!(
            id = %id,
            prompt_tokens = prompt_ids.len(),
            max_new_tokens,
            "request"
        );
    }
    let detok = IncrementalDetokenizer::with_prompt(spec.skip_special_tokens, &prompt_ids)
        .spaces_between_special_tokens(spec.spaces_between_special_tokens);
    Ok(Generation {
        prompt_ids,
        max_new_tokens,
        tokenizer: fe.tokenizer.clone(),
        events,
        detok,
        stops: StopMatcher::new(spec.stop).with_regexes(spec.stop_regex),
        guard: AbortGuard {
            engine: dispatched.owner,
            id,
            stop: dispatched.stop,
            done: false,
            _load: dispatched.load,
        },
        finished: false,
        include_stop_str: spec.include_stop_str_in_output,
        top_logprobs: spec.top_logprobs as usize,
        prompt_top: spec.prompt_logprobs.unwrap_or(0) as usize,
        prompt_logprobs: Vec::new(),
        pending: None,
        detok_span: trace.map(DetokenizeSpan::new),
    })
}

/// The prompt's tokens (truncated as the request asked) and the tokens it may generate, checked
/// against the context length.
async fn budgeted_prompt(
    fe: &Frontend,
    spec: &GenerationSpec,
) -> Result<(Vec<u32>, u32), RequestError> {
    let mut prompt_ids = tokenize_prompt(fe, spec.prompt.clone()).await?;
    crate::validate::truncate_prompt(
        &mut prompt_ids,
        spec.truncate_prompt,
        fe.config.scheduler.context_length,
        spec.max_new_tokens,
    );
    let max_new_tokens = crate::validate::prompt_budget(
        &prompt_ids,
        fe.tokenizer.vocab_size() as u32,
        fe.config.scheduler.context_length,
        spec.max_new_tokens,
        spec.min_new_tokens,
    )?;
    Ok((prompt_ids, max_new_tokens))
}

/// The request's grammar, compiled (and, with `--grammar-backend xgrammar`, what the worker
/// compiles itself).
async fn compile_constraint(
    fe: &Frontend,
    spec: &GenerationSpec,
) -> Result<Option<Constraint>, RequestError> {
    let grammar = spec.grammar.clone().map(|g| {
        crate::validate::grammar::close_objects(
            g,
            fe.config.constrained_json_allow_additional_properties,
        )
    });
    Ok(match &grammar {
        Some(g) => Some(Constraint {
            grammar: crate::constraint::compile(fe.grammar.as_ref(), g).await?,
            starts_after: spec.grammar_starts_after,
            worker: match fe.config.grammar_backend.as_deref() {
                Some("xgrammar") => Some(crate::constraint::worker_grammar(
                    g,
                    fe.grammar.as_ref().map_or(&[], |c| c.eos_token_ids()),
                )?),
                _ => None,
            },
        }),
        None => None,
    })
}

impl Generation {
    pub fn id(&self) -> RequestId {
        self.guard.id
    }

    /// The next chunk of the answer; None after the finishing chunk.
    pub async fn next(&mut self) -> Option<Result<Chunk, RequestError>> {
        if let Some(chunk) = self.pending.take() {
            return Some(Ok(chunk));
        }
        if self.finished {
            return None;
        }
        let token = match self.recv_token().await {
            Ok(t) => t,
            Err(e) => return Some(Err(e)),
        };
        if self.detok_span.is_none() {
            return Some(self.render(token));
        }
        let (start, tokens) = (Instant::now(), token.tokens.len());
        let chunk = self.render(token);
        if let Some(span) = self.detok_span.as_mut() {
            span.add(start, Instant::now(), tokens);
        }
        Some(chunk)
    }

    /// The text of an engine event's tokens (stop strings held back and matched), as a chunk.
    fn render(&mut self, token: TokenEvent) -> Result<Chunk, RequestError> {
        let mut chunk = Chunk {
            usage: token.usage,
            prompt_logprobs: std::mem::take(&mut self.prompt_logprobs),
            ..Chunk::default()
        };
        let n = token.tokens.len();
        for (i, &id) in token.tokens.iter().enumerate() {
            chunk.token_ids.push(id);
            chunk.logprobs.push(TokenLogprob {
                token: id,
                logprob: token.logprobs.get(i).copied().unwrap_or(f32::NAN),
                top: cut(token.top_logprobs.get(i), self.top_logprobs),
                rank: None,
            });
            let piece = match self.detok.push(&self.tokenizer, id) {
                Ok(p) => p,
                Err(e) => return Err(RequestError::internal(format!("detokenizer: {e}"))),
            };
            let step = self.stops.push(&piece);
            chunk.text.push_str(&step.emit);
            if step.stopped {
                self.finished = true;
                // Only this side sees text: tell the engine, which ends every request, that a
                // stop string ended this one after `generated` tokens. Usage counts those.
                let generated = token.usage.completion_tokens - (n - i - 1) as u32;
                chunk.usage.completion_tokens = generated;
                if i + 1 < n || token.finish.is_none() {
                    let g = &self.guard;
                    g.engine.stop_matched(g.id, &g.stop, generated);
                }
                self.guard.done = true;
                self.stop_at(&mut chunk, step);
                return Ok(chunk);
            }
        }
        if let Some(reason) = token.finish {
            self.finished = true;
            self.guard.done = true;
            if let Ok(rest) = self.detok.finish(&self.tokenizer) {
                let step = self.stops.push(&rest);
                chunk.text.push_str(&step.emit);
                if step.stopped {
                    self.stop_at(&mut chunk, step);
                    return Ok(chunk);
                }
            }
            chunk.text.push_str(&self.stops.finish());
            chunk.finish = Some(Finish {
                reason: reason.api_name(),
                // A stop token is the one matched; a completed grammar (or an ending this
                // side did not cause) matched nothing.
                matched: (reason == FinishReason::Stop)
                    .then(|| token.tokens.last().map(|&t| Value::from(t)))
                    .flatten(),
            });
            return Ok(chunk);
        }
        Ok(chunk)
    }

    /// The engine's next event with tokens or a finish (prompt logprobs kept on the way).
    async fn recv_token(&mut self) -> Result<TokenEvent, RequestError> {
        loop {
            let event = match self.events.recv().await {
                Some(e) => e,
                None => {
                    self.finished = true;
                    return Err(RequestError::unavailable("the engine dropped the request"));
                }
            };
            match event {
                EngineEvent::Token(t) => {
                    self.take_prompt_logprobs(&t);
                    if !t.tokens.is_empty() || t.finish.is_some() {
                        return Ok(t);
                    }
                }
                EngineEvent::Error { message, kind } => {
                    self.finished = true;
                    self.guard.done = true;
                    return Err(RequestError::from_engine(kind, message));
                }
            }
        }
    }

    /// Ends `chunk` at the stop string (or regex) `step` matched (its text kept with
    /// `include_stop_str_in_output`).
    fn stop_at(&self, chunk: &mut Chunk, step: StopStep) {
        if self.include_stop_str {
            chunk.text.push_str(&step.matched_text);
        }
        chunk.finish = Some(Finish {
            reason: "stop",
            matched: step.matched.map(Value::String),
        });
    }

    /// Keeps an event's prompt logprobs, each for the next prompt token (the first has none).
    fn take_prompt_logprobs(&mut self, t: &TokenEvent) {
        for (i, &logprob) in t.prompt_logprobs.iter().enumerate() {
            let Some(&token) = self.prompt_ids.get(1 + self.prompt_logprobs.len()) else {
                break;
            };
            self.prompt_logprobs.push(TokenLogprob {
                token,
                logprob,
                top: cut(t.prompt_top_logprobs.get(i), self.prompt_top),
                rank: t.prompt_ranks.get(i).copied(),
            });
        }
    }

    /// Runs to the end and gathers every chunk into one.
    pub async fn collect(mut self) -> Result<Chunk, RequestError> {
        let mut all = Chunk::default();
        while let Some(chunk) = self.next().await {
            let chunk = chunk?;
            all.text.push_str(&chunk.text);
            all.token_ids.extend(chunk.token_ids);
            all.logprobs.extend(chunk.logprobs);
            all.prompt_logprobs.extend(chunk.prompt_logprobs);
            all.usage = chunk.usage;
            all.finish = chunk.finish;
        }
        if all.usage.prompt_tokens == 0 {
            all.usage.prompt_tokens = self.prompt_ids.len() as u32;
        }
        Ok(all)
    }
}

/// The first `k` of a top-logprobs list.
fn cut(top: Option<&Vec<(u32, f32)>>, k: usize) -> Vec<(u32, f32)> {
    top.map(|t| t.iter().take(k).copied().collect())
        .unwrap_or_default()
}

/// The choices of one API request: `n` samples of each prompt, choice `i * n + j` being sample
/// `j` of prompt `i` (OpenAI's indexing).
pub struct Choices {
    pub gens: Vec<Generation>,
    /// Per prompt: its token ids (echo, usage).
    pub prompts: Vec<Vec<u32>>,
    pub n: usize,
}

/// Starts every choice. Each prompt's first sample runs alone until its first token, which
/// proves the request valid (so an error gets a proper HTTP status) and puts the prompt in the
/// radix cache: the prompt's other samples then reuse its KV pages, one prefill per prompt.
pub async fn start_choices(
    fe: &Frontend,
    id: RequestId,
    specs: Vec<GenerationSpec>,
    n: usize,
) -> Result<Choices, RequestError> {
    let choice = |prompt: usize, sample: usize| id.choice((prompt * n + sample) as u32);
    let firsts =
        futures_util::future::join_all(specs.iter().enumerate().map(|(i, spec)| async move {
            let mut gen = start(fe, choice(i, 0), spec.clone()).await?;
            let first = match gen.next().await {
                Some(Ok(c)) => c,
                Some(Err(e)) => return Err(e),
                None => return Err(RequestError::internal("the request ended without output")),
            };
            gen.pending = Some(first);
            Ok(gen)
        }))
        .await;
    let mut by_prompt = Vec::with_capacity(specs.len());
    for first in firsts {
        by_prompt.push(first?);
    }
    let prompts = by_prompt.iter().map(|g| g.prompt_ids.clone()).collect();
    for first in &by_prompt {
        fe.metrics.observe_params(n, first.max_new_tokens);
    }
    let mut gens = Vec::with_capacity(specs.len() * n);
    for (i, (spec, first)) in specs.into_iter().zip(by_prompt).enumerate() {
        gens.push(first);
        for j in 1..n {
            let mut sample = spec.clone();
            // Seeded samples stay reproducible and differ from one another.
            if sample.sampling.seed != tokenspeed_engine::NO_SEED {
                sample.sampling.seed = (sample.sampling.seed + j as i64) & i64::MAX;
            }
            gens.push(start(fe, choice(i, j), sample).await?);
        }
    }
    Ok(Choices { gens, prompts, n })
}

impl Choices {
    /// Runs every choice to its end (concurrently).
    pub async fn collect(self) -> Result<Vec<Chunk>, RequestError> {
        futures_util::future::join_all(self.gens.into_iter().map(Generation::collect))
            .await
            .into_iter()
            .collect()
    }

    /// The chunks of all choices as they come, tagged with the choice index. Dropping the
    /// stream aborts every unfinished choice.
    pub fn stream(
        self,
    ) -> impl futures_util::Stream<Item = (usize, Result<Chunk, RequestError>)> + Send {
        let streams = self.gens.into_iter().enumerate().map(|(i, gen)| {
            Box::pin(futures_util::stream::unfold(
                gen,
                move |mut gen| async move { gen.next().await.map(|item| ((i, item), gen)) },
            ))
        });
        futures_util::stream::select_all(streams)
    }
}
