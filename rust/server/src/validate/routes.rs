//! The completions, native and tokenizer routes' own fields, checked into the typed requests
//! their adapters (`http/openai.rs`, `http/native.rs`) run.

use crate::config::SamplingDefaults;
use crate::error::RequestError;
use crate::generate::{GenerationSpec, Prompt};
use crate::http::protocol::{CompletionRequest, GenerateRequest, PromptField, TokenizeRequest};

/// A `/v1/completions` request, checked: one spec per prompt, `n` samples each.
pub struct ValidatedCompletion {
    pub specs: Vec<GenerationSpec>,
    pub n: usize,
    pub echo: bool,
    pub want_logprobs: bool,
    /// Top alternatives per token (`logprobs`).
    pub top: u32,
    /// The echoed prompt comes with its tokens' logprobs.
    pub echo_logprobs: bool,
    pub stream: super::StreamSettings,
}

pub fn completion_request(
    req: &CompletionRequest,
    defaults: &SamplingDefaults,
    vocab_size: u32,
    max_logprobs: i64,
) -> Result<ValidatedCompletion, RequestError> {
    if req.suffix.is_some() {
        return Err(RequestError::bad_param(
            "suffix",
            "suffix (fill-in-the-middle) is not supported",
        ));
    }
    let prompts = completion_prompts(req.prompt.clone())?;
    let n = super::choices(req.sampling.n, prompts.len())?;
    if let Some(best_of) = req.best_of.filter(|&b| b as usize != n) {
        return Err(RequestError::bad_param(
            "best_of",
            format!("best_of must equal n ({n}) or be absent (ranking samples is not supported), got {best_of}"),
        ));
    }
    let echo = req.echo.unwrap_or(false);
    let want_logprobs = req.logprobs.is_some();
    let top = super::top_logprobs("logprobs", req.logprobs, vocab_size, max_logprobs)?;
    let stream = super::stream_settings(&req.sampling)?;
    let max_tokens = super::max_tokens("max_tokens", Some(req.max_tokens.unwrap_or(16)))?;
    let mut base = super::generation_spec(
        &req.sampling,
        defaults,
        max_tokens,
        top,
        vocab_size,
        max_logprobs,
    )?;
    let echo_logprobs = echo && want_logprobs;
    if echo_logprobs {
        // The echoed prompt's tokens come with their logprobs (the first has none), and their
        // top alternatives (lm-evaluation-harness reads them).
        base.sampling.prompt_logprobs = true;
        base.sampling.top_logprobs = base.sampling.top_logprobs.max(top);
        base.prompt_logprobs = Some(base.prompt_logprobs.unwrap_or(0).max(top));
    }
    Ok(ValidatedCompletion {
        specs: with_prompts(&base, prompts),
        n,
        echo,
        want_logprobs,
        top,
        echo_logprobs,
        stream,
    })
}

fn completion_prompts(prompt: PromptField) -> Result<Vec<Prompt>, RequestError> {
    let prompts: Vec<Prompt> = match prompt {
        PromptField::Text(t) => vec![Prompt::Text(t)],
        PromptField::Ids(ids) => vec![Prompt::Ids(ids)],
        PromptField::Texts(v) => v.into_iter().map(Prompt::Text).collect(),
        PromptField::IdBatches(v) => v.into_iter().map(Prompt::Ids).collect(),
    };
    if prompts.is_empty() {
        return Err(RequestError::bad_param(
            "prompt",
            "the prompt list is empty",
        ));
    }
    Ok(prompts)
}

/// One spec per prompt, the rest shared.
pub fn with_prompts(base: &GenerationSpec, prompts: Vec<Prompt>) -> Vec<GenerationSpec> {
    prompts
        .into_iter()
        .map(|prompt| GenerationSpec {
            prompt,
            ..base.clone()
        })
        .collect()
}

/// A `/generate` request, checked.
pub struct ValidatedGenerate {
    pub spec: GenerationSpec,
    pub want_logprobs: bool,
    pub top: u32,
    /// `logprob_start_len`: the first prompt token whose logprob is reported (None: SGLang's
    /// default, the last one).
    pub start_len: Option<usize>,
}

