//! A request's prompt as token ids: text through the tokenizer, chat messages through the chat
//! template then the tokenizer, on the blocking pool (a long prompt takes milliseconds).

use serde_json::{Map, Value};

use crate::error::RequestError;
use crate::frontend::Frontend;
use tokenspeed_text::TextTokenizer;

/// What the model is asked to continue.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Raw text; the tokenizer adds its special tokens (e.g. BOS).
    Text(String),
    /// Raw text encoded without the tokenizer's special tokens (`/tokenize`'s
    /// `add_special_tokens: false`).
    PlainText(String),
    Ids(Vec<u32>),
    /// Chat messages rendered by the chat template, which writes any BOS itself.
    Chat {
        messages: Vec<Map<String, Value>>,
        template_vars: Option<Value>,
        add_generation_prompt: bool,
        /// The last (assistant) message is continued: the text ends with its content.
        continue_final_message: bool,
    },
}

/// Why a prompt could not become token ids, in the tokenizer's terms (`validate::refusals`
/// decides what the client is told).
#[derive(Debug)]
pub enum PromptError {
    /// The tokenizer refused a text prompt.
    Text(String),
    /// The chat template failed on the messages.
    Template(String),
    /// The tokenizer refused the rendered chat.
    RenderedChat(String),
    /// `continue_final_message`: the final message's content is not in the rendered prompt.
    FinalMessageNotRendered,
    /// Token ids the tokenizer cannot decode.
    Tokens(String),
    /// The tokenizer refused a text pair (a cross-encoder's query and document).
    Pair(String),
}

pub async fn tokenize_prompt(fe: &Frontend, prompt: Prompt) -> Result<Vec<u32>, RequestError> {
    let tokenizer = fe.tokenizer.clone();
    let ids = tokio::task::spawn_blocking(move || encode(&tokenizer, prompt))
        .await
        .map_err(|e| RequestError::internal(format!("tokenizer task failed: {e}")))??;
    Ok(ids)
}

fn encode(tokenizer: &TextTokenizer, prompt: Prompt) -> Result<Vec<u32>, PromptError> {
    match prompt {
        Prompt::Ids(ids) => Ok(ids),
        Prompt::Text(text) => tokenizer
            .encode(&text, true)
            .map_err(|e| PromptError::Text(e.to_string())),
        Prompt::PlainText(text) => tokenizer
            .encode(&text, false)
            .map_err(|e| PromptError::Text(e.to_string())),
        Prompt::Chat {
            messages,
            template_vars,
            add_generation_prompt,
            continue_final_message,
        } => {
            let final_text = messages
                .last()
                .and_then(|m| m.get("content"))
                .and_then(Value::as_str)
                .map(str::to_owned);
            let messages = Value::Array(messages.into_iter().map(Value::Object).collect());
            let mut text = tokenizer
                .apply_chat_template(&messages, add_generation_prompt, template_vars.as_ref())
                .map_err(|e| PromptError::Template(e.to_string()))?;
            if continue_final_message {
                // The template closes every message: cut after the final one's content.
                let content = final_text.unwrap_or_default();
                match text.rfind(&content) {
                    Some(at) if !content.is_empty() => text.truncate(at + content.len()),
                    _ => return Err(PromptError::FinalMessageNotRendered),
                }
            }
            tokenizer
                .encode(&text, false)
                .map_err(|e| PromptError::RenderedChat(e.to_string()))
        }
    }
}

/// The text of client-sent token ids (`/detokenize`); they were checked against the vocabulary.
pub fn detokenize(fe: &Frontend, ids: &[u32], skip_special: bool) -> Result<String, RequestError> {
    let text = fe
        .tokenizer
        .decode(ids, skip_special)
        .map_err(|e| PromptError::Tokens(e.to_string()))?;
    Ok(text)
}