pub fn generate_request(
    req: &GenerateRequest,
    defaults: &SamplingDefaults,
    vocab_size: u32,
    max_logprobs: i64,
) -> Result<ValidatedGenerate, RequestError> {
    let prompt = match (req.text.clone(), req.input_ids.clone()) {
        (Some(t), None) => Prompt::Text(t),
        (None, Some(ids)) => Prompt::Ids(ids),
        _ => {
            return Err(RequestError::bad_request(
                "give exactly one of 'text' or 'input_ids'",
            ))
        }
    };
    let sp = &req.sampling_params;
    let want_logprobs = req.return_logprob.unwrap_or(false);
    let top = if want_logprobs {
        super::top_logprobs(
            "top_logprobs_num",
            req.top_logprobs_num.map(|v| v.min(i32::MAX as u32) as i32),
            vocab_size,
            max_logprobs,
        )?
    } else {
        0
    };
    if sp.sampling.n.is_some_and(|n| n != 1) {
        return Err(RequestError::bad_param(
            "n",
            "/generate returns one sample: use /v1/completions for n > 1",
        ));
    }
    let max_new_tokens =
        super::max_tokens("max_new_tokens", Some(sp.max_new_tokens.unwrap_or(128)))?;
    let mut spec = super::generation_spec(
        &sp.sampling,
        defaults,
        max_new_tokens,
        top,
        vocab_size,
        max_logprobs,
    )?;
    spec.prompt = prompt;
    spec.min_new_tokens = sp.min_new_tokens.unwrap_or(spec.min_new_tokens);
    let start_len = match req.logprob_start_len.filter(|_| want_logprobs) {
        None | Some(-1) => None,
        Some(s) => Some(usize::try_from(s).map_err(|_| {
            RequestError::bad_param(
                "logprob_start_len",
                format!("logprob_start_len must be -1 or at least 0, got {s}"),
            )
        })?),
    };
    if start_len.is_some() {
        // The prompt's logprobs come through the engine's prompt-logprobs path.
        spec.sampling.prompt_logprobs = true;
        spec.prompt_logprobs = Some(spec.prompt_logprobs.unwrap_or(0).max(top));
    }
    Ok(ValidatedGenerate {
        spec,
        want_logprobs,
        top,
        start_len,
    })
}

/// `logprob_start_len` against the tokenized prompt: it must start within it.
pub fn logprob_start(start_len: Option<usize>, prompt_len: usize) -> Result<usize, RequestError> {
    match start_len {
        Some(s) if s >= prompt_len => Err(RequestError::bad_param(
            "logprob_start_len",
            format!("logprob_start_len ({s}) must be less than the prompt's {prompt_len} tokens"),
        )),
        // SGLang's default: only the last prompt token is listed (with a null logprob).
        s => Ok(s.unwrap_or(prompt_len.saturating_sub(1))),
    }
}

/// What `/tokenize` renders: text (with or without the tokenizer's special tokens) or chat
/// messages prepared as the chat route prepares them.
pub fn tokenize_request(req: TokenizeRequest) -> Result<Prompt, RequestError> {
    match (req.prompt.or(req.text), req.messages) {
        (Some(t), None) if req.add_special_tokens == Some(false) => Ok(Prompt::PlainText(t)),
        (Some(t), None) => Ok(Prompt::Text(t)),
        (None, Some(messages)) => Ok(Prompt::Chat {
            messages: super::chat::template_messages(messages),
            template_vars: None,
            add_generation_prompt: req.add_generation_prompt.unwrap_or(true),
            continue_final_message: false,
        }),
        _ => Err(RequestError::bad_request(
            "give exactly one of 'prompt' or 'messages'",
        )),
    }
}

/// Token ids a client sends to be decoded: each within the vocabulary.
pub fn token_ids(ids: &[u32], vocab_size: u32) -> Result<(), RequestError> {
    match ids.iter().find(|&&t| t >= vocab_size) {
        Some(bad) => Err(RequestError::bad_param(
            "tokens",
            format!(
                "token id {bad} is out of range (vocabulary size {bad_vocab})",
                bad_vocab = vocab_size
            ),
        )),
        None => Ok(()),
    }
}
